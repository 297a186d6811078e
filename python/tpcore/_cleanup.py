"""Removal of a job's shared-memory names and process-lifetime helpers."""
from __future__ import annotations

import ctypes
import glob
import os
import signal

SHM_DIR = "/dev/shm"


def shm_segments(job_id: str):
    """Names in /dev/shm that belong to the job (normally none: the C core
    unlinks each segment as soon as every rank has mapped it)."""
    return glob.glob(os.path.join(SHM_DIR, f"tpcore_{job_id}_*"))


def remove_shm(job_id: str) -> list:
    removed = []
    for path in shm_segments(job_id):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent exits, so that
    ranks never outlive a launcher or test runner that was killed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to do
        pass
