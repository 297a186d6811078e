"""`--background-load N` of the collectives benchmark: the busy processes run
for the whole run, the output states the load, and they are always stopped: at
the end, on an error inside the run, and when the benchmark is interrupted.
Not a timing test."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tpcore.bench.collectives import BUSY_MARKER, BackgroundLoad


def _busy_children(parent_pid):
    """pids of live busy processes started by `parent_pid` (their argv names it and the marker)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if BUSY_MARKER.encode() in argv and str(parent_pid).encode() in argv and state not in ("Z", "X"):
            found.append(int(entry))
    return found


def _busy_within(parent_pid, n, seconds=10.0):
    """The busy children once n of them show (a child just forked shows its parent's argv until it
    has exec'd: on a loaded machine that takes a moment)."""
    deadline = time.monotonic() + seconds
    while True:
        found = _busy_children(parent_pid)
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def _gone_within(parent_pid, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _busy_children(parent_pid):
            return True
        time.sleep(0.05)
    return False


def test_background_load_starts_and_stops():
    with BackgroundLoad(2) as load:
        assert len(load.pids) == 2
        assert all(p.poll() is None for p in load.procs)
        assert sorted(_busy_within(os.getpid(), 2)) == sorted(load.pids)
    assert _gone_within(os.getpid())


def test_background_load_stops_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with BackgroundLoad(2) as load:
            assert len(_busy_within(os.getpid(), 2)) == 2
            raise RuntimeError("boom")
    assert load.procs == []
    assert _gone_within(os.getpid())


def test_background_load_zero_and_bad_values():
    with BackgroundLoad(0) as load:
        assert load.pids == [] and load.describe() == "none"
    with pytest.raises(ValueError, match="background-load"):
        BackgroundLoad(-1)


def _bench(*extra):
    return [sys.executable, "-m", "tpcore.bench", "collectives", "-n", "2", "--quick", "--peers", "none",
            "--no-progress", "--ops", "all_reduce", "--mode", "private", "--max-bytes", "4K", *extra]


def test_benchmark_runs_with_background_load(tmp_path):
    out = tmp_path / "bench.json"
    p = subprocess.Popen(_bench("--background-load", "2", "--json", str(out)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, stdout + stderr
    assert "background load: 2 busy processes" in stdout
    assert "# background load during these tables: 2 busy processes" in stdout
    data = json.loads(out.read_text())
    assert data["options"]["background_load"] == 2 and data["env"]["background_load"] == 2
    rows = [r for r in data["rows"] if r["impl"] == "tpcore"]
    assert rows and all(r["wrong"] == 0 for r in rows)
    assert _gone_within(p.pid, 5.0), "busy processes outlived the benchmark"


def test_benchmark_interrupted_stops_the_load():
    # Many sizes and a long target time: still running when interrupted.
    # (--quick caps the iterations at 50: lifted, so the run cannot end before the signal.)
    # The child gets Ctrl-C's default disposition back: a test run started in the background
    # of a non-interactive shell inherits SIGINT ignored, and an ignored Ctrl-C rightly does
    # not interrupt (that made this test fail in a backgrounded fresh-clone run).
    p = subprocess.Popen(_bench("--background-load", "2", "--max-bytes", "64M", "--target-time", "5",
                                "--max-iters", "1000000"),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while len(_busy_children(p.pid)) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.05)
        assert len(_busy_children(p.pid)) == 2, "the busy processes did not start"
        p.send_signal(signal.SIGINT)  # Ctrl-C
        p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode != 0
    assert _gone_within(p.pid, 5.0), "busy processes outlived the interrupted benchmark"


def test_negative_background_load_is_an_error():
    r = subprocess.run(_bench("--background-load", "-1"), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--background-load must be >= 0, got -1" in r.stdout + r.stderr
