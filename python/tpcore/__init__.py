"""tpcore: tensor parallelism with a C core.

    import tpcore
    comm = tpcore.init()                       # the world communicator of this job
    comm.all_reduce(x)                         # in place, sum over ranks
    tpcore.spawn(fn, 4)                        # fn(comm) on 4 local ranks (scripts, pytest, Jupyter)

Launch a script on N ranks:  python -m tpcore.launch -n N script.py

Errors: CommError / CommTimeout (communication), RankExitedError (spawn), and
CheckpointError (a ValueError) for every corrupt or inconsistent checkpoint file
(safetensors, config.json, index, .npz), naming the file, the tensor or field,
what was expected and what was found.
"""
from __future__ import annotations

import os
import time
from typing import Optional

# Idle OpenBLAS worker threads spin for 2^28 cycles (~0.1 s) after each call before they
# sleep; meanwhile they take cores from tpcore's element-wise threads and from the other
# local ranks (measured: 30% of the samples of an attention forward, a training step 13%
# slower).  tpcore's own OpenBLAS reads this when it loads, with the extension, so unless
# the user set it, it gets 2^20 cycles (~0.4 ms); the environment is restored afterwards.
_blas_timeout = "OPENBLAS_THREAD_TIMEOUT" not in os.environ
if _blas_timeout:
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = "20"
try:
    from . import _C
finally:
    if _blas_timeout:
        del os.environ["OPENBLAS_THREAD_TIMEOUT"]
from . import _cleanup, _env, _excepthook, _throttle
from .comm import Comm, CommError, CommTimeout
from . import optim
from .layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear, partition
from .vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, vocab_parallel_cross_entropy
from .checkpoint import CheckpointError, load, save
from .transformer import Config, ParallelAttention, TransformerBlock
from . import models
from .spawn import RankExitedError, spawn
from .cluster import Cluster
from .grid import ProcessGrid, average_gradients
from .pipeline import PipelineLM, stage_partition
from .serve import Engine
from .store import Store
from ._array import DeviceArray, from_dlpack
from ._array import asarray_device as asarray
from ._throttle import get_throttle, set_throttle
from .planner import Plan, PlanError, plan_from_measurements, plan_partition

_cleanup.forget_life_fd_in_children()
_throttle.apply_env_at_import()

__version__: str = _C.build_info()["version"]  # one source: TP_VERSION_* of tpcore.h, via setup.py
__all__ = ["init", "spawn", "Comm", "CommError", "CommTimeout", "RankExitedError", "CheckpointError", "build_info",
           "cuda_available",
           "set_num_threads", "get_num_threads", "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "partition", "optim",
           "VocabParallelEmbedding", "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy",
           "save", "load", "Config", "TransformerBlock", "ParallelAttention", "models",
           "DeviceArray", "asarray", "from_dlpack", "convert", "ProcessGrid", "average_gradients", "PipelineLM", "stage_partition",
           "Store", "Engine", "__version__"]
__all__ += ["Cluster"]
__all__ += ["set_throttle", "get_throttle", "plan_partition", "plan_from_measurements", "Plan", "PlanError"]

_BACKENDS = ("auto", "shm", "nccl", "mpi")


def build_info() -> dict:
    """What this build of the C core contains: version, backends, devices (those whose
    tensors tpcore takes; "cpu" always), sanitizers, BLAS, and "cuda": {"built", then
    "why_not_built" or "plugin" / "runtime" / "arch", "status" (why a GPU is usable or not:
    "no NVIDIA driver (...)", "driver too old: ...", "no device (...)"), and "cublas" / "nccl"
    (where found, or why not) once they were searched for}.  Loads the CUDA plugin."""
    from . import _cuda
    cuda = _cuda.info()  # first: loading the plugin may add "cuda" to the devices
    return {**_C.build_info(), "cuda": cuda}


def convert(x, dtype, out=None):
    """x (a NumPy float32, bfloat16 or float16 array) as dtype ("float32", "bfloat16" or
    "float16", or their NumPy dtypes; bfloat16 is ml_dtypes' type): rounds to nearest even,
    overflows to infinity, keeps subnormals, NaN stays a quiet NaN of its sign; bit for bit
    NumPy's float16 and ml_dtypes' bfloat16 casts (astype), threaded for large arrays.  out:
    an array of x's shape and that dtype to write into."""
    return _C.convert(x, dtype, out)


def cuda_available() -> bool:
    """True when tensors can live on a CUDA GPU in this process: the build has the CUDA
    plugin, it loads, the driver is new enough and a device is visible.  build_info()["cuda"]
    ["status"] says why not.  Loads the plugin on the first call (import tpcore does not)."""
    from . import _cuda
    return _cuda.available()


def set_num_threads(n: int) -> None:
    """BLAS threads of this process (default after init: cores / local ranks, or
    TPCORE_NUM_THREADS), so that N local ranks never oversubscribe the machine."""
    from ._args import int_arg
    _C.set_num_threads(int_arg(n, "set_num_threads", "n", lo=1))


def get_num_threads() -> int:
    return _C.get_num_threads()


def _default_threads(local_ranks: int) -> int:
    env = os.environ.get("TPCORE_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"TPCORE_NUM_THREADS must be an integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"TPCORE_NUM_THREADS must be >= 1, got {n}")
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


def _settle_seconds(info) -> float:
    """A job id set by hand (TPCORE_JOB_ID, or one derived from RANK/WORLD_SIZE/
    MASTER_ADDR/MASTER_PORT) may be shared by a second job started at the same
    moment, which would meet this one.  A rank of it that arrives finds its place
    taken and stops both jobs (the C core checks every claim); init waits this
    long for such a rank before computing anything.  TPCORE_SETTLE_S sets it
    (default 1 s, 0 to skip).  The random ids of python -m tpcore.launch and
    tpcore.spawn need none, nor torchrun's (its agent holds MASTER_PORT)."""
    if info.unique or info.world_size == 1:
        return 0.0
    text = os.environ.get("TPCORE_SETTLE_S", "1.0")
    try:
        wait = float(text)
    except ValueError:
        wait = float("nan")
    if not wait >= 0 or wait == float("inf"):
        raise ValueError(f"TPCORE_SETTLE_S must be a number of seconds >= 0, got {text!r}")
    return wait


def _choose_backend(backend: str, info) -> str:
    """"nccl" / "mpi" when asked for and usable (else CommError with the reason), "shm" when
    asked for; "auto": $TPCORE_BACKEND when set, else mpi when mpirun started ranks that do
    not all share this host, else nccl when usable here, else shm (the same answer on every
    rank of a host: it depends on the machine and the environment only)."""
    if backend == "auto":
        backend = os.environ.get("TPCORE_BACKEND", "") or "auto"
        if backend not in _BACKENDS:
            raise ValueError(f"init: TPCORE_BACKEND must be one of {', '.join(map(repr, _BACKENDS))}, "
                             f"got {backend!r}")
    if backend == "shm":
        return "shm"
    if backend == "mpi" or (backend == "auto" and info.source == "openmpi"
                            and info.local_world_size != info.world_size):
        why = _C.Comm.probe("mpi")
        if why is not None:
            raise CommError(f"init: {why}")
        return "mpi"
    why = _C.Comm.probe("nccl")
    if backend == "nccl":
        if why is not None:
            raise CommError(f"init: {why}")
        return "nccl"
    return "nccl" if why is None else "shm"


def init(backend: str = "auto", timeout: Optional[float] = None, spin_us: Optional[int] = None) -> Comm:
    """The world communicator of this job, from the environment.

    Reads what `python -m tpcore.launch` and `tpcore.spawn` set, or torchrun's
    RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT, Open
    MPI's OMPI_COMM_WORLD_* or Slurm's SLURM_*; with none of them, a job of one
    rank.  Blocks until every rank has joined.

    backend  "shm" (shared memory among the ranks of one host, host arrays; device
             arrays are staged through host memory), "nccl" (one rank per GPU,
             device arrays, the NCCL library loaded at run time), "mpi" (host
             arrays, ranks on any hosts, the job started by mpirun or
             `python -m tpcore.launch --backend mpi`; needs the MPI plugin, built
             when mpicc was found), or "auto": $TPCORE_BACKEND when set, else mpi
             when mpirun started ranks on several hosts, else nccl when CUDA and
             NCCL are usable here with one GPU per local rank, else shm.
             Comm.backend says which was chosen.
    timeout  seconds any one wait may take before CommTimeout (default: the
             TPCORE_TIMEOUT variable, else 300).

    A job over several hosts (python -m tpcore.launch --nnodes N; the environment says
    so: TPCORE_NNODES > 1 or LOCAL_WORLD_SIZE < WORLD_SIZE) cannot use shm; nccl then
    takes its unique id and its splits' ranks from the job's store (tpcore.Store at
    MASTER_ADDR:MASTER_PORT, secret TPCORE_STORE_SECRET).
    """
    if backend not in _BACKENDS:
        raise ValueError(f"init: backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
    from ._args import int_arg, real_arg
    if timeout is not None:
        timeout = real_arg(timeout, "init", "timeout", lo=0, lo_open=True, finite=False)
    if spin_us is not None:
        spin_us = int_arg(spin_us, "init", "spin_us", lo=0, hi=10**6)
    info = _env.detect()
    _throttle.apply_env(info.rank)  # TPCORE_THROTTLE="rank:factor,...": this rank's (checked before any wait)
    chosen = _choose_backend(backend, info)
    if info.multi_host and chosen == "shm":
        raise CommError(f"init: the {info.world_size} ranks span {info.nnodes} hosts ({info.local_world_size} on "
                        f"this one, from {info.source} variables) but the shm backend needs all ranks on one host (it "
                        f"shares memory): use backend=\"mpi\" or \"nccl\" (mpi under mpirun; nccl across hosts takes its "
                        f"unique id from the job's store, which python -m tpcore.launch --nnodes provides)")
    settle = _settle_seconds(info)
    c = _C.Comm(info.world_size, info.rank, info.job_id, -1.0 if timeout is None else float(timeout), chosen,
                -1 if spin_us is None else int(spin_us))
    comm = Comm(c, info.local_rank, info.local_world_size)
    if settle > 0:
        try:
            time.sleep(settle)
            comm.barrier()
        except BaseException:
            comm.close()
            raise
    _excepthook.track(comm)
    _C.set_num_threads(_default_threads(info.local_world_size))
    return comm
