"""python -m tpcore.launch: rank-prefixed output, exit codes, fail-fast
stopping of the other ranks, Ctrl-C, no orphans, no /dev/shm leftovers."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import tpcore
from conftest import JOB_PREFIX

# the folder holding the tpcore under test (an installed one, python/, or a sanitized build)
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))

LAUNCH = [sys.executable, "-m", "tpcore.launch"]
_TMPDIR = ""  # the launches' TMPDIR (see _private_tmpdir)


@pytest.fixture(autouse=True, scope="module")
def _private_tmpdir(tmp_path_factory):
    """The launches of this file get a temporary directory of their own (TMPDIR), which
    test_no_files_left_behind finds empty: /tmp is shared with other jobs."""
    global _TMPDIR
    _TMPDIR = str(tmp_path_factory.mktemp("launch-tmpdir"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", _TMPDIR)
        yield


def script(tmp_path, body, name="job.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def launch(args, timeout=60, **kw):
    return subprocess.run(LAUNCH + args, capture_output=True, text=True, timeout=timeout, **kw)


def alive(pids):
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[-1][0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


GOOD = """
import sys, numpy as np, tpcore
comm = tpcore.init()
x = np.full(5, comm.rank + 1.0)
comm.all_reduce(x)
print(f"rank={comm.rank} size={comm.size} local={comm.local_rank} sum={x[0]:g} args={sys.argv[1:]}")
"""


@pytest.mark.parametrize("n", [1, 3])
def test_runs_every_rank_with_prefix(tmp_path, n):
    r = launch(["-n", str(n), script(tmp_path, GOOD), "a", "--flag"])
    assert r.returncode == 0, r.stderr
    want = n * (n + 1) / 2
    for k in range(n):
        assert f"[rank{k}] rank={k} size={n} local={k} sum={want:g} args=['a', '--flag']" in r.stdout


def test_module_mode_and_timeout_variable(tmp_path):
    (tmp_path / "mymod.py").write_text("import os, tpcore\nc = tpcore.init()\n"
                                       "print('timeout', c.timeout, os.environ['TPCORE_TIMEOUT'])\n")
    r = launch(["-n", "2", "--timeout", "7.5", "-m", "mymod"], cwd=tmp_path,
               env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), PKG_PARENT])))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("timeout 7.5 7.5") == 2


FAIL = """
import sys, time, numpy as np, tpcore
comm = tpcore.init()
comm.barrier()
if comm.rank == 1:
    raise SystemExit(3)
for _ in range(100000):
    comm.all_reduce(np.ones(10))
"""


def test_failing_rank_stops_the_others(tmp_path):
    t0 = time.monotonic()
    r = launch(["-n", "3", script(tmp_path, FAIL)])
    assert time.monotonic() - t0 < 30
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "rank 1 exited with code 3" in r.stderr


RAISE = """
import numpy as np, tpcore
comm = tpcore.init()
if comm.rank == 2:
    raise RuntimeError("broken on purpose")
comm.all_reduce(np.ones(10))
"""


def test_exception_blames_the_raising_rank(tmp_path):
    r = launch(["-n", "4", script(tmp_path, RAISE)])
    assert r.returncode == 1
    assert "tpcore.launch: rank 2 exited with code 1" in r.stderr
    assert "[rank2] RuntimeError: broken on purpose" in r.stderr
    # the peers fail in reaction, naming rank 2 and the cause
    peer_lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[rank0] ") and "CommError" in ln]
    assert peer_lines and "rank 2" in peer_lines[-1] and "broken on purpose" in peer_lines[-1], r.stderr


KILLED = """
import os, signal, numpy as np, tpcore
comm = tpcore.init()
comm.barrier()
if comm.rank == 0:
    os.kill(os.getpid(), signal.SIGKILL)
comm.all_reduce(np.ones(10))
"""


def test_killed_rank(tmp_path):
    r = launch(["-n", "3", script(tmp_path, KILLED)])
    assert r.returncode == 128 + signal.SIGKILL
    assert "rank 0 was killed by signal SIGKILL" in r.stderr


HANG = """
import os, time, tpcore
comm = tpcore.init()
print("pid", os.getpid(), flush=True)
time.sleep(300)
"""


def test_ctrl_c_stops_all_and_leaves_no_orphans(tmp_path):
    p = subprocess.Popen(LAUNCH + ["-n", "3", "--grace", "2", script(tmp_path, HANG)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids = []
    deadline = time.monotonic() + 30
    while len(pids) < 3 and time.monotonic() < deadline:
        line = p.stdout.readline()
        if "pid" in line:
            pids.append(int(line.split()[-1]))
    assert len(pids) == 3
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    assert "stopping all ranks" in err
    time.sleep(0.2)
    assert alive(pids) == []


def test_killing_the_launcher_kills_the_ranks(tmp_path):
    p = subprocess.Popen(LAUNCH + ["-n", "2", script(tmp_path, HANG)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    pids = []
    deadline = time.monotonic() + 30
    while len(pids) < 2 and time.monotonic() < deadline:
        line = p.stdout.readline()
        if "pid" in line:
            pids.append(int(line.split()[-1]))
    p.kill()
    p.wait()
    end = time.monotonic() + 10
    while alive(pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert alive(pids) == []


def test_no_files_left_behind():
    import glob
    # the launches above must have left no file in their temporary directory, and no name of a launcher
    # job (tpcore_<this session's prefix>ln<hex>; other jobs of this user may run beside the tests)
    assert os.listdir(_TMPDIR) == []
    assert glob.glob(f"/dev/shm/tpcore_{JOB_PREFIX}ln*") == []


def test_usage_errors():
    r = launch(["-n", "0", "x.py"])
    assert r.returncode == 2 and "-n must be >= 1" in r.stderr
    r = launch(["-n", "2"])
    assert r.returncode == 2 and "script" in r.stderr


def test_console_script_is_installed():
    import shutil
    exe = shutil.which("tpcore-launch")
    if exe is None:
        pytest.skip("tpcore-launch is not on PATH (package not installed with pip)")
    r = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "-n" in r.stdout


# ------------------------------------------------------------------ torchrun's spellings

ENV = """
import os
e = os.environ
print("ENV", e["RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"], flush=True)
"""


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env_lines(out):
    return sorted(tuple(ln.split("ENV ", 1)[1].split()) for ln in out.splitlines() if "ENV " in ln)


def _cpus():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize("argv", [["--nproc-per-node", "3"], ["--nproc_per_node", "3"], ["--nproc-per-node=3"],
                                  ["-n", "3", "--nproc_per_node=3"], ["--standalone", "--nproc-per-node", "3"]])
def test_nproc_per_node_and_standalone(tmp_path, argv):
    r = launch(argv + [script(tmp_path, GOOD), "a"])
    assert r.returncode == 0, r.stderr
    for k in range(3):
        assert f"[rank{k}] rank={k} size=3 local={k} sum=6 args=['a']" in r.stdout


@pytest.mark.parametrize("argv", [["--nnodes", "1", "--node-rank", "0"], ["--nnodes=1:1", "--node_rank=0"]])
def test_one_node_spelled_as_torchrun_does(tmp_path, argv):
    r = launch(argv + ["-n", "2", script(tmp_path, ENV)])
    assert r.returncode == 0, r.stderr
    lines = _env_lines(r.stdout)
    assert [ln[:4] for ln in lines] == [("0", "2", "2", "127.0.0.1"), ("1", "2", "2", "127.0.0.1")]
    assert 0 < int(lines[0][4]) < 65536 and lines[0][4] == lines[1][4]  # a free port, the same for the job


@pytest.mark.parametrize("dash", ["-", "_"])
def test_master_addr_and_port_on_one_host_reach_the_ranks(tmp_path, dash):
    port = _free_port()
    r = launch([f"--master{dash}addr", "localhost", f"--master{dash}port", str(port), "-n", "2",
                script(tmp_path, ENV)])
    assert r.returncode == 0, r.stderr
    assert _env_lines(r.stdout) == [("0", "2", "2", "localhost", str(port)), ("1", "2", "2", "localhost", str(port))]


def test_nproc_per_node_cpu_auto_and_gpu(tmp_path):
    from tpcore.launch.launcher import visible_gpus
    gpus, why = visible_gpus()
    path = script(tmp_path, ENV)
    r = launch(["--nproc-per-node", "cpu", path])
    assert r.returncode == 0, r.stderr
    assert {ln[1] for ln in _env_lines(r.stdout)} == {str(_cpus())}
    r = launch(["--nproc-per-node", "auto", path])
    assert r.returncode == 0, r.stderr
    assert {ln[1] for ln in _env_lines(r.stdout)} == {str(len(gpus) or _cpus())}
    r = launch(["--nproc-per-node", "gpu", path])
    if gpus:
        assert r.returncode == 0, r.stderr
        assert {ln[1] for ln in _env_lines(r.stdout)} == {str(len(gpus))}
    else:
        assert r.returncode == 2 and f"--nproc-per-node gpu: one rank per GPU, but {why}" in r.stderr, r.stderr


def test_two_hosts_with_torchrun_spellings(tmp_path):
    path, port = script(tmp_path, ENV), _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    procs = [subprocess.Popen(LAUNCH + ["--nnodes=2", f"--node_rank={k}", "--master_addr=127.0.0.1",
                                        f"--master_port={port}", "--nproc_per_node=1", path],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for k in (1, 0)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert _env_lines(outs[0][0]) == [("1", "2", "1", "127.0.0.1", str(port))]
    assert _env_lines(outs[1][0]) == [("0", "2", "1", "127.0.0.1", str(port))]


@pytest.mark.parametrize("argv,msg", [
    (["-n", "2", "--nproc-per-node", "3"], "-n 2 and --nproc-per-node 3 disagree"),
    (["--nproc_per_node", "3", "--gpus", "1"], "--gpus 1 and --nproc-per-node 3 disagree"),
    (["--nproc-per-node", "many"], "--nproc-per-node must be a number of ranks, gpu, cpu or auto, got 'many'"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
    (["--standalone", "--nnodes", "2", "--node-rank", "0", "--master-port", "1234"],
     "--standalone runs the job on this host alone, on a free port: --nnodes 2, --master-port 1234 contradicts it"),
    (["--standalone", "--master_addr", "10.0.0.1"], "--master-addr 10.0.0.1 contradicts it"),
    (["--nnodes", "1:4"], "'1:4': elastic jobs (torchrun's MIN:MAX hosts) are not supported"),
    (["--nnodes", "two"], "expected a number of hosts, got 'two'"),
    (["--master_port", "70000"], "--master-port must be in 1..65535, got 70000"),
])
def test_contradictory_or_unsupported_torchrun_arguments(argv, msg):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    r = launch(argv + ["x.py"], env=env)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
