"""Peers measured next to tpcore, each optional and imported lazily:

gloo  torch.distributed with the gloo backend, on processes started with
      multiprocessing ("spawn"), rendezvous over TCP at 127.0.0.1 on a free
      port; one torch thread per rank (torch.set_num_threads(1)).
mpi   mpi4py over the local MPI (Open MPI), as a subprocess
      `mpirun --allow-run-as-root --oversubscribe -n N python -m
      tpcore.bench._mpi_peer PLAN OUT` whose rank 0 writes JSON.
tpcore-mpi  tpcore itself on its mpi backend (the MPI plugin), under the same
      mpirun (`_mpi_peer --tpcore`): the shm-vs-mpi rows of the tables.

Both run the same `sweep` as tpcore (same timing method and check), on
ordinary NumPy arrays (torch tensors sharing them, for gloo), in place like
tpcore: MPI_IN_PLACE for MPI; for gloo all_gather's input is the rank's block
of the output and reduce_scatter's output the rank's block of the input.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Optional

import numpy as np

from tpcore.utils import cleanup as _cleanup
from tpcore.bench._sweep import Case, Impl, Plan, Progress, combine, sweep

PEERS = ("gloo", "mpi", "tpcore-mpi")


@dataclass
class PeerResult:
    name: str
    rows: Optional[list] = None         # combined rows; None: not measured
    note: str = ""                      # why not measured, or remarks
    info: dict = field(default_factory=dict)


def availability(name: str, mpirun: str = "mpirun") -> Optional[str]:
    """None if the peer can be tried, else a one-line reason."""
    if name == "gloo":
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install torch)"
        return None
    if name == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py; needs an MPI such as openmpi-bin libopenmpi-dev)"
        if shutil.which(mpirun) is None:
            return f"{mpirun} is not on PATH (install Open MPI: openmpi-bin)"
        return None
    if name == "tpcore-mpi":
        if shutil.which(mpirun) is None:
            return f"{mpirun} is not on PATH (install Open MPI: openmpi-bin)"
        from tpcore import _C
        return _C.Comm.probe("mpi")
    raise ValueError(f"unknown peer {name!r}")


def _peer_plan(plan: Plan) -> Plan:
    d = plan.to_json()
    d["modes"] = ["private"]  # peers have no registered memory
    return Plan.from_json(d)


# --------------------------------------------------------------------- gloo

_TORCH_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64")


class GlooImpl(Impl):
    name = "gloo"

    def __init__(self, dist, torch, plan: Plan):
        self.dist, self.torch = dist, torch
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        # Newer torch names first (the older ones warn that they are deprecated).
        self._ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._rs = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)
        self._rs_missing = self._probe_reduce_scatter() if "reduce_scatter" in plan.ops else None

    def _probe_reduce_scatter(self) -> Optional[str]:
        if self._rs is None:
            return "this torch has no reduce_scatter_tensor"
        t = self.torch
        try:
            out = t.zeros(1)
            self._rs(out, t.ones(self.size))
        except Exception as e:  # noqa: BLE001 - gloo raises for unsupported collectives
            return f"gloo lacks reduce_scatter here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        return None

    def barrier(self) -> None:
        self.dist.barrier()

    def agree(self, value: int) -> int:
        t = self.torch.tensor([value], dtype=self.torch.int64)
        self.dist.broadcast(t, src=0)
        return int(t.item())

    def unsupported(self, op: str, mode: str) -> Optional[str]:
        if mode != "private":
            return "no registered memory in gloo"
        if op == "reduce_scatter":
            return self._rs_missing
        return None

    def case(self, op: str, mode: str, count: int, dtype: np.dtype) -> Case:
        dist, r, n = self.dist, self.rank, self.size
        buf = np.zeros(count, dtype=dtype)
        if dtype.name == "bfloat16":  # ml_dtypes' bfloat16: share the bits through int16
            t = self.torch.from_numpy(buf.view(np.int16)).view(self.torch.bfloat16)
        else:
            t = self.torch.from_numpy(buf)  # shares buf's memory
        if op == "all_reduce":
            return Case(buf, buf, lambda: dist.all_reduce(t))
        if op == "broadcast":
            return Case(buf, buf, lambda: dist.broadcast(t, src=0))
        if op == "all_to_all":  # out of place, as tpcore's
            out = np.zeros(count, dtype=dtype)
            tout = self.torch.from_numpy(out.view(np.int16) if dtype.name == "bfloat16" else out)
            if dtype.name == "bfloat16":
                tout = tout.view(self.torch.bfloat16)
            return Case(buf, out, lambda: dist.all_to_all_single(tout, t))
        c = count // n
        block, tblock = buf[r * c:(r + 1) * c], t[r * c:(r + 1) * c]
        if op == "all_gather":
            return Case(block, buf, lambda: self._ag(t, tblock))
        if op == "reduce_scatter":
            return Case(buf, block, lambda: self._rs(tblock, t))
        raise ValueError(f"unknown op {op!r}")


@contextlib.contextmanager
def gloo_rank(rank: int, n: int, port: int, conn, threads: int, timeout_s: float = 300.0):
    """The life of one torch.distributed (gloo) rank in a multiprocessing "spawn" child:
    rendezvous on 127.0.0.1:port, torch with `threads` threads, yields (torch, dist); the body
    sends ("ok", rows, info) on conn.  Any exception goes to the parent as ("err", traceback)
    instead; the process group is always torn down and conn closed."""
    dist = None
    try:
        _cleanup.die_with_parent()  # never outlive the benchmark
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(n))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        dist.init_process_group("gloo", rank=rank, world_size=n, timeout=timedelta(seconds=timeout_s))
        yield torch, dist
    except BaseException:  # noqa: BLE001 - everything goes to the parent
        try:
            conn.send(("err", traceback.format_exc()))
        except Exception:  # noqa: BLE001 - parent gone: nothing else to do
            pass
    finally:
        try:
            if dist is not None and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass
        conn.close()


def run_ranks(n: int, target, args: tuple, timeout: float, name: str):
    """Start target(rank, n, port, *args, conn) in n "spawn" processes and collect each rank's
    ("ok", rows, info).  Returns (rows per rank, info of the last, None) or (None, {}, note)
    when a rank failed, died or the run passed `timeout`; no process outlives the call."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs, conns, results, errors, info = [], [], {}, {}, {}
    try:
        for r in range(n):
            rd, wr = ctx.Pipe(duplex=False)
            p = ctx.Process(target=target, args=(r, n, port, *args, wr), name=f"{name}-rank{r}")
            p.start()
            wr.close()
            procs.append(p)
            conns.append(rd)
        pending = {c: r for r, c in enumerate(conns)}
        t_end = time.monotonic() + timeout
        while pending and not errors:
            left = t_end - time.monotonic()
            if left <= 0:
                return None, {}, f"{name} run did not finish within {timeout:.0f} s; stopped"
            for c in wait(list(pending), timeout=min(left, 1.0)):
                r = pending.pop(c)
                try:
                    msg = c.recv()
                except EOFError:
                    errors[r] = f"rank {r} exited (code {procs[r].exitcode}) without a result"
                    continue
                if msg[0] == "ok":
                    results[r], info = msg[1], msg[2]
                else:
                    errors[r] = msg[1]
        if errors:
            r, tb = sorted(errors.items())[0]
            last = tb.strip().splitlines()[-1] if tb.strip() else "?"
            print(f"[bench] {name} rank {r} failed:\n{tb}", file=sys.stderr)
            return None, {}, f"{name} run failed on rank {r}: {last}"
        return [results[r] for r in range(n)], info, None
    finally:
        finished = len(results) == n  # else: failed, timed out or interrupted; stop the ranks now
        for p in procs:
            p.join(timeout=5 if finished else 0.2)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for c in conns:
            c.close()


def _gloo_worker(rank: int, n: int, port: int, plan_json: dict, progress: bool, conn) -> None:
    """One gloo rank of the collectives sweep."""
    with gloo_rank(rank, n, port, conn, threads=1) as (torch, dist):
        plan = Plan.from_json(plan_json)
        rows = sweep(GlooImpl(dist, torch, plan), plan, Progress(progress))
        conn.send(("ok", rows, {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo(n: int, plan: Plan, timeout: float, progress: bool) -> PeerResult:
    if plan.dtype not in _TORCH_DTYPES:
        return PeerResult("gloo", note=f"dtype {plan.dtype} is not measured with gloo "
                                       f"(supported here: {', '.join(_TORCH_DTYPES)})")
    per_rank, info, note = run_ranks(n, _gloo_worker, (_peer_plan(plan).to_json(), progress), timeout, "gloo")
    if per_rank is None:
        return PeerResult("gloo", note=note)
    return PeerResult("gloo", rows=combine("gloo", n, plan.dtype, per_rank), info=info)


# ---------------------------------------------------------------------- MPI

def run_mpi(n: int, plan: Plan, timeout: float, progress: bool, mpirun: str = "mpirun",
            extra_args: str = "", name: str = "mpi") -> PeerResult:
    """mpi4py's sweep (name "mpi"), or tpcore's on its mpi backend (name "tpcore-mpi")."""
    if plan.dtype in ("float16", "bfloat16") and name == "mpi":
        return PeerResult("mpi", note=f"MPI has no standard {plan.dtype} type; not measured")
    with tempfile.TemporaryDirectory(prefix="tpcore-bench-mpi-") as tmp:
        plan_file = os.path.join(tmp, "plan.json")
        out_file = os.path.join(tmp, "out.json")
        with open(plan_file, "w") as f:
            json.dump(_peer_plan(plan).to_json(), f)
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(n), *shlex.split(extra_args),
               sys.executable, "-m", "tpcore.bench._mpi_peer", plan_file, out_file,
               "--progress" if progress else "--no-progress"] + (["--tpcore"] if name == "tpcore-mpi" else [])
        # The ranks' stdout goes to our stderr: our stdout carries only the tables.
        # Own session (so we can stop mpirun and its ranks as a group); SIGTERM
        # to mpirun if we die, which makes it stop its ranks.
        proc = subprocess.Popen(cmd, stdout=sys.stderr.fileno(), stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=lambda: _cleanup.die_with_parent(signal.SIGTERM))
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return PeerResult(name, note=f"mpirun did not finish within {timeout:.0f} s; stopped",
                              info={"command": shlex.join(cmd)})
        finally:
            if proc.poll() is None:  # KeyboardInterrupt and the like
                _kill_group(proc)
        if rc != 0 or not os.path.exists(out_file):
            return PeerResult(name, note=f"mpirun exited with code {rc} (its messages are above on stderr)",
                              info={"command": shlex.join(cmd)})
        with open(out_file) as f:
            out = json.load(f)
    info = {k: v for k, v in out.items() if k != "ranks"}
    info["command"] = shlex.join(cmd)
    return PeerResult(name, rows=combine(name, n, plan.dtype, out["ranks"]), info=info)


def _kill_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_peer(name: str, n: int, plan: Plan, timeout: float, progress: bool, mpirun: str = "mpirun",
             mpi_args: str = "") -> PeerResult:
    """Measure one peer; a PeerResult with rows=None and a note when it is not
    available or fails."""
    why = availability(name, mpirun)
    if why:
        return PeerResult(name, note=f"not available: {why}")
    t0 = time.perf_counter()
    if name == "gloo":
        res = run_gloo(n, plan, timeout, progress)
    else:
        res = run_mpi(n, plan, timeout, progress, mpirun, mpi_args, name)
    res.info["seconds"] = round(time.perf_counter() - t0, 1)
    return res
