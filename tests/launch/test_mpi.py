"""The mpi backend (libtpcore_mpi.so) under mpirun and under tpcore.launch --backend mpi.

Each job runs tests/mpi_worker.py on every rank; one job checks many things (mpirun
starts in about a second).  The worker computes a float64 NumPy reference of every
rank's data locally (one seed) and raises on any difference."""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import tpcore
from tpcore import _C
import paths
from conftest import WORLDS

HERE = str(paths.TESTS)  # the worker scripts
PKG_PARENT = os.path.dirname(os.path.dirname(tpcore.__file__))
WORKER = os.path.join(HERE, "mpi_worker.py")
MPIRUN = shutil.which("mpirun")
WHY_NOT = _C.Comm.probe("mpi")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(MPIRUN is None, reason="mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)"),
    pytest.mark.skipif(WHY_NOT is not None, reason=f"mpi backend not usable here: {WHY_NOT}"),
]


def job_env(**extra):
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", MPI_TEST_TIMEOUT="20")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TPCORE_JOB_ID", "TPCORE_BACKEND"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_job(cmd, env, deadline=60):
    """Runs cmd in its own session; on the deadline kills the whole group (never left behind)."""
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish within {deadline} s\n{out}\n{err}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # any rank left in the group
        except ProcessLookupError:
            pass
    return p.returncode, out, err


def results(out_dir):
    """The ranks' result lines (the worker writes them to MPI_TEST_OUT as well as stdout)."""
    text = ""
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name)) as f:
            text += f.read()
    return text


def job(cmd, out_dir, deadline=60, **env):
    """rc, the ranks' result lines, and everything printed (for messages)."""
    os.makedirs(out_dir, exist_ok=True)
    rc, out, err = run_job(cmd, job_env(MPI_TEST_OUT=out_dir, **env), deadline)
    return rc, results(out_dir), out + err


def mpirun(n, mode, out_dir, deadline=60, **env):
    return job([MPIRUN, "-n", str(n), "--oversubscribe", sys.executable, WORKER, mode], str(out_dir), deadline, **env)


def worker_alive():
    """Worker processes of this test still running (there must be none)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if WORKER.encode() in f.read():
                        found.append(int(d))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("n", WORLDS)
def test_every_collective_under_mpirun(n, tmp_path):
    rc, out, err = mpirun(n, "collectives", tmp_path, MPI_TEST_SEED=100 + n, MPI_TEST_LAYERS=int(n in (1, 3)),
                          MPI_TEST_MISMATCH=int(n == 3))
    assert rc == 0, out + err  # at world 3 after the mismatches too: nothing was left in flight
    for r in range(n):
        assert f"PASS rank {r} of {n} checks" in out, out + err
    if n == 3:  # ranks that disagree on a count: every rank gets a clear error naming both sides
        for r in range(3):
            line = next((ln for ln in out.splitlines() if ln.startswith(f"ERROR rank {r}:")), None)
            assert line and "all_reduce #1" in line and "count 6 elements" in line and "count 5 elements" in line, \
                out + err
            src = open(WORKER).read().splitlines()
            site = f"at mpi_worker.py:{1 + next(i for i, s in enumerate(src) if 'np.ones(5 + (comm.rank == 1)' in s)}"
            assert line.count(site) == 2, line  # both sides' call sites
        assert "P2P ERROR rank 1: recv (from rank 0) on rank 1: rank 0 sent 4 elements but this rank expects 5" \
            in out, out + err
        assert "P2P NO ERROR rank 0" in out and "P2P NO ERROR rank 2" in out, out + err
    assert not worker_alive()


@pytest.mark.slow  # the launcher under mpirun; test_every_collective_under_mpirun covers the backend
def test_launch_backend_mpi(tmp_path):
    rc, out, err = job([sys.executable, "-m", "tpcore.launch", "--backend", "mpi", "-n", "3", WORKER, "collectives"],
                       str(tmp_path), MPI_TEST_SEED=5, MPI_TEST_BACKEND="auto", MPI_TEST_DTYPES="float32,bfloat16,int8")
    assert rc == 0, out + err
    for r in range(3):
        assert f"PASS rank {r} of 3 checks" in out, out + err


def test_an_aborting_rank_is_named_and_a_hung_rank_times_out(tmp_path):
    t0 = time.monotonic()
    rc, out, err = mpirun(3, "abort_hang", tmp_path, MPI_TEST_TIMEOUT=2)
    assert time.monotonic() - t0 < 30
    assert rc != 0
    for r in (0, 2):
        assert f"ABORTED rank {r} after" in out and f"ERROR rank {r} after" in out, out + err
    assert out.count("rank 1 failed: it aborted the communicator: boom from the test") == 2, out + err
    assert "P2P ERROR rank 0: recv (from rank 2) on rank 0 of 3: MPI failed:" in out and "truncat" in out, out + err
    assert out.count("CommTimeout: all_reduce #4 on rank") == 2 and "timed out after 2.0 s" in out, out + err
    # rank 1 sleeps after its abort of the sub-communicator: the world's timeout names it
    assert out.count("rank 1 did not arrive (its last call: split #3 at mpi_worker.py:") == 2, out + err
    assert not worker_alive()


def stopped_pids(out):
    """The READY lines' pids whose process still runs this test's worker."""
    return [int(pid) for pid in re.findall(r"READY rank \d+ pid (\d+)", out) if int(pid) in worker_alive()]


def test_a_stopped_rank_is_named_with_its_last_call(tmp_path):
    """One rank SIGSTOPs itself before an all_reduce: every other rank's timeout names it and its
    last call (the exchange of call descriptions tells who arrived, without the stopped rank).
    A random rank stops after a random run of collectives (none: it has made no call)."""
    rng = random.Random()
    stop, calls = rng.randrange(3), [rng.choice(["all_reduce", "broadcast", "all_gather", "barrier"])
                                     for _ in range(rng.randint(0, 4))]
    src = open(WORKER).read().splitlines()
    t0 = time.monotonic()
    try:
        rc, out, err = mpirun(3, "stop", tmp_path, deadline=90, MPI_TEST_TIMEOUT=4, MPI_TEST_STOP=stop,
                              MPI_TEST_CALLS=",".join(calls), MPI_TEST_SEED=rng.randrange(10**6))
    finally:  # nothing left stopped: mpirun ends the job, and the group is killed; a straggler here
        for pid in stopped_pids(results(str(tmp_path))):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    assert rc != 0 and time.monotonic() - t0 < 90, (rc, out, err)
    if calls:
        site = 1 + next(i for i, s in enumerate(src) if s.endswith(f"# stop: {calls[-1]}"))
        last = f"its last call: {calls[-1]} #{len(calls)} at mpi_worker.py:{site}"
    else:
        last = "it has made no call on this communicator yet"
    for r in set(range(3)) - {stop}:
        line = next((ln for ln in out.splitlines() if ln.startswith(f"ERROR rank {r} ")), "")
        assert (f"CommTimeout: all_reduce #{len(calls) + 1} on rank {r} of 3: timed out after 4.0 s: rank {stop} "
                f"did not arrive ({last})") in line, (calls, stop, out, err)
    assert f"ERROR rank {stop} " not in out, out
    assert not worker_alive()


def test_a_killed_rank_ends_the_job(tmp_path):
    t0 = time.monotonic()
    rc, out, err = mpirun(3, "kill", tmp_path, MPI_TEST_TIMEOUT=10)
    took = time.monotonic() - t0
    assert rc != 0 and took < 30, (rc, took, out, err)
    assert out.count("READY rank") == 3, out + err
    # mpirun ends the job and says why; a rank that saw it first fails with a clear error
    assert "exited on signal 9" in err or "ERROR rank" in out, out + err
    assert not worker_alive()


def test_bad_uses_are_clear_errors():
    with pytest.raises(ValueError, match="backend must be one of"):
        tpcore.init(backend="mpix")
    code = ("import os, tpcore\nos.environ.update(RANK='0', WORLD_SIZE='2', TPCORE_JOB_ID='x1')\n"
            "try:\n    tpcore.init(backend='mpi', timeout=5)\nexcept tpcore.CommError as e:\n    print('ERR', e)\n")
    env = job_env()
    for k in list(env):
        if k.startswith(("OMPI_COMM", "PMIX")):
            env.pop(k)
    rc, out, err = run_job([sys.executable, "-c", code], env)
    assert "must be launched by mpirun" in out, out + err
    env["TPCORE_MPI_PLUGIN"] = "/nonexistent/libtpcore_mpi.so"
    rc, out, err = run_job([sys.executable, "-c", code], env)
    assert "cannot load the MPI plugin from TPCORE_MPI_PLUGIN=/nonexistent" in out, out + err


def test_auto_picks_mpi_across_hosts_or_when_asked(monkeypatch):
    from tpcore.distributed import env as _env
    from tpcore.distributed.init import _choose_backend
    monkeypatch.delenv("TPCORE_BACKEND", raising=False)
    across = _env.detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                          "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "x"})
    one_host = _env.detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "PMIX_NAMESPACE": "x"})
    assert _choose_backend("auto", across) == "mpi"
    assert _choose_backend("auto", one_host) in ("shm", "nccl")  # today's choice on one host
    assert _choose_backend("shm", across) == "shm"
    monkeypatch.setenv("TPCORE_BACKEND", "mpi")
    assert _choose_backend("auto", one_host) == "mpi"
    monkeypatch.setenv("TPCORE_BACKEND", "tcp")
    with pytest.raises(ValueError, match="TPCORE_BACKEND must be one of"):
        _choose_backend("auto", one_host)
