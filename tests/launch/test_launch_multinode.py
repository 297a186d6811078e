"""python -m tpcore.launch --nnodes N --node-rank K: launchers on several (simulated) hosts
forming one job through node 0's store on loopback: ranks, world and environment; checked
agreement (nnodes, ranks per node, script, a node rank used twice, a late launcher); failures
crossing nodes (a failing rank, a lost launcher, Ctrl-C).  The same across Linux network
namespaces: tests/launch/test_launch_netns.py."""
import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tpcore.distributed import env as _env

LAUNCH = [sys.executable, "-m", "tpcore.launch"]

JOB = """
import json, os, sys, tpcore
e = os.environ
r, w = int(e["RANK"]), int(e["WORLD_SIZE"])
with tpcore.Store.from_env(timeout=30) as s:
    s.set(f"job/{r}", json.dumps({"job": e["TPCORE_JOB_ID"], "pid": os.getpid()}))
    s.barrier("ranks", w)
    peers = [json.loads(s.get(f"job/{k}")) for k in range(w)]
    total = s.add("sum", r + 1)
    s.barrier("summed", w)
    total = int(s.get("sum"))
info = tpcore.distributed.env.detect()
try:
    tpcore.init(backend="shm")
    refused = "no"
except tpcore.CommError as ex:
    refused = str(ex)
print("RESULT " + json.dumps({"rank": r, "world": w, "local": int(e["LOCAL_RANK"]),
      "local_world": int(e["LOCAL_WORLD_SIZE"]), "nnodes": int(e["TPCORE_NNODES"]), "node": int(e["TPCORE_NODE_RANK"]),
      "jobs": sorted({p["job"] for p in peers}), "total": total, "multi_host": info.multi_host,
      "info_nnodes": info.nnodes, "refused": refused, "secret_len": len(e["TPCORE_STORE_SECRET"]),
      "args": sys.argv[1:]}))
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(tmp_path, body, name="job.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return str(p)


def start(node, nnodes, port, args, prefix=(), env=None, addr="127.0.0.1", extra=()):
    cmd = list(prefix) + LAUNCH + ["--nnodes", str(nnodes), "--node-rank", str(node), "--master-addr", addr,
                                   "--master-port", str(port), *extra, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ if env is None else env))


def finish(procs, timeout=60):
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


def results(out):
    return [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if "RESULT " in line]


def check_job(runs, nnodes, nproc):
    world = nnodes * nproc
    got = {}
    for node, (rc, out, err) in enumerate(runs):
        assert rc == 0, (node, out, err)
        for res in results(out):
            assert res["node"] == node and res["rank"] // nproc == node, res
            got[res["rank"]] = res
    assert sorted(got) == list(range(world))
    jobs = {tuple(r["jobs"]) for r in got.values()}
    assert len(jobs) == 1 and len(next(iter(jobs))) == 1  # one job id, agreed by every rank
    for r, res in got.items():
        assert (res["world"], res["local"], res["local_world"], res["nnodes"]) == (world, r % nproc, nproc, nnodes)
        assert res["total"] == world * (world + 1) // 2
        assert res["multi_host"] and res["info_nnodes"] == nnodes
        assert "span" in res["refused"] and 'backend="mpi" or "nccl"' in res["refused"]
        assert res["secret_len"] >= 32 and res["args"] == ["x", "--flag"]
    return got


# ------------------------------------------------------------------ loopback

def test_two_launchers_form_one_job(tmp_path):
    path = script(tmp_path, JOB)
    port = free_port()
    procs = [start(k, 2, port, ["-n", "2", path, "x", "--flag"]) for k in (1, 0)]  # node 1 may come first
    runs = finish(procs)[::-1]
    check_job(runs, 2, 2)
    # output lines carry the global rank
    assert "[rank3] RESULT" in runs[1][1] and "[rank0] RESULT" in runs[0][1]


def test_three_nodes_of_one_rank(tmp_path):
    path = script(tmp_path, JOB)
    port = free_port()
    procs = [start(k, 3, port, ["-n", "1", path, "x", "--flag"]) for k in range(3)]
    check_job(finish(procs), 3, 1)


FAIL = """
import os, sys, time
if os.environ["RANK"] == os.environ["FAIL_RANK"]:
    time.sleep(0.5)
    sys.exit(7)
print("PID", os.getpid(), flush=True)
time.sleep(120)
"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("fail_rank", [3, 0])
def test_a_failing_rank_stops_every_node(tmp_path, fail_rank):
    path = script(tmp_path, FAIL)
    port = free_port()
    env = dict(os.environ, FAIL_RANK=str(fail_rank))
    t0 = time.monotonic()
    procs = [start(k, 2, port, ["-n", "2", "--grace", "1", path], env=env) for k in range(2)]
    runs = finish(procs, timeout=60)
    assert time.monotonic() - t0 < 30
    failing = fail_rank // 2
    for node, (rc, out, err) in enumerate(runs):
        assert rc == 7, (node, out, err)
        if node == failing:
            assert f"rank {fail_rank} exited with code 7" in err
        else:
            assert f"node {failing}: rank {fail_rank} exited with code 7; stopping ranks" in err, err
        for line in out.splitlines():
            if "PID" in line:
                assert not alive(int(line.split()[-1]))


def test_disagreeing_nodes_are_refused_on_both(tmp_path):
    path = script(tmp_path, JOB)
    port = free_port()
    procs = [start(0, 2, port, ["-n", "2", path]), start(1, 2, port, ["-n", "3", path])]
    for rc, out, err in finish(procs):
        assert rc == 1 and "RESULT" not in out
        assert "starts -n 3 ranks but node 0 starts 2" in err, err
    port = free_port()
    other = script(tmp_path, JOB, name="other.py")
    procs = [start(0, 2, port, ["-n", "1", path]), start(1, 2, port, ["-n", "1", other])]
    for rc, _out, err in finish(procs):
        assert rc == 1 and "other.py" in err and "a different job" in err, err


def test_node_rank_used_twice(tmp_path):
    path = script(tmp_path, JOB)
    port = free_port()
    first = [start(0, 3, port, ["-n", "1", path]), start(1, 3, port, ["-n", "1", path])]
    time.sleep(1.5)
    second = start(1, 3, port, ["-n", "1", path])
    runs = finish(first + [second], timeout=60)
    for rc, _out, err in runs:
        assert rc == 1 and "node rank 1 was given to two launchers" in err, err
    # node 0 twice: the second one cannot take the store's port
    port = free_port()
    procs = [start(0, 2, port, ["-n", "1", "--join-timeout", "2", path])]
    time.sleep(1.0)
    procs.append(start(0, 2, port, ["-n", "1", path]))
    runs = finish(procs)
    assert runs[1][0] == 1 and f"port {port}" in runs[1][2] and "already node 0" in runs[1][2]
    assert runs[0][0] == 1 and "waiting for node [1]" in runs[0][2]


def test_missing_node_times_out_naming_it(tmp_path):
    path = script(tmp_path, JOB)
    port = free_port()
    t0 = time.monotonic()
    rc, out, err = finish([start(0, 3, port, ["-n", "1", "--join-timeout", "1.5", path])])[0]
    assert rc == 1 and time.monotonic() - t0 < 20
    assert "timed out after 1.5 s waiting for nodes [1, 2] to join" in err, err


def test_secret_from_the_environment(tmp_path):
    path = script(tmp_path, JOB)
    port = free_port()
    env = dict(os.environ, TPCORE_STORE_SECRET=secrets.token_hex(24))
    procs = [start(k, 2, port, ["-n", "1", path, "x", "--flag"], env=env) for k in range(2)]
    got = check_job(finish(procs), 2, 1)
    assert all(r["secret_len"] == 48 for r in got.values())
    # different secrets on the two nodes: node 1 is refused by the store, clearly
    port = free_port()
    procs = [start(0, 2, port, ["-n", "1", "--join-timeout", "2", path], env=env),
             start(1, 2, port, ["-n", "1", path], env=dict(env, TPCORE_STORE_SECRET=secrets.token_hex(24)))]
    runs = finish(procs)
    assert runs[1][0] == 1 and "authentication failed" in runs[1][2], runs[1][2]
    assert runs[0][0] == 1


@pytest.mark.parametrize("argv,msg", [
    (["--nnodes", "2", "-n", "1", "x.py"], "needs --node-rank"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "1234", "-n", "1", "x.py"], "--node-rank must be in 0..1"),
    (["--nnodes", "2", "--node-rank", "0", "-n", "1", "x.py"], "needs --master-port"),
    (["--nnodes", "0", "-n", "1", "x.py"], "--nnodes must be >= 1"),
    (["--node-rank", "1", "-n", "1", "x.py"], "needs --nnodes > 1"),
])
def test_bad_arguments(argv, msg):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    r = subprocess.run(LAUNCH + argv, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_env_detects_hosts():
    base = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TPCORE_JOB_ID": "j"}
    assert _env.detect(dict(base, TPCORE_NNODES="2")).nnodes == 2
    assert _env.detect(base).nnodes == 2 and _env.detect(base).multi_host
    one = dict(base, LOCAL_WORLD_SIZE="4", LOCAL_RANK="3")
    assert _env.detect(one).nnodes == 1 and not _env.detect(one).multi_host
    with pytest.raises(ValueError, match="TPCORE_NNODES must be in 1..4"):
        _env.detect(dict(base, TPCORE_NNODES="5"))


def test_no_secret_files_left_behind():
    from tpcore.launch.multinode import secret_path
    d = os.path.dirname(secret_path("127.0.0.1", 1))
    assert not os.path.exists(d) or os.listdir(d) == []


HANG = """
import os, time
print("PID", os.getpid(), flush=True)
time.sleep(120)
"""


def wait_for_pids(proc, n, limit=30):
    pids, end = [], time.monotonic() + limit
    while len(pids) < n and time.monotonic() < end:
        line = proc.stdout.readline()
        if "PID" in line:
            pids.append(int(line.split()[-1]))
    assert len(pids) == n
    return pids


@pytest.mark.parametrize("killed", [1, 0])
def test_a_lost_launcher_fails_the_job(tmp_path, killed):
    """A launcher killed with SIGKILL (its ranks die with it): node 0 notices the missing
    heartbeat of node 1; node 1 notices that node 0's store is gone.  Either way the
    survivor stops its ranks and exits non-zero, naming what happened."""
    path = script(tmp_path, HANG)
    port = free_port()
    procs = [start(k, 2, port, ["-n", "1", "--grace", "1", "--heartbeat-timeout", "2", path]) for k in range(2)]
    try:
        pids = [wait_for_pids(p, 1)[0] for p in procs]
        t0 = time.monotonic()
        procs[killed].kill()
        procs[killed].wait()
        survivor = procs[1 - killed]
        out, err = survivor.communicate(timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        finish(procs, timeout=10)
    assert survivor.returncode == 1
    if killed == 1:
        assert "node 1's launcher stopped answering (no heartbeat for 2 s" in err, err
    else:
        assert "lost the job's store" in err, err
        # node 0 died by SIGKILL: its generated secret file stays (mode 0600; the next node 0
        # on this address and port replaces it)
        from tpcore.launch.multinode import secret_path
        leftover = secret_path("127.0.0.1", port)
        assert os.path.exists(leftover)
        os.unlink(leftover)
        try:
            os.rmdir(os.path.dirname(leftover))
        except OSError:
            pass
    end = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_ctrl_c_on_one_node_stops_every_node(tmp_path):
    import signal
    path = script(tmp_path, HANG)
    port = free_port()
    procs = [start(k, 2, port, ["-n", "1", "--grace", "1", path]) for k in range(2)]
    try:
        for p in procs:
            wait_for_pids(p, 1)
        procs[1].send_signal(signal.SIGINT)
        runs = finish(procs, timeout=30)
    finally:
        finish(procs, timeout=5)
    assert [rc for rc, _, _ in runs] == [130, 130], runs
    assert "node 1: its launcher got SIGINT" in runs[0][2]


def test_a_late_launcher_of_another_job_is_refused(tmp_path):
    """A launcher that reaches a job's store after the job was formed (another job on the same
    port) is refused with the running job's shape, and the running job is not disturbed."""
    path = script(tmp_path, HANG)
    port = free_port()
    procs = [start(k, 2, port, ["-n", "1", path]) for k in range(2)]
    try:
        for p in procs:
            wait_for_pids(p, 1)
        late = finish([start(2, 3, port, ["-n", "1", path])])[0]
        assert late[0] == 1 and "was formed without this node: it runs 2 nodes x 1 ranks" in late[2], late
        assert all(p.poll() is None for p in procs)  # still running
    finally:
        for p in procs:
            p.terminate()
        finish(procs, timeout=30)
