"""Shards sized by measured speed, for mismatched devices (the slowest shard sets the pace).

    plan = tpcore.plan_partition(comm, cfg)             # every rank measures, the plan is shared
    print(plan)                                          # rank, speed, share, heads, ffn cols, vocab rows, MB
    model = tpcore.models.TransformerLM(cfg, comm, plan=plan)  # or **plan.model_kwargs()
    plan.save("plan.json"); plan = tpcore.Plan.load("plan.json")

Each rank times tpcore's own kernels (tp_linear_forward, so the compute throttle of
tpcore.set_throttle counts) on the model's shapes: a GEMM of `rows` (default 128) prompt
rows by the hidden and FFN dimensions (prefill), and a GEMV over a weight of the size of
its share of the model, clamped to [1, 64] MiB (decode reads every weight once per token:
memory bandwidth).  Ranks on one host measure one after the other, so that they do not
share the cores while they are timed.  The measurements are all-gathered and every rank
computes the same plan from them with plan_from_measurements, a pure function.

The speed of a rank is, relative to the fastest rank, its GEMM rate (objective="prefill"),
its GEMV bandwidth ("decode"), or their harmonic mean ("both", default: the time of a
prefill chunk plus a decode step).  Every tensor-parallel dimension is split in proportion
to speed by largest remainders (tpcore.partition), every rank getting at least one unit
when there are as many units as ranks:
  query heads  in whole GQA groups (head_unit="group") when kv_heads < heads and every rank
               can get a group, and the group split is at most 10% more uneven than the
               head split; else in whole heads (a rank may then start mid-group and holds
               the KV heads its query heads use: head_unit="head"); "auto" chooses;
  MLP columns  in units of align["ffn"]: by default the largest power of two <= 32 that
               divides ffn_hidden and leaves at least 8 units per rank (BLAS-friendly
               widths without coarse shares; 1 for odd sizes);
  vocabulary   rows of the embedding / LM head, align["vocab"] by the same rule.
Memory: memory_limits (bytes per rank) or, if None, this host's MemAvailable divided by the
ranks on it.  A rank whose proportional share does not fit is capped at what fits and the
rest goes to the others by speed (water filling); the plan's estimated parameter bytes
(weights in dtype, float32 norms and biases, plus the KV cache when cache=(batch, max_len)
is given) are checked exactly per rank, and a model that fits nowhere is a clear error.
Activations and workspaces are not counted: leave room for them in the limits.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tpcore import _C
from tpcore.distributed.agree import agree
from tpcore.distributed.comm import Comm
from tpcore.nn.plan import (OBJECTIVES, Dims, Plan, PlanError, check_align, check_memory, check_speeds,
                            dims_of, plan_from_measurements, rank_bytes)
from tpcore.utils.args import int_arg, shown
from tpcore.utils.dtypes import WEIGHT_FORMATS, bytes_per_element

__all__ = ["Dims", "Plan", "PlanError", "dims_of", "plan_from_measurements", "measure", "plan_partition"]


def _timed(fn, reps: int, budget: float) -> float:
    """Seconds per call of fn: the fastest of reps samples (at least 2, fewer when over budget
    seconds), each a group of calls of at least ~2 ms, so that the throttle's sleep, which
    short calls carry to later ones, is counted in full."""
    t0 = time.perf_counter()
    fn()  # warm up, and the size of a group
    group = max(1, min(1000, int(2e-3 / max(time.perf_counter() - t0, 1e-7))))
    best, spent = math.inf, 0.0
    for i in range(reps):
        t0 = time.perf_counter()
        for _ in range(group):
            fn()
        dt = time.perf_counter() - t0
        best = min(best, dt / group)
        spent += dt
        if i >= 1 and spent > budget:
            break
    return best


def measure(dims, world: int, rows: int = 128, dtype: str = "float32", reps: int = 7,
            budget: float = 0.3) -> Dict[str, float]:
    """This process's GEMM rate (GFLOP/s, `rows` prompt rows through an fc1-like weight of
    this rank's even share of the MLP) and GEMV bandwidth (GB/s, one token through a weight of
    its share of the model, clamped to [1, 64] MiB) on tpcore's kernels, the throttle included."""
    d = dims_of(dims, "measure")
    wb = bytes_per_element(dtype)
    rng = np.random.default_rng(1234)
    C = d.hidden
    n = max(1, -(-d.ffn // world))
    n = max(n, min(d.ffn, max(1, (1 << 18) // C)))  # at least ~1 MiB of float32 weight where the model has it
    w = (rng.standard_normal((n, C), dtype=np.float32) * 0.02)
    x = rng.standard_normal((rows, C), dtype=np.float32)
    from tpcore.nn.quant import block_size, is_quantized, quantize
    fmt = dtype if is_quantized(dtype) else None
    if fmt is not None and C % block_size(fmt):  # measured at the nearest width of whole blocks
        C = max(block_size(fmt), C // block_size(fmt) * block_size(fmt))
        w, x = w[:, :C].copy(), x[:, :C].copy()
    if fmt is not None:
        w = quantize(w, fmt)
    elif dtype != "float32":
        w = _C.convert(w, dtype, None)
    y = np.empty((rows, n), np.float32)
    t = _timed(lambda: _C.linear_forward(x, w, None, y, fmt), reps, budget)
    gemm = 2.0 * rows * C * n / t / 1e9
    share = sum(rank_bytes(d, [d.heads] if d.heads else [0], [d.ffn], [d.vocab] if d.vocab else [0], wb, None)) / world
    nbytes = int(min(64 << 20, max(1 << 20, share)))
    rows_w = max(1, int(nbytes // (C * wb)))
    w2 = rng.standard_normal((rows_w, C), dtype=np.float32)
    if fmt is not None:
        w2 = quantize(w2, fmt)
    elif dtype != "float32":
        w2 = _C.convert(w2, dtype, None)
    x1 = rng.standard_normal((1, C), dtype=np.float32)
    y1 = np.empty((1, rows_w), np.float32)
    t1 = _timed(lambda: _C.linear_forward(x1, w2, None, y1, fmt), reps, budget)
    gemv = rows_w * C * wb / t1 / 1e9
    return {"gemm_gflops": gemm, "gemv_gbs": gemv, "gemm_s": t, "gemv_s": t1, "gemv_bytes": rows_w * C * wb}


def host_memory_budget(local_ranks: int) -> int:
    """MemAvailable of /proc/meminfo divided by the ranks on this host (bytes)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return max(1, int(line.split()[1]) * 1024 // max(1, local_ranks))
    except OSError:
        pass
    return max(1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") // max(1, local_ranks))


def speeds_from(meas: Sequence[Dict[str, float]], objective: str) -> List[float]:
    """Speeds relative to the fastest rank: GEMM rate, GEMV bandwidth or their harmonic mean."""
    g = [m["gemm_gflops"] for m in meas]
    b = [m["gemv_bytes"] / m["gemv_s"] for m in meas]
    gr = [x / max(g) for x in g]
    br = [x / max(b) for x in b]
    if objective == "prefill":
        s = gr
    elif objective == "decode":
        s = br
    else:
        s = [2.0 / (1.0 / x + 1.0 / y) for x, y in zip(gr, br)]
    top = max(s)
    return [x / top for x in s]


def plan_partition(comm: Comm, config_or_layer_dims: Any, memory_limits: Any = None, align: Any = None,
                   speeds: Optional[Sequence[float]] = None, dtype: str = "float32", head_unit: str = "auto",
                   objective: str = "both", rows: int = 128, cache: Optional[Tuple[int, int]] = None,
                   budget: float = 0.3) -> Plan:
    """Measure every rank (unless speeds are given), gather, and plan (see the module doc).

    Parameters
    ----------
    comm : Comm
        The ranks to plan for.
    config_or_layer_dims : Config, (int, int) or dict
        The model: a tpcore.Config, a (hidden, ffn_hidden) pair for a plain MLP
        (ParallelMLP or a Column/RowParallelLinear pair), or a dict of Dims' fields.
    memory_limits : sequence of int or dict, optional
        Bytes per rank.  Default None: this host's MemAvailable divided by its ranks.
    align : dict, optional
        {"ffn": units, "vocab": units}.  Default None: chosen (module doc).
    speeds : sequence of float, optional
        One per rank: skip the measurement.  Default None: measure.
    dtype : str, default "float32"
        The weights' dtype (measured and estimated).
    head_unit : {"auto", "group", "head"}, default "auto"
    objective : {"both", "prefill", "decode"}, default "both"
        What speed means: GEMM rate, GEMV bandwidth, or their harmonic mean.
    rows : int, default 128
        Prompt rows of the measured GEMM, in [1, 65536].
    cache : (int, int), optional
        (batch, max_len): count the KV cache in the memory check.
    budget : float, default 0.3
        Seconds each timed kernel may take in all (fewer repetitions past it).

    Returns
    -------
    Plan
        The same on every rank.

    Raises
    ------
    TypeError, ValueError
        A bad argument, or ranks that passed different arguments (on every rank).
    PlanError
        The model does not fit the memory limits.

    Notes
    -----
    Collective: every rank calls it with the same arguments; an all-gather checks them,
    ranks on one host measure in turn (barriers), and the measurements are all-gathered.
    """
    who = "plan_partition"
    if not isinstance(comm, Comm):
        raise TypeError(f"{who}: comm must be a tpcore.Comm, got {type(comm).__name__}")
    world = comm.size
    err, key = None, None
    try:  # argument errors before any measurement, on every rank alike (agreed below)
        d = dims_of(config_or_layer_dims, who)
        if objective not in OBJECTIVES:
            raise ValueError(f"{who}: objective must be one of {OBJECTIVES}, got {objective!r}")
        if dtype not in WEIGHT_FORMATS:
            raise ValueError(f"{who}: dtype must be one of {sorted(WEIGHT_FORMATS)}, got {shown(dtype)}")
        rows = int_arg(rows, who, "rows", lo=1, hi=1 << 16)
        if speeds is not None:
            speeds = check_speeds(speeds, world, who)
        mem = check_memory(memory_limits, world, who)
        check_align(align, d, world, who, dtype if dtype in WEIGHT_FORMATS else "float32")
        key = json.dumps([dataclasses.asdict(d), objective, dtype, rows, head_unit, mem, repr(align), repr(cache),
                          speeds is None], default=repr).encode()
    except (TypeError, ValueError) as e:
        err = e
    # every rank must plan from the same arguments: a mismatch is a ValueError on every rank here,
    # not a plan that differs per rank (found later, or never)
    agree(comm, who, [("the arguments (model dims, memory_limits, align, dtype, objective, rows, head_unit, "
                       "cache) differ", (np.frombuffer(key or b"-", np.uint8),), None)], err)
    meas = None
    if speeds is None:
        mine = None
        turns = comm.local_size > 1
        for r in range(world):
            if turns:
                comm.barrier()
            if r == comm.rank or not turns:
                if mine is None:
                    mine = measure(d, world, rows=rows, dtype=dtype, budget=budget)
        row = np.array([[mine["gemm_gflops"], mine["gemv_gbs"], mine["gemm_s"], mine["gemv_s"], mine["gemv_bytes"]]])
        got = comm.all_gather(row)
        meas = [{"gemm_gflops": float(a), "gemv_gbs": float(b), "gemm_s": float(c), "gemv_s": float(e),
                 "gemv_bytes": float(f)} for a, b, c, e, f in got.tolist()]
        speeds = speeds_from(meas, objective)
    else:
        got = comm.all_gather(np.array([speeds], np.float64))
        if not all(list(row) == list(got[0]) for row in got):
            raise ValueError(f"{who}: the ranks passed different speeds: {got.tolist()}")
    if mem is None:
        mine_mem = host_memory_budget(comm.local_size)
        mem = [int(x) for x in comm.all_gather(np.array([mine_mem], np.int64)).tolist()]
    plan = plan_from_measurements(d, speeds, mem, align, head_unit=head_unit, dtype=dtype, cache=cache)
    plan.measurements = None if meas is None else {"objective": objective, "rows": rows, "ranks": meas}
    return plan

