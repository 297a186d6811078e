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

import os as _os
import time as _time
from typing import Any as _Any

# Idle OpenBLAS worker threads spin for 2^28 cycles (~0.1 s) after each call before they
# sleep; meanwhile they take cores from tpcore's element-wise threads and from the other
# local ranks (measured: 30% of the samples of an attention forward, a training step 13%
# slower).  tpcore's own OpenBLAS reads this when it loads, with the extension, so unless
# the user set it, it gets 2^20 cycles (~0.4 ms); the environment is restored afterwards.
_blas_timeout = "OPENBLAS_THREAD_TIMEOUT" not in _os.environ
if _blas_timeout:
    _os.environ["OPENBLAS_THREAD_TIMEOUT"] = "20"
try:
    from . import _C
finally:
    if _blas_timeout:
        del _os.environ["OPENBLAS_THREAD_TIMEOUT"]
from . import _cleanup, _env, _excepthook, _throttle
from .comm import Comm, CommError, CommTimeout
from . import optim
from .layers import ColumnParallelLinear, ParallelMLP, RowParallelLinear, partition
from .vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, vocab_parallel_cross_entropy
from .checkpoint import CheckpointError, load, save
from .transformer import Config, ParallelAttention, TransformerBlock
from . import models
from . import quant
from .quant import QuantTensor
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
__all__ += ["quant", "QuantTensor"]
__all__ += ["set_throttle", "get_throttle", "plan_partition", "plan_from_measurements", "Plan", "PlanError"]

_BACKENDS = ("auto", "shm", "nccl", "mpi")


def build_info() -> dict[str, _Any]:
    """What this build of the C core contains.

    Returns
    -------
    dict
        "version", "backends", "devices" (those whose tensors tpcore takes; "cpu" always),
        sanitizers, BLAS, and "cuda": {"built", then "why_not_built" or "plugin" /
        "runtime" / "arch", "status" (why a GPU is usable or not: "no NVIDIA driver (...)",
        "driver too old: ...", "no device (...)"), and "cublas" / "nccl" (where found, or why
        not) once they were searched for}.

    Notes
    -----
    Loads the CUDA plugin (``import tpcore`` does not).  No collective.
    """
    from . import _cuda
    cuda = _cuda.info()  # first: loading the plugin may add "cuda" to the devices
    return {**_C.build_info(), "cuda": cuda}


def convert(x: _Any, dtype: _Any, out: _Any = None) -> _Any:
    """x converted to another float dtype, bit for bit as NumPy / ml_dtypes cast.

    Rounds to nearest even, overflows to infinity, keeps subnormals, NaN stays a quiet NaN
    of its sign: bit for bit NumPy's float16 and ml_dtypes' bfloat16 casts (``astype``),
    threaded for large arrays.

    Parameters
    ----------
    x : numpy.ndarray
        Any shape; dtype float32, bfloat16 (ml_dtypes) or float16.
    dtype : str or numpy.dtype
        "float32", "bfloat16" or "float16", or their NumPy dtypes.
    out : numpy.ndarray, optional
        An array of x's shape and `dtype` to write into (default None: a new array).

    Returns
    -------
    numpy.ndarray
        x as `dtype`: `out` when given, else a new array of x's shape.

    Raises
    ------
    TypeError
        x is not a NumPy array of a supported dtype, or dtype / out's dtype is not one.
    ValueError
        out's shape differs from x's, or out is read-only.
    """
    return _C.convert(x, dtype, out)


def cuda_available() -> bool:
    """Whether tensors can live on a CUDA GPU in this process.

    Returns
    -------
    bool
        True when the build has the CUDA plugin, it loads, the driver is new enough and a
        device is visible.  ``build_info()["cuda"]["status"]`` says why not.

    Notes
    -----
    Loads the plugin on the first call (``import tpcore`` does not).
    """
    from . import _cuda
    return _cuda.available()


def set_num_threads(n: int) -> None:
    """Set the BLAS / element-wise threads of this process.

    The default after `init` is cores / local ranks (or TPCORE_NUM_THREADS), so that N
    local ranks never oversubscribe the machine.

    Parameters
    ----------
    n : int
        Threads, >= 1.

    Raises
    ------
    TypeError
        n is not an int (bool and float included).
    ValueError
        n < 1.
    """
    from ._args import int_arg
    _C.set_num_threads(int_arg(n, "set_num_threads", "n", lo=1))


def get_num_threads() -> int:
    """The BLAS / element-wise threads of this process (see `set_num_threads`).

    Returns
    -------
    int
        The current thread count, >= 1.
    """
    return _C.get_num_threads()


def _default_threads(local_ranks: int) -> int:
    env = _os.environ.get("TPCORE_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"TPCORE_NUM_THREADS must be an integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"TPCORE_NUM_THREADS must be >= 1, got {n}")
        return n
    cores = len(_os.sched_getaffinity(0)) if hasattr(_os, "sched_getaffinity") else (_os.cpu_count() or 1)
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
    text = _os.environ.get("TPCORE_SETTLE_S", "1.0")
    try:
        wait = float(text)
    except ValueError:
        wait = float("nan")
    if not wait >= 0 or wait == float("inf"):
        raise ValueError(f"TPCORE_SETTLE_S must be a number of seconds >= 0, got {text!r}")
    return wait


def _env_timeout() -> float | None:
    """TPCORE_TIMEOUT checked (None when unset or empty: the C core's 300 s).  The C core
    alone would take a value that is not a number > 0 for 300 s without a word."""
    text = _os.environ.get("TPCORE_TIMEOUT", "")
    if not text:
        return None
    try:
        t = float(text)
    except ValueError:
        t = float("nan")
    if not t > 0:
        raise ValueError(f"init: TPCORE_TIMEOUT must be a number of seconds > 0, got {text!r}")
    return t


def _choose_backend(backend: str, info) -> str:
    """"nccl" / "mpi" when asked for and usable (else CommError with the reason), "shm" when
    asked for; "auto": $TPCORE_BACKEND when set, else mpi when mpirun started ranks that do
    not all share this host, else nccl when usable here, else shm (the same answer on every
    rank of a host: it depends on the machine and the environment only)."""
    if backend == "auto":
        backend = _os.environ.get("TPCORE_BACKEND", "") or "auto"
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


def init(backend: str = "auto", timeout: float | None = None, spin_us: int | None = None) -> Comm:
    """The world communicator of this job, from the environment.

    Reads what ``python -m tpcore.launch`` and `tpcore.spawn` set, or torchrun's
    RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT, Open MPI's
    OMPI_COMM_WORLD_* or Slurm's SLURM_*; with none of them, a job of one rank.  Blocks
    until every rank has joined, then sets this process's threads to cores / local ranks
    (`set_num_threads`).

    Parameters
    ----------
    backend : {"auto", "shm", "nccl", "mpi"}, default "auto"
        "shm": shared memory among the ranks of one host (host arrays; device arrays are
        staged through host memory).  "nccl": one rank per GPU, device arrays, the NCCL
        library loaded at run time.  "mpi": host arrays, ranks on any hosts, the job started
        by mpirun or ``python -m tpcore.launch --backend mpi`` (needs the MPI plugin, built
        when mpicc was found).  "auto": $TPCORE_BACKEND when set, else mpi when mpirun
        started ranks on several hosts, else nccl when CUDA and NCCL are usable here with
        one GPU per local rank, else shm.  `Comm.backend` says which was chosen.
    timeout : float, optional
        Seconds any one wait (a collective, a send or receive, the rendezvous) may take
        before `CommTimeout`; > 0, ``float("inf")`` for no limit.  Default None: the
        TPCORE_TIMEOUT variable when set, else 300 seconds.  `Comm.timeout` reads and
        changes it later.
    spin_us : int, optional
        How a waiting rank of the shm backend (and of nccl's host-side communicator)
        waits: busy-spin this many microseconds, then sleep on a futex (0: sleep at once);
        0..1000000.  Default None: the TPCORE_SPIN_US variable when set, else adaptive:
        spin while every rank has a core of its own and the machine is quiet, yield the
        core when ranks outnumber cores or another process needs it.  A fixed spin lowers
        the latency of small collectives on an idle machine and wastes cores on a busy one.
        The mpi backend ignores it.

    Returns
    -------
    Comm
        The communicator over every rank of the job (this process is ``comm.rank``).

    Raises
    ------
    TypeError
        timeout or spin_us is not a number / an int.
    ValueError
        backend (or TPCORE_BACKEND, TPCORE_TIMEOUT, TPCORE_SETTLE_S, TPCORE_NUM_THREADS) is
        not a valid value, timeout <= 0, spin_us out of range, or the environment's rank
        variables are inconsistent.
    CommError
        The chosen backend is not usable here (the reason is given), the ranks span hosts
        but backend is "shm", or a rank failed during the rendezvous.
    CommTimeout
        Not every rank joined within the timeout.

    Notes
    -----
    A job over several hosts (``python -m tpcore.launch --nnodes N``; the environment says
    so: TPCORE_NNODES > 1 or LOCAL_WORLD_SIZE < WORLD_SIZE) cannot use shm; nccl then takes
    its unique id and its splits' ranks from the job's store (`tpcore.Store` at
    MASTER_ADDR:MASTER_PORT, secret TPCORE_STORE_SECRET).

    Examples
    --------
    >>> comm = tpcore.init()          # doctest: +SKIP
    >>> comm.all_reduce(x)            # doctest: +SKIP
    """
    if backend not in _BACKENDS:
        raise ValueError(f"init: backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
    from ._args import int_arg, real_arg
    if timeout is not None:
        timeout = real_arg(timeout, "init", "timeout", lo=0, lo_open=True, finite=False)
    else:
        timeout = _env_timeout()
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
            _time.sleep(settle)
            comm.barrier()
        except BaseException:
            comm.close()
            raise
    _excepthook.track(comm)
    _C.set_num_threads(_default_threads(info.local_world_size))
    return comm


del annotations  # the __future__ import's name: not part of the API
