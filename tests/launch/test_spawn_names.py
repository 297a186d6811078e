"""tpcore.spawn leaves no /dev/shm name however its processes end: once every rank has
joined, the job's names (world communicator, split, registered memory) are gone, so a
SIGKILL of the process that called spawn, or of a rank, later on leaves nothing (issue 27:
the world segment stayed in 3 of 3 runs until the user's next tpcore start swept it); the
orphaned ranks die with their parent.  Each run has a job prefix of its own
(TPCORE_JOB_PREFIX), so only its own names are judged on a machine shared with other jobs."""
import glob
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from conftest import JOB_PREFIX

import paths
from cluster_common import PKG_PARENT, alive

# The ranks make every kind of name (world, a split, registered memory), say they are ready,
# then wait in Python (never in a collective, so that only the parent's death can end them).
SCRIPT = r'''
import os, sys, time, tpcore
def fn(comm):
    sub = comm.split(comm.rank % 2, comm.rank)
    buf = comm.alloc((1024,), "float32")
    buf[:] = 1
    comm.all_reduce(buf)
    sub.barrier()
    comm.barrier()
    print("READY", comm.rank, os.getpid(), float(buf[0]), flush=True)
    time.sleep(300)
if __name__ == "__main__":  # a file of its own: start_method "spawn" imports fn from it
    try:
        tpcore.spawn(fn, int(sys.argv[1]), start_method=sys.argv[2], timeout=120, grace=1.0)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e).splitlines()[0], flush=True)
        sys.exit(3)
'''
WORLD = 3
ORPHAN_DEADLINE = 30  # seconds for the ranks to die once their parent is gone (generous: a busy machine)


def _names(prefix):
    return sorted(glob.glob(f"/dev/shm/tpcore_{prefix}*") + glob.glob(f"/dev/shm/tpcore_nccl_{prefix}*"))


def _start(script, prefix, method):
    env = dict(os.environ, TPCORE_JOB_PREFIX=prefix, PYTHONPATH=PKG_PARENT)
    return subprocess.Popen([sys.executable, str(script), str(WORLD), method], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=str(paths.ROOT))


def _ready_pids(p):
    """The ranks' process ids, in rank order, once every rank said READY."""
    pids, lines = {}, []
    end = time.monotonic() + 120
    while len(pids) < WORLD and time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if "READY" in line:
            rank, pid, value = line.split("READY", 1)[1].split()
            assert float(value) == WORLD, line
            pids[int(rank)] = int(pid)
    assert sorted(pids) == list(range(WORLD)), "".join(lines)
    return [pids[r] for r in range(WORLD)]


def _wait_dead(pids, deadline):
    end = time.monotonic() + deadline
    while any(alive(q) for q in pids) and time.monotonic() < end:
        time.sleep(0.05)
    return [q for q in pids if alive(q)]


@pytest.mark.parametrize("victim, method", [("parent", "fork"), ("parent", "spawn"), ("parent", "forkserver"),
                                            ("rank", "fork")])
def test_a_killed_spawn_leaves_no_name_and_no_rank(victim, method, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    rounds = 3 if method == "fork" else 1  # the issue saw the name left in 3 of 3 runs
    left, alive_after = [], []
    for _ in range(rounds):
        prefix = f"{JOB_PREFIX}k{secrets.token_hex(2)}"  # <= 16 characters: this round's names only
        p = _start(script, prefix, method)
        pids = []
        try:
            pids = _ready_pids(p)
            # Every rank has joined every communicator: their names are gone already.
            assert _names(prefix) == [], "names while the job runs"
            if victim == "parent":
                p.kill()  # SIGKILL: no finally, no atexit; the ranks die by PR_SET_PDEATHSIG
                p.wait(30)
            else:
                os.kill(pids[1], signal.SIGKILL)
                out, _ = p.communicate(timeout=120)  # spawn names the rank and stops the others
                assert p.returncode == 3 and "RAISED RankExitedError rank 1" in out and "SIGKILL" in out, out
            alive_after += _wait_dead(pids, ORPHAN_DEADLINE)
            left += _names(prefix)
        finally:
            for q in pids:
                if alive(q):
                    os.kill(q, signal.SIGKILL)
            if p.poll() is None:
                p.kill()
                p.wait(30)
            p.stdout.close()
            for path in _names(prefix):  # only this round's, so later tests judge their own
                os.unlink(path)
    assert not alive_after, f"ranks still running {ORPHAN_DEADLINE} s after the {victim} was killed: {alive_after}"
    assert not left, f"names left after SIGKILL of the {victim}: {left}"
