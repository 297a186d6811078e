"""Where this process stands in a job, read from the environment.

Understood, in this order: tpcore's own launcher and spawn (TPCORE_JOB_ID with
RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE), torchrun (the same four plus
MASTER_ADDR/MASTER_PORT and TORCHELASTIC_RUN_ID), Open MPI (OMPI_COMM_WORLD_*)
and Slurm (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, ...).  No variables: a
job of one rank.
"""
from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, replace

from tpcore.utils import cleanup as _cleanup


@dataclass(frozen=True)
class JobInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    job_id: str
    source: str  # "tpcore", "torchrun", "openmpi", "slurm" or "single"
    # False when nothing but MASTER_ADDR:MASTER_PORT tells this job from another
    # (RANK/WORLD_SIZE set by hand): init then waits a moment for a second job
    # with the same id to show itself (see tpcore.init).
    unique: bool = True
    # Hosts the job spans: TPCORE_NNODES (python -m tpcore.launch --nnodes), else
    # world / local world size rounded up.
    nnodes: int = 1

    @property
    def multi_host(self) -> bool:
        """Whether the ranks run on more than one host (shm cannot connect them)."""
        return self.nnodes > 1 or self.local_world_size != self.world_size


# Job ids of batch schedulers, in the environment of every task of a job.
_SCHEDULER_IDS = ("SLURM_JOB_ID", "SLURM_STEP_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID", "JOB_ID",
                  "COBALT_JOBID")


def _int(env, name):
    v = env.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {v!r}") from None


def _safe_id(text: str) -> str:
    """A job id the C core accepts ([A-Za-z0-9_-]{1,64}), stable for the same text."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", text)
    if 0 < len(clean) <= 40:
        return clean
    return hashlib.sha1(text.encode()).hexdigest()[:24]


def detect(env=None) -> JobInfo:
    env = os.environ if env is None else env
    info = _detect(env)
    nnodes = _int(env, "TPCORE_NNODES")
    if nnodes is None:
        nnodes = -(-info.world_size // max(1, info.local_world_size))
    if not 1 <= nnodes <= info.world_size:
        raise ValueError(f"TPCORE_NNODES must be in 1..{info.world_size} (the world size), got {nnodes}")
    return replace(info, nnodes=nnodes)


def _detect(env) -> JobInfo:
    job = env.get("TPCORE_JOB_ID")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        local_rank = _int(env, "LOCAL_RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE")
        if local_rank is None:
            local_rank = rank
        if local_world is None:
            local_world = world
        if job:
            source = "tpcore"
            # The launcher's and spawn's ids are random; one set by hand may be shared by
            # two jobs started together, so init settles (see tpcore.init).
            return _checked(JobInfo(rank, world, local_rank, local_world, _safe_id(job), source,
                                    env.get("TPCORE_JOB_RANDOM") == "1"))
        else:
            source = "torchrun"
            addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
            # A restarted job must not meet the previous attempt's shared memory, and a
            # scheduler's job id tells two jobs on one address and port apart.
            run_id = env.get("TORCHELASTIC_RUN_ID", "") + ":" + env.get("TORCHELASTIC_RESTART_COUNT", "0")
            sched = [env.get(k, "") for k in _SCHEDULER_IDS]
            run_id += ":" + ":".join(sched)
            # Under torchrun its agent holds MASTER_PORT for the job.  A scheduler's id tells
            # allocations apart, but not two jobs started by hand inside one allocation.
            unique = "TORCHELASTIC_RUN_ID" in env
            if not (addr and port) and world > 1:
                raise ValueError(
                    "RANK and WORLD_SIZE are set but neither TPCORE_JOB_ID nor MASTER_ADDR/MASTER_PORT: "
                    "cannot tell which job this rank belongs to (use python -m tpcore.launch, or set "
                    "TPCORE_JOB_ID to the same value on every rank)")
            job = "tr_" + _safe_id(f"{addr}:{port}:{run_id}")
            return _checked(JobInfo(rank, world, local_rank, local_world, _safe_id(job), source, unique))
    orank, oworld = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    if orank is not None and oworld is not None:
        lr = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        lw = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        ns = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid") or env.get("OMPI_MCA_orte_hnp_uri", "")
        job = job or "mpi_" + _safe_id(ns or "default")
        return _checked(JobInfo(orank, oworld, orank if lr is None else lr, oworld if lw is None else lw,
                                _safe_id(job), "openmpi"))
    srank, sworld = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    if srank is not None and sworld is not None:
        lr = _int(env, "SLURM_LOCALID")
        per_node = env.get("SLURM_TASKS_PER_NODE", "")
        m = re.match(r"(\d+)", per_node)
        lw = int(m.group(1)) if m else sworld
        job = job or "slurm_" + _safe_id(f"{env.get('SLURM_JOB_ID', '0')}_{env.get('SLURM_STEP_ID', '0')}")
        return _checked(JobInfo(srank, sworld, srank if lr is None else lr, lw, _safe_id(job), "slurm"))
    return JobInfo(0, 1, 0, 1, _safe_id(job) if job else _cleanup.new_job_id("solo_"), "single")


def _checked(info: JobInfo) -> JobInfo:
    if info.world_size < 1:
        raise ValueError(f"world size must be >= 1, got {info.world_size} (from {info.source} variables)")
    if not 0 <= info.rank < info.world_size:
        raise ValueError(f"rank {info.rank} is outside 0..{info.world_size - 1} (from {info.source} variables)")
    if not 0 <= info.local_rank < max(info.local_world_size, 1):
        raise ValueError(f"local rank {info.local_rank} is outside 0..{info.local_world_size - 1} "
                         f"(from {info.source} variables)")
    return info
