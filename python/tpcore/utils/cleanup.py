"""Removal of dead jobs' shared-memory names, the launcher's janitor, and
process-lifetime helpers.

The rule (the C core's too, csrc/comm/shm/shm_seg.c): a tpcore segment is in use
while some process holds a flock on it (its creator from creation until the
name goes; every rank of a world communicator for the communicator's life).
Locks go with their processes, even under SIGKILL, so a name of this user's
that nobody locks belongs to a job that died and may be removed.  Names of
other users are never touched, and nothing here raises on them.

This file imports only the standard library: the janitor runs it as a script
(``python -I -S _cleanup.py --janitor JOB``) without importing tpcore.
"""
from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import stat
import subprocess
import sys

SHM_DIR = "/dev/shm"
PREFIX = "tpcore_"


def shm_segments(job_id: str = "") -> list:
    """This user's names in /dev/shm of the job (all tpcore jobs when job_id is empty): the
    shm backend's (tpcore_<job>_...) and the nccl backend's descriptors (tpcore_nccl_<job>_...)."""
    prefixes = (f"{PREFIX}{job_id}_", f"{PREFIX}nccl_{job_id}_") if job_id else (PREFIX,)
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        if not name.startswith(prefixes):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            out.append(path)
    return out


def _remove_if_unused(path: str, dry_run: bool) -> bool:
    """Remove the name if no process locks the segment (it belongs to a job that
    ended), holding the lock through the check and the unlink so that a job
    that takes it meanwhile keeps its name.  Only what tpcore makes counts (this
    user's, mode 0600): anything else is left alone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        a = os.fstat(fd)
        if a.st_uid != os.geteuid() or stat.S_IMODE(a.st_mode) != 0o600 or not stat.S_ISREG(a.st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        b = os.lstat(path)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
            return False
        if not dry_run:
            os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_shm(job_id: str = "", dry_run: bool = False) -> list:
    """Remove this user's tpcore names of the job (all jobs when job_id is
    empty) that no live process uses; the list of those removed (or, with
    dry_run, that would be).  Never raises."""
    return [path for path in shm_segments(job_id) if _remove_if_unused(path, dry_run)]


JOB_PREFIX_VAR = "TPCORE_JOB_PREFIX"
_JOB_PREFIX_MAX = 16  # job ids stay <= 40 characters, which the environment passes through as they are


def new_job_id(kind: str) -> str:
    """A new random job id: $TPCORE_JOB_PREFIX (default empty), kind, 16 hex digits.
    The prefix lets a harness (a CI run, a test session) tell the /dev/shm names of
    the jobs it started (tpcore_<prefix>...) from those of other jobs of this user."""
    import secrets
    prefix = os.environ.get(JOB_PREFIX_VAR, "")
    if len(prefix) > _JOB_PREFIX_MAX or not all(c.isascii() and (c.isalnum() or c in "_-") for c in prefix):
        raise ValueError(f"{JOB_PREFIX_VAR} must be at most {_JOB_PREFIX_MAX} characters of [A-Za-z0-9_-], "
                         f"got {prefix!r}")
    return prefix + kind + secrets.token_hex(8)


def start_janitor(job_id: str):
    """A process outside the caller's process group that removes the job's
    names once every holder of the returned pipe end has exited, however
    (SIGKILL of the whole group included).  Pass the fd to every rank
    (pass_fds) and close it when done; returns (fd, process) or (None, None)."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), "--janitor", job_id],
                                stdin=r, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                close_fds=True, start_new_session=True)
    except OSError:
        os.close(w)
        return None, None
    finally:
        os.close(r)
    return w, proc


def _janitor(job_id: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal is for the job
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    # Every holder is gone; ranks that were not its children may still be
    # exiting with their locks: look again for a while.
    import time
    for _ in range(200):
        remove_shm(job_id)
        if not shm_segments(job_id):
            return
        time.sleep(0.05)


LIFE_FD_VAR = "TPCORE_LIFE_FD"


def forget_life_fd_in_children() -> None:
    """A rank holds the launcher's janitor pipe (TPCORE_LIFE_FD) while it lives;
    processes it forks (DataLoader workers, multiprocessing) must not keep the
    janitor waiting after the rank is gone."""
    try:
        fd = int(os.environ.get(LIFE_FD_VAR, ""))
    except ValueError:
        return

    def child():
        try:
            nul = os.open(os.devnull, os.O_RDONLY)
            os.dup2(nul, fd, inheritable=False)
            os.close(nul)
        except OSError:
            pass
    os.register_at_fork(after_in_child=child)


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent exits, so that
    ranks never outlive a launcher or test runner that was killed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: nothing to do
        pass


def die_with(pid: int) -> None:
    """SIGKILL this process when process `pid` ends, where `pid` is not its parent (which
    die_with_parent covers): a rank that multiprocessing's fork server started (start method
    "forkserver") has the server as its parent, and the server lives on after the process
    that asked for the rank is killed, for as long as the processes it started do.  A daemon
    thread waits on a pidfd of `pid` (Linux 5.3+), else looks twice a second.  Nothing when
    `pid` is gone already (the caller checks that)."""
    if pid == os.getppid():
        return
    import select
    import threading
    import time
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd here
        fd = None

    def watch():
        if fd is not None:
            p = select.poll()
            p.register(fd, select.POLLIN)
            while not p.poll():  # readable once the process has ended
                pass
        else:
            while True:
                time.sleep(0.5)
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                except OSError:  # alive (another user's pid now: not ours to judge)
                    pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="tpcore-die-with", daemon=True).start()


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--janitor":
    _janitor(sys.argv[2])
