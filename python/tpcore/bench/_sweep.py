"""The measurement loop shared by tpcore and its peers (gloo, MPI).

Every implementation runs the same code: `sweep(impl, plan)` walks the ops and
sizes of a `Plan` on one rank and returns that rank's rows.  An implementation
only supplies a barrier, a way to agree on a number (rank 0's value wins) and,
per op and size, a `Case`: the NumPy view each rank rewrites before a call, the
view the result lands in, and the call itself.

Method, per op and size:
  1. build the case (buffers allocated and touched, untimed);
  2. warm-up calls, each with the full rewrite + barrier + call sequence; rank 0
     times the last one as a whole and picks the iteration count so that the
     size takes about plan.target_s; everyone adopts rank 0's count;
  3. per timed iteration: rewrite the input from a prepared source (np.copyto,
     untimed), barrier (untimed), then time the single call with
     time.perf_counter_ns;
  4. correctness: fill the input with the check pattern, call once, compare
     the output with a NumPy reference that the rank computes itself.
The rank reports its mean, min and median per-call time; `combine` then takes,
per size, the max over ranks of the per-rank means (a collective is finished
when its slowest rank is).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

import numpy as np

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
MODES = ("private", "registered")


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factors: busbw = algbw * factor."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def element_count(op: str, nbytes: int, n: int, itemsize: int) -> int:
    """Elements of the op's "size" buffer for a nominal size in bytes (as
    nccl-tests: the output of all_gather, the input of reduce_scatter, the
    buffer of all_reduce and broadcast, each rank's input (= its output) of
    all_to_all), rounded down to a multiple of the rank count where the buffer
    is split over ranks, and at least one per rank."""
    count = max(1, nbytes // itemsize)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        count = max(n, count // n * n)
    return count


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise SystemExit("--dtype bfloat16 needs the ml_dtypes package (pip install ml_dtypes)") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass
class Plan:
    """What to measure; the same on every rank and for every implementation."""
    ops: List[str]
    sizes: List[int]                  # nominal sizes in bytes
    dtype: str = "float32"
    modes: List[str] = field(default_factory=lambda: ["private"])
    iters: Optional[int] = None       # fixed iteration count, or None: auto
    warmup: int = 2
    target_s: float = 0.3             # auto: seconds of timed calls per size
    min_iters: int = 3
    max_iters: int = 1000
    check: bool = True

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        return cls(**d)


@dataclass
class Case:
    """One op at one size on one rank.

    inp   the op's input; rewritten from a prepared source before every call
    out   where the result lands (may be inp itself, or overlap it)
    call  runs the collective once
    """
    inp: np.ndarray
    out: np.ndarray
    call: Callable[[], object]


class Pattern:
    """Rank-dependent test values that every dtype holds exactly:
    f(rank, i) = (rank + 1) + i % 5, for the element at global index i."""

    def __init__(self, max_count: int, dtype: np.dtype):
        self.dtype = dtype
        self._base = np.tile(np.arange(5, dtype=np.uint8), max_count // 5 + 1)[:max_count]

    def values(self, rank: int, start: int, count: int) -> np.ndarray:
        v = self._base[start:start + count].astype(self.dtype)
        v += np.asarray(rank + 1).astype(self.dtype)
        return v

    def expected(self, op: str, rank: int, n: int, count: int) -> np.ndarray:
        """The reference result on this rank for op (sum, root 0, in place),
        where count is the element count of the op's "size" buffer."""
        if op == "broadcast":
            return self.values(0, 0, count)
        if op == "all_gather":
            c = count // n
            return np.concatenate([self.values(p, 0, c) for p in range(n)])
        if op == "all_to_all":  # block `rank` of every rank's input, in rank order
            c = count // n
            return np.concatenate([self.values(p, rank * c, c) for p in range(n)])
        if op == "all_reduce":
            start, c = 0, count
        elif op == "reduce_scatter":
            c = count // n
            start = rank * c
        else:
            raise ValueError(op)
        acc = self.values(0, start, c)
        for p in range(1, n):
            acc += self.values(p, start, c)  # in the dtype: integer sums wrap as in C
        return acc

    def input_values(self, op: str, rank: int, n: int, count: int) -> np.ndarray:
        """What this rank's input holds for the check."""
        if op == "all_gather":
            return self.values(rank, 0, count // n)
        return self.values(rank, 0, count)


class Progress:
    """Progress lines on stderr: one rewritten line on a terminal, plain lines
    (fewer of them) otherwise.  Writes to the process's real stderr, so that
    inside tpcore.spawn the lines bypass the rank-prefixing relay."""

    def __init__(self, enabled: bool = True):
        self.stream = sys.__stderr__ or sys.stderr
        self.enabled = enabled and self.stream is not None
        self.tty = self.enabled and self.stream.isatty()
        self._dirty = False

    def status(self, text: str, important: bool = False) -> None:
        if not self.enabled:
            return
        if self.tty:
            cols = shutil.get_terminal_size((120, 24)).columns - 1
            self.stream.write("\r\033[K" + text[:cols])
            self._dirty = True
        elif important:
            self.stream.write(text + "\n")
        self.stream.flush()

    def done(self, text: Optional[str] = None) -> None:
        if not self.enabled:
            return
        if self.tty and self._dirty:
            self.stream.write("\r\033[K")
            self._dirty = False
        if text:
            self.stream.write(text + "\n")
        self.stream.flush()


def human_bytes(b: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= scale:
            v = b / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(b)} B"


def choose_iters(t_iter_s: float, plan: Plan) -> int:
    if plan.iters:
        return plan.iters
    k = int(plan.target_s / max(t_iter_s, 1e-7))
    return max(plan.min_iters, min(plan.max_iters, k))


class Impl:
    """What an implementation supplies to `sweep` (see tpcore's, gloo's and
    MPI's in this package)."""
    name = "?"
    rank = 0
    size = 1

    def barrier(self) -> None:
        raise NotImplementedError

    def agree(self, value: int) -> int:
        """Rank 0's value, on every rank."""
        raise NotImplementedError

    def unsupported(self, op: str, mode: str) -> Optional[str]:
        """None, or why op cannot be measured in this mode."""
        return None

    def case(self, op: str, mode: str, count: int, dtype: np.dtype) -> Case:
        raise NotImplementedError

    def zero_copy_calls(self) -> Optional[int]:
        """Calls that took a zero-copy path so far, where the library says."""
        return None

    def label(self, mode: str) -> str:
        return f"{self.name} {mode}"


def sweep(impl: Impl, plan: Plan, progress: Optional[Progress] = None) -> list:
    """Measure every (mode, op, size) of plan on this rank; returns this rank's
    rows (dicts)."""
    n, rank = impl.size, impl.rank
    dtype = numpy_dtype(plan.dtype)
    es = dtype.itemsize
    max_count = max(element_count(op, s, n, es) for op in plan.ops for s in plan.sizes)
    pattern = Pattern(max_count, dtype)
    show = progress if (progress is not None and rank == 0) else None
    rows = []
    for mode in plan.modes:
        for op in plan.ops:
            why = impl.unsupported(op, mode)
            if why:
                rows.append({"op": op, "mode": mode, "unsupported": why})
                continue
            t_op = time.perf_counter()
            if show:
                show.status(f"[bench] {impl.label(mode)} {op}: {human_bytes(plan.sizes[0])} .. "
                            f"{human_bytes(plan.sizes[-1])}", important=True)
            for nominal in plan.sizes:
                count = element_count(op, nominal, n, es)
                rows.append(_measure(impl, plan, op, mode, nominal, count, dtype, pattern, show))
            if show:
                show.done(f"[bench] {impl.label(mode)} {op}: done in {time.perf_counter() - t_op:.1f} s"
                          if not show.tty else None)
    if show:
        show.done()
    return rows


def _measure(impl, plan, op, mode, nominal, count, dtype, pattern, show) -> dict:
    n, rank = impl.size, impl.rank
    case = impl.case(op, mode, count, dtype)
    src = pattern.input_values(op, rank, n, count)
    assert src.shape == case.inp.shape, (op, src.shape, case.inp.shape)
    call, inp, barrier = case.call, case.inp, impl.barrier
    perf = time.perf_counter_ns

    # Warm-up; rank 0 times the last whole iteration to pick the count.
    t_iter = 0.0
    for _ in range(max(1, plan.warmup)):
        t0 = time.perf_counter()
        np.copyto(inp, src)
        barrier()
        call()
        t_iter = time.perf_counter() - t0
    iters = impl.agree(choose_iters(t_iter, plan) if rank == 0 else 0)
    if show:
        show.status(f"[bench] {impl.label(mode)} {op} {human_bytes(count * dtype.itemsize)}: "
                    f"{iters} iterations", important=count * dtype.itemsize >= (64 << 20))

    zc0 = impl.zero_copy_calls()
    times = np.empty(iters, dtype=np.int64)
    for i in range(iters):
        np.copyto(inp, src)
        barrier()
        t0 = perf()
        call()
        times[i] = perf() - t0
    zc1 = impl.zero_copy_calls()

    wrong = None
    if plan.check:
        np.copyto(inp, src)  # the timing source is the check pattern itself
        barrier()
        call()
        expect = pattern.expected(op, rank, n, count)
        wrong = int(np.count_nonzero(case.out.reshape(-1) != expect))
    barrier()
    row = {"op": op, "mode": mode, "nominal": nominal, "count": count, "bytes": count * dtype.itemsize,
           "iters": iters, "mean_ns": float(times.mean()), "min_ns": float(times.min()),
           "median_ns": float(np.median(times)), "wrong": wrong}
    if zc0 is not None and zc1 is not None:
        row["zero_copy"] = (zc1 - zc0) / iters
    del case
    return row


def combine(impl_name: str, n: int, dtype: str, per_rank: list) -> list:
    """Rows of all ranks -> one row per (mode, op, size): time = max over ranks
    of the per-rank mean, #wrong = sum over ranks."""
    out = []
    for rows in zip(*per_rank):
        r0 = rows[0]
        if "unsupported" in r0:
            out.append({"impl": impl_name, "op": r0["op"], "mode": r0["mode"], "unsupported": r0["unsupported"]})
            continue
        t_ns = max(r["mean_ns"] for r in rows)
        algbw = r0["bytes"] / t_ns if t_ns > 0 else 0.0  # bytes/ns == GB/s
        wrongs = [r["wrong"] for r in rows]
        row = {"impl": impl_name, "mode": r0["mode"], "op": r0["op"], "nranks": n, "dtype": dtype,
               "nominal": r0["nominal"], "bytes": r0["bytes"], "count": r0["count"], "iters": r0["iters"],
               "time_us": t_ns / 1e3, "algbw": algbw, "busbw": algbw * busbw_factor(r0["op"], n),
               "wrong": None if any(w is None for w in wrongs) else sum(wrongs),
               "rank_mean_us": [r["mean_ns"] / 1e3 for r in rows],
               "rank_min_us": [r["min_ns"] / 1e3 for r in rows],
               "rank_median_us": [r["median_ns"] / 1e3 for r in rows]}
        if "zero_copy" in r0:
            row["zero_copy"] = min(r.get("zero_copy", 0.0) for r in rows)
        out.append(row)
    return out


def memcpy_reference(sizes: List[int], plan: Plan, progress: Optional[Progress] = None) -> list:
    """Single-thread np.copyto(dst, src) bandwidth at each size (this process,
    nothing else running): GB/s = size / mean time per copy."""
    top = max(sizes)
    src = np.empty(top, dtype=np.uint8)
    dst = np.empty(top, dtype=np.uint8)
    src[:] = 1
    dst[:] = 0  # touch both (page faults are not part of a copy)
    rows = []
    perf = time.perf_counter_ns
    if progress:
        progress.status(f"[bench] memcpy reference: {human_bytes(sizes[0])} .. {human_bytes(top)}", important=True)
    for nb in sizes:
        if progress:
            progress.status(f"[bench] memcpy {human_bytes(nb)}")
        s, d = src[:nb], dst[:nb]
        t_iter = 0.0
        for _ in range(max(1, plan.warmup)):
            t0 = time.perf_counter()
            np.copyto(d, s)
            t_iter = time.perf_counter() - t0
        iters = choose_iters(t_iter, plan)
        times = np.empty(iters, dtype=np.int64)
        for i in range(iters):
            t0 = perf()
            np.copyto(d, s)
            times[i] = perf() - t0
        t_ns = float(times.mean())
        rows.append({"impl": "memcpy", "mode": "single-thread", "op": "memcpy", "nominal": nb, "bytes": nb,
                     "iters": iters, "time_us": t_ns / 1e3, "algbw": nb / t_ns, "busbw": nb / t_ns,
                     "min_us": float(times.min()) / 1e3})
    if progress:
        progress.done()
    return rows


def parse_bytes(text: str) -> int:
    """'8', '4K', '4KiB', '256M', '1G' (binary units) -> bytes."""
    t = str(text).strip().upper().replace("IB", "").rstrip("B")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    try:
        v = float(t) * mult
    except ValueError:
        raise ValueError(f"not a size in bytes: {text!r} (examples: 8, 4K, 16M, 1G)") from None
    if v < 1 or v != int(v):
        raise ValueError(f"size must be a whole number of bytes >= 1, got {text!r}")
    return int(v)


def size_list(lo: int, hi: int, factor: int) -> List[int]:
    if factor < 2:
        raise ValueError(f"--factor must be >= 2, got {factor}")
    if hi < lo:
        raise ValueError(f"--max-bytes ({hi}) is smaller than --min-bytes ({lo})")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


def env_info() -> dict:
    """What the tables' header shows: host, CPUs, versions, tuning variables."""
    import platform
    import socket

    info = {"hostname": socket.gethostname(), "nproc": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu": _cpu_model(), "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    try:
        import tpcore
        info["tpcore"] = tpcore.__version__
        info["tpcore_build"] = tpcore.build_info()
    except Exception as e:  # noqa: BLE001 - the header still prints
        info["tpcore"] = f"unavailable ({e})"
    try:
        info["loadavg"] = list(os.getloadavg())
    except OSError:
        info["loadavg"] = None
    for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"):
        info[k] = os.environ.get(k)
    info["env"] = {k: v for k, v in sorted(os.environ.items())
                   if k.startswith(("OPENBLAS_", "OMP_", "TPCORE_", "OMPI_MCA_", "GLOO_"))}
    return info


def _cpu_model() -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
