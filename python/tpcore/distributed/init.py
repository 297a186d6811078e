"""`init`: the world communicator of a job, from its environment.

Reads the launcher's, torchrun's, Open MPI's or Slurm's variables (`tpcore.distributed.env`),
chooses the backend and joins the ranks.
"""
from __future__ import annotations

import os as os
import time as time

from tpcore import _C
from tpcore.distributed import env as _env
from tpcore.distributed import excepthook as _excepthook
from tpcore.distributed.comm import Comm, CommError
from tpcore.distributed import throttle as _throttle
from tpcore.utils.runtime import default_threads

_BACKENDS = ("auto", "shm", "nccl", "mpi")


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


def _env_timeout() -> float | None:
    """TPCORE_TIMEOUT checked (None when unset or empty: the C core's 300 s).  The C core
    alone would take a value that is not a number > 0 for 300 s without a word."""
    text = os.environ.get("TPCORE_TIMEOUT", "")
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
    from tpcore.utils.args import int_arg, real_arg
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
                        f"shares memory): use backend=\"mpi\" or \"nccl\" (mpi under mpirun; nccl across hosts "
                        f"takes its unique id from the job's store, which python -m tpcore.launch --nnodes provides)")
    settle = _settle_seconds(info)
    # A job id no other job can have (the launcher's and spawn's random ones, torchrun's agent's)
    # needs no claim: the C core removes its /dev/shm names once every rank has joined.
    c = _C.Comm(info.world_size, info.rank, info.job_id, -1.0 if timeout is None else float(timeout), chosen,
                -1 if spin_us is None else int(spin_us), job_id_unique=bool(info.unique))
    comm = Comm(c, info.local_rank, info.local_world_size)
    if settle > 0:
        try:
            time.sleep(settle)
            comm.barrier()
        except BaseException:
            comm.close()
            raise
    _excepthook.track(comm)
    _C.set_num_threads(default_threads(info.local_world_size))
    return comm
