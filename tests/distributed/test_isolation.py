"""Jobs kept apart from each other and from other users, and nothing left in
/dev/shm when a whole job is killed.

Jobs here are real processes started the way users start them: torchrun-style
variables set by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, no
TPCORE_JOB_ID), TPCORE_JOB_ID set by hand, or python -m tpcore.launch."""
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import JOB_PREFIX
from tpcore.utils import cleanup as _cleanup

import paths
ROOT = str(paths.ROOT)
NOBODY = 65534

RANK = r'''
import os, sys, time
import numpy as np
import tpcore
try:
    c = tpcore.init(timeout=float(os.environ.get("T_TIMEOUT", "10")))
    x = np.array([float(os.environ["T_VALUE"])])
    c.all_reduce(x)
    print("SUM", x[0], flush=True)
    for _ in range(int(os.environ.get("T_ALLOCS", "0"))):
        a = c.alloc((3000,), "float32")
        a[:] = 1.0
        c.all_reduce(a)
        assert float(a[0]) == c.size, a[0]
        del a
    hold = os.environ.get("T_HOLD")
    if hold:  # stay in the job until told to go on, then one more collective
        while not os.path.exists(hold):
            time.sleep(0.01)
        c.barrier()
        print("AFTER", flush=True)
    c.close()
except Exception as e:
    print("ERR", type(e).__name__, str(e).replace("\n", " "), flush=True)
    sys.exit(3)
'''


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**kw):
    env = {k: v for k, v in os.environ.items()  # TPCORE_JOB_PREFIX kept: this session's jobs (conftest)
           if k == "TPCORE_JOB_PREFIX"
           or not k.startswith(("TPCORE_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC_", "SLURM_"))}
    env.update({k: str(v) for k, v in kw.items()})
    return env


def _start(**kw):
    return subprocess.Popen([sys.executable, "-c", RANK], env=_env(**kw), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=ROOT)


def _finish(p, timeout=60):
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def _wait_line(p, prefix, timeout=30):
    end = time.monotonic() + timeout
    lines = []
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no {prefix!r} line; got {lines}")


def _fnv1a(text):
    h = 1469598103934665603
    for b in text.encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def _world_segment(job):
    """The name of a job's world communicator (csrc/comm/shm/shm_rendezvous.c)."""
    return f"/dev/shm/tpcore_{job}_{_fnv1a('w'):016x}"


def _as_nobody(code):
    """Run Python code as uid/gid 65534 (another local user)."""
    pre = f"import os\nos.setgroups([])\nos.setgid({NOBODY})\nos.setuid({NOBODY})\n"
    subprocess.run([sys.executable, "-I", "-c", pre + code], check=True, timeout=30)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creating files as another user needs root")


# ----------------------------------------------------------------- item 5

@pytest.mark.parametrize("intruder, says", [
    (0, ["used by two jobs at once", "rank 0 of a second job", "TPCORE_JOB_ID"]),  # finds the running segment
    (1, ["used by two jobs at once", "rank 1's place", "already taken by pid"]),   # finds its place taken
])
def test_a_rank_of_a_second_job_stops_both_jobs(intruder, says):
    port, hold = _port(), f"/tmp/tpcore-hold-{os.getpid()}-{_port()}"
    common = dict(WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TPCORE_SETTLE_S=0, T_HOLD=hold)
    a = [_start(RANK=r, T_VALUE=100 + r, **common) for r in range(2)]
    try:
        for p in a:
            assert _wait_line(p, "SUM").split()[1] == "201.0"
        code, out = _finish(_start(RANK=intruder, T_VALUE=200 + intruder, **common))
        assert code == 3 and all(w in out for w in says), out
        open(hold, "w").close()  # the running job's next call fails
        for p in a:
            code, out = _finish(p)
            assert code == 3 and "used by two jobs at once" in out and "AFTER" not in out, out
    finally:
        for p in a:
            p.kill()
            p.wait()
        if os.path.exists(hold):
            os.unlink(hold)


@pytest.mark.slow  # two jobs of 4 ranks at once; test_close_and_init_again_with_the_same_id keeps jobs apart too
def test_two_jobs_started_together_never_mix():
    """Two torchrun-style jobs on one address and port, all four ranks started at
    once: each rank computes its own job's sum or fails naming the collision,
    never a sum over both jobs."""
    outcomes = []
    for _ in range(3):
        port = _port()
        common = dict(WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, T_TIMEOUT=6)
        procs = [(job, _start(RANK=r, T_VALUE=base + r, **common))
                 for r in range(2) for job, base in (("A", 100), ("B", 200))]
        for job, p in procs:
            code, out = _finish(p)
            sums = [line.split()[1] for line in out.splitlines() if line.startswith("SUM")]
            if code == 0:
                assert sums == [{"A": "201.0", "B": "401.0"}[job]], (job, out)
                outcomes.append("ok")
            else:
                assert not sums or sums == [{"A": "201.0", "B": "401.0"}[job]], (job, out)
                assert "two jobs at once" in out or "timed out" in out, out
                outcomes.append("error")
    assert outcomes


def test_scheduler_job_ids_tell_jobs_apart():
    from tpcore.distributed import env as _env
    base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    a = _env.detect(dict(base, SLURM_JOB_ID="11"))
    b = _env.detect(dict(base, SLURM_JOB_ID="12"))
    bare = _env.detect(base)
    assert len({a.job_id, b.job_id, bare.job_id}) == 3
    # Two jobs started by hand inside one allocation share its id: still settle.
    assert not a.unique and not b.unique and not bare.unique
    assert _env.detect(dict(base, TORCHELASTIC_RUN_ID="none")).unique  # torchrun's agent holds the port


REINIT = r'''
import os, time, numpy as np, tpcore
for i in range(4):
    c = tpcore.init(timeout=20)
    x = np.array([1.0 + i])
    c.all_reduce(x)
    assert x[0] == 2 * (1.0 + i), x
    if c.rank == int(os.environ["T_SLOW"]):
        time.sleep(0.3)  # its peer is already making the next communicator
    c.close()
print("OK", flush=True)
'''


@pytest.mark.parametrize("slow", [0, 1])
def test_close_and_init_again_with_the_same_id(slow):
    job = f"{JOB_PREFIX}iso{os.getpid()}r{slow}{random.randrange(1 << 30)}"
    procs = [subprocess.Popen([sys.executable, "-c", REINIT], env=_env(RANK=r, WORLD_SIZE=2, TPCORE_JOB_ID=job,
                                                                          T_SLOW=slow),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for r in range(2)]
    for p in procs:
        code, out = _finish(p)
        assert code == 0 and "OK" in out, out


def test_single_rank_jobs_may_share_an_id():
    job = f"{JOB_PREFIX}iso{os.getpid()}s{random.randrange(1 << 30)}"
    hold = f"/tmp/tpcore-hold-{os.getpid()}-{_port()}"
    try:
        procs = [_start(TPCORE_JOB_ID=job, T_VALUE=5, T_HOLD=hold) for _ in range(3)]
        for p in procs:
            assert _wait_line(p, "SUM").split()[1] == "5.0"
        open(hold, "w").close()
        for p in procs:
            code, out = _finish(p)
            assert code == 0 and "AFTER" in out, out
    finally:
        if os.path.exists(hold):
            os.unlink(hold)


FORKS = r'''
import os, sys, time, numpy as np, tpcore
c = tpcore.init(timeout=20)
c.barrier()
if os.fork() == 0:  # a worker the rank forks (a DataLoader worker, say), outliving it
    time.sleep(30)
    os._exit(0)
print("READY", flush=True)
time.sleep(60)
'''


def test_a_forked_child_does_not_keep_a_dead_job_alive():
    job = f"{JOB_PREFIX}iso{os.getpid()}f{random.randrange(1 << 30)}"
    procs = [subprocess.Popen([sys.executable, "-c", FORKS], env=_env(RANK=r, WORLD_SIZE=2, TPCORE_JOB_ID=job),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                              start_new_session=True)
             for r in range(2)]
    try:
        for p in procs:
            _wait_line(p, "READY")
        for p in procs:
            p.kill()  # the ranks die; their forked children live on
            p.wait()
        # The same job id starts again at once: the dead job's name is not held by the children.
        nxt = [_start(RANK=r, WORLD_SIZE=2, TPCORE_JOB_ID=job, T_VALUE=r) for r in range(2)]
        for p in nxt:
            code, out = _finish(p)
            assert code == 0 and "SUM 1.0" in out, out
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ----------------------------------------------------------------- item 6

@needs_root
def test_segment_of_another_user_is_never_joined():
    job = f"{JOB_PREFIX}iso{os.getpid()}x{random.randrange(1 << 30)}"
    path = _world_segment(job)
    _as_nobody(f"fd = os.open({path!r}, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)\n"
               f"os.fchmod(fd, 0o666)\nos.write(fd, b'\\0' * 65536)\nos.close(fd)\n")
    try:
        procs = [_start(RANK=r, WORLD_SIZE=2, TPCORE_JOB_ID=job, T_VALUE=r, T_TIMEOUT=5) for r in range(2)]
        for p in procs:
            code, out = _finish(p)
            assert code == 3 and "belongs to user 'nobody' (uid 65534)" in out and "refusing" in out, out
        assert os.stat(path).st_uid == NOBODY  # left as it was: not ours to remove
    finally:
        os.unlink(path)


def test_loosened_segment_is_refused():
    job = f"{JOB_PREFIX}iso{os.getpid()}y{random.randrange(1 << 30)}"
    path = _world_segment(job)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.fchmod(fd, 0o644)
    os.write(fd, b"\0" * 65536)
    os.close(fd)
    try:
        procs = [_start(RANK=r, WORLD_SIZE=2, TPCORE_JOB_ID=job, T_VALUE=r, T_TIMEOUT=5) for r in range(2)]
        for p in procs:
            code, out = _finish(p)
            assert code == 3 and "has mode 0644, expected 0600" in out, out
    finally:
        os.unlink(path)


# ----------------------------------------------------------------- item 7

ATTACKER = r'''
import os, re, sys, time
job, end, stop = sys.argv[1], time.monotonic() + float(sys.argv[2]), sys.argv[3]
made = set()
pat = re.compile(r"^(tpcore_" + re.escape(job) + r"_.*_m)(\d+)$")
print("WATCHING", flush=True)
while time.monotonic() < end and not os.path.exists(stop):
    for name in os.listdir("/dev/shm"):
        if not name.startswith("tpcore_" + job + "_"):
            continue
        m = pat.match(name)
        guesses = [name + f"_m{i}" for i in range(4)]  # registered memory of a world name
        if m:  # the next ones after a registered buffer seen
            guesses += [m.group(1) + str(int(m.group(2)) + k) for k in range(1, 4)]
        for g in guesses:
            if g not in made:
                made.add(g)
                try:
                    os.close(os.open("/dev/shm/" + g, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
                except OSError:
                    pass
    time.sleep(0.0005)
print("MADE", len(made), flush=True)
'''

# What the attacker needs as the other user: this interpreter, the modules it imports (the
# interpreter's own files must be readable by that user: not the case for one installed in
# a home directory of mode 0700, such as a pyenv under /root), and /dev/shm to list and
# create names in.
ATTACKER_PROBE = r'''
import os, re, sys, time
os.listdir("/dev/shm")
name = "/dev/shm/tpcore-probe-%d-%d" % (os.getpid(), time.monotonic_ns())
os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
os.unlink(name)
print("PROBE OK")
'''


def _nobody_cannot_attack():
    # why another user cannot run the attacker here (None: it can)
    pre = f"import os\nos.setgroups([])\nos.setgid({NOBODY})\nos.setuid({NOBODY})\n"
    r = subprocess.run([sys.executable, "-I", "-c", pre + ATTACKER_PROBE], capture_output=True, text=True,
                       timeout=30)
    if r.returncode == 0 and "PROBE OK" in r.stdout:
        return None
    last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
    return f"uid {NOBODY} cannot run {sys.executable} with the modules the attacker imports, or use /dev/shm: {last}"


@pytest.mark.slow  # a second user's process watching for seconds
@needs_root
def test_another_user_watching_dev_shm_cannot_take_registered_memory_names(tmp_path):
    """Another user lists /dev/shm while a job allocates registered memory and
    creates every name it could guess from what it sees; the job goes on."""
    why = _nobody_cannot_attack()
    if why:
        pytest.skip(why)
    job = f"{JOB_PREFIX}iso{os.getpid()}z{random.randrange(1 << 30)}"
    stop = f"/tmp/tpcore-stop-{os.getpid()}-{random.randrange(1 << 30)}"  # /tmp: the other user can see it
    pre = f"import os\nos.setgroups([])\nos.setgid({NOBODY})\nos.setuid({NOBODY})\n"
    attacker = subprocess.Popen([sys.executable, "-I", "-c", pre + ATTACKER, job, "60", stop],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert attacker.stdout.readline().strip() == "WATCHING", attacker.communicate(timeout=30)
        procs = [_start(RANK=r, WORLD_SIZE=3, TPCORE_JOB_ID=job, T_VALUE=r, T_ALLOCS=25) for r in range(3)]
        for p in procs:
            rc, out = _finish(p)
            assert rc == 0 and "SUM 3.0" in out, out
        open(stop, "w").close()
        out, err = attacker.communicate(timeout=30)
        assert attacker.returncode == 0 and out.startswith("MADE"), (attacker.returncode, out, err)
    finally:
        if attacker.poll() is None:
            attacker.kill()
            attacker.wait()
        if os.path.exists(stop):
            os.unlink(stop)
        squat = [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm") if n.startswith(f"tpcore_{job}_")]
    assert squat, "the attacker saw no name: the test did not test anything"
    assert _cleanup.remove_shm(job) == []  # the squatter's files are not ours: untouched, no error
    assert all(os.stat(p).st_uid == NOBODY for p in squat)
    for p in squat:
        os.unlink(p)


# ----------------------------------------------------------------- item 8

ALLOC_LOOP = r'''
import numpy as np, tpcore
c = tpcore.init(timeout=20)
for i in range(400):
    a = c.alloc((65536 * (1 + i % 4),), "float32")
    a[:] = 1
    c.all_reduce(a)
    del a
c.close()
'''


def _ours_new(before):
    # this session's names only (conftest.JOB_PREFIX): other jobs of this user may run beside the tests
    ours = {p for p in _cleanup.shm_segments() if os.path.basename(p).startswith(f"tpcore_{JOB_PREFIX}")}
    return sorted(ours - before)


@pytest.mark.slow  # 8 kills at random moments; test_killed_torchrun_style_job_is_swept_by_cleanup_and_next_start: one
def test_launcher_group_killed_leaves_nothing(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(ALLOC_LOOP)
    rng = random.Random(8)
    left = []
    for _ in range(8):
        before = set(_ours_new(set()))
        p = subprocess.Popen([sys.executable, "-m", "tpcore.launch", "-n", "3", str(script)],
                             cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
        time.sleep(rng.uniform(0.3, 1.5))  # during set-up or the alloc loop
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        end = time.monotonic() + 10
        while _ours_new(before) and time.monotonic() < end:
            time.sleep(0.05)
        left += _ours_new(before)
    assert not left, f"segments left after SIGKILL of the launcher's group: {left}"


def test_cleanup_of_a_job_takes_its_nccl_names_and_no_other_jobs():
    """remove_shm(job) (spawn's, the janitor's, python -m tpcore.cleanup --job): the job's shm
    and nccl names that no process locks; a locked one and another job's are kept."""
    import fcntl
    job = f"{JOB_PREFIX}iso{os.getpid()}c{random.randrange(1 << 30)}"
    tag = f"{random.getrandbits(64):016x}"
    dead = [f"/dev/shm/tpcore_{job}_{tag}", f"/dev/shm/tpcore_nccl_{job}_{tag}"]
    kept = [f"/dev/shm/tpcore_nccl_{job}_{tag}_locked", f"/dev/shm/tpcore_nccl_{job}x_{tag}",
            f"/dev/shm/tpcore_{job}x_{tag}"]
    fds = [os.open(p, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600) for p in dead + kept]
    try:
        fcntl.flock(fds[2], fcntl.LOCK_SH)  # a live job's
        assert sorted(_cleanup.remove_shm(job)) == sorted(dead)
        assert not any(os.path.exists(p) for p in dead) and all(os.path.exists(p) for p in kept)
    finally:
        for fd in fds:
            os.close(fd)
        for p in dead + kept:
            if os.path.exists(p):
                os.unlink(p)


def test_killed_torchrun_style_job_is_swept_by_cleanup_and_next_start():
    job = f"{JOB_PREFIX}iso{os.getpid()}k{random.randrange(1 << 30)}"
    hold = f"/tmp/tpcore-hold-{os.getpid()}-{_port()}"
    procs = [_start(RANK=r, WORLD_SIZE=2, TPCORE_JOB_ID=job, T_VALUE=r, T_HOLD=hold) for r in range(2)]
    for p in procs:
        _wait_line(p, "SUM")
    name = _world_segment(job)
    assert os.path.exists(name)  # the job's claim on its id while it runs
    # A live job's segment is kept by cleanup.
    r = subprocess.run([sys.executable, "-m", "tpcore.cleanup", "--job", job], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and os.path.exists(name) and "1 in use by running jobs kept" in r.stdout, r.stdout
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # SIGKILL: no one could remove it (but any tpcore start of this user sweeps it: another
    # job of this user running beside the tests may have done so already).
    r = subprocess.run([sys.executable, "-m", "tpcore.cleanup", "--dry-run", "--job", job], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=60)
    if os.path.exists(name):
        assert f"would remove {name}" in r.stdout and os.path.exists(name), r.stdout
    # The next start of a job of this user removes it.
    nxt = [_start(RANK=r, WORLD_SIZE=2, TPCORE_JOB_ID=job + "n", T_VALUE=r) for r in range(2)]
    for p in nxt:
        rc, out = _finish(p)
        assert rc == 0, out
    assert not os.path.exists(name)
