"""tpcore.Cluster's life cycle: close / with / garbage collection / exit / a killed parent /
an interrupt (while running and while starting) leaving no process and no /dev/shm name, a
deadline, a close from another thread, a rank that dies while others compute, and output
relayed without hanging (10 MB at once, C code writing while holding the GIL).  Results,
state, output and errors: test_cluster.py."""
import gc
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

import tpcore
from conftest import leftover_segments

import paths
from cluster_common import DEADLINE, PKG_PARENT, Interrupter, alive, as_main, children, rank_pid

ROOT = paths.ROOT


# -- closing -----------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["close", "with", "gc"])
def test_closing_leaves_no_process_and_no_segment(how):
    before_kids, before_shm = children(), set(leftover_segments())
    if how == "with":
        with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
            pids = cluster.run(rank_pid)
            assert set(leftover_segments()) <= before_shm  # names go once every rank has joined
    else:
        cluster = tpcore.Cluster(2, deadline=DEADLINE)
        pids = cluster.run(rank_pid)
        assert set(pids) <= children()
        if how == "close":
            cluster.close()
            cluster.close()  # idempotent
            with pytest.raises(RuntimeError, match="Cluster.run: this cluster is closed"):
                cluster.run(rank_pid)
            assert "closed" in repr(cluster)
        else:
            del cluster
            gc.collect()
    assert not any(alive(p) for p in pids)
    assert children() <= before_kids
    assert set(leftover_segments()) <= before_shm


def test_exit_without_close_leaves_nothing():
    script = ("import tpcore, os\n"
              "c = tpcore.Cluster(2)\n"
              "print(' '.join(map(str, c.run(lambda comm: os.getpid()))), flush=True)\n")
    before = set(leftover_segments())
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 2
    t_end = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < t_end:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)
    assert set(leftover_segments()) <= before


def test_a_killed_parent_leaves_no_rank_and_no_segment():
    script = ("import tpcore, os, sys, time\n"
              "c = tpcore.Cluster(2)\n"
              "print(' '.join(map(str, c.run(lambda comm: os.getpid()))), flush=True)\n"
              "time.sleep(60)\n")
    before = set(leftover_segments())
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pids = [int(x) for x in p.stdout.readline().split()]
        assert len(pids) == 2 and set(leftover_segments()) <= before  # gone once every rank joined
    finally:
        p.kill()  # SIGKILL: no atexit, no finalizer
        p.wait(30)
        p.stdout.close()
    t_end = time.monotonic() + 15  # the ranks die with the parent; the janitor removes the names
    while (any(alive(q) for q in pids) or set(leftover_segments()) - before) and time.monotonic() < t_end:
        time.sleep(0.05)
    assert not any(alive(q) for q in pids)
    assert set(leftover_segments()) <= before


def _sleep_long(comm):
    print("started", flush=True)
    time.sleep(60)


def test_interrupt_stops_every_rank(monkeypatch, sigint_raises):
    before = children()
    before_shm = set(leftover_segments())
    cluster = tpcore.Cluster(2, deadline=DEADLINE)
    try:
        pids = cluster.pids
        monkeypatch.setattr(sys, "stdout", Interrupter(2))
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match="every rank was stopped"):
            cluster.run(_sleep_long)
        monkeypatch.undo()
        assert time.monotonic() - t0 < 20
        assert cluster.closed
        with pytest.raises(RuntimeError, match="interrupted"):
            cluster.run(rank_pid)
        assert not any(alive(p) for p in pids)
        assert children() <= before
        assert set(leftover_segments()) <= before_shm
    finally:
        cluster.close()  # a failure above must not leave the ranks to every later test


def _started_then_rank(comm):
    print("started", flush=True)
    time.sleep(0.5)
    return comm.rank


def test_an_ignored_sigint_leaves_run_alone(monkeypatch):
    # SIGINT ignored (a background job): an interrupt is not an interrupt, and run() finishes
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
            out = Interrupter(2)
            monkeypatch.setattr(sys, "stdout", out)
            assert cluster.run(_started_then_rank) == [0, 1]
            monkeypatch.undo()
            assert out.sent and not cluster.closed
            assert cluster.run(rank_pid) == cluster.pids
    finally:
        signal.signal(signal.SIGINT, old)


# -- starting, closing from elsewhere, dead ranks, large outputs -----------------------------
def _interrupt_self():
    os.kill(os.getpid(), signal.SIGINT)  # what a kernel interrupt does; raised at the next bytecode


@pytest.mark.parametrize("when", ["janitor", "rank1"])
def test_interrupt_while_starting_leaves_nothing(monkeypatch, sigint_raises, when):
    # a Ctrl-C right after the janitor or a rank started (before the cluster recorded it) used to
    # leave that process running, and the janitor (and the segment) with it
    import tpcore.launch.cluster as tc
    before, before_shm = children(), set(leftover_segments())
    if when == "janitor":
        real = tc._cleanup.start_janitor

        def start_janitor(job):
            out = real(job)
            _interrupt_self()
            return out
        monkeypatch.setattr(tc._cleanup, "start_janitor", start_janitor)
    else:
        ctx = tc.mp.get_context("fork")

        class Process(ctx.Process):
            def start(self):
                super().start()
                if self.name.endswith("rank1"):
                    _interrupt_self()
        monkeypatch.setattr(tc.mp, "get_context", lambda method: types.SimpleNamespace(Pipe=ctx.Pipe, Process=Process))
    with pytest.raises(KeyboardInterrupt):
        tpcore.Cluster(3, deadline=DEADLINE)
    assert children() <= before
    assert set(leftover_segments()) <= before_shm


def _print_10mb(comm):
    sys.stdout.write("".join(f"{i:049d}\n" for i in range(200_000)))  # 10 MB in one write
    return comm.rank


def test_a_rank_printing_10mb_at_once_is_relayed_quickly(capsys):
    # the parent's relay searched the rest of the text for a "\r" at every line: quadratic, ~20 s here
    with tpcore.Cluster(1, deadline=DEADLINE) as cluster:
        t0 = time.monotonic()
        assert cluster.run(_print_10mb) == [0]
        took = time.monotonic() - t0
        out = capsys.readouterr().out  # all of it arrived before run() returned
    assert out == "".join(f"[rank0] {i:049d}\n" for i in range(200_000))
    assert took < 8, took


class _LoadsBadly:
    """Pickles on the rank, fails to unpickle in the parent."""

    def __reduce__(self):
        return (int, ("not a number",))


def test_a_result_that_cannot_be_unpickled_names_its_rank():
    # the parent's unpickling error came out bare (ValueError: invalid literal for int())
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        with pytest.raises(TypeError, match=r"Cluster.run: the return value of rank 1 cannot be unpickled here: "
                                            r"ValueError: invalid literal") as ei:
            cluster.run(lambda comm: _LoadsBadly() if comm.rank == 1 else comm.rank)
        assert isinstance(ei.value.__cause__, ValueError)
        assert cluster.run(lambda comm: comm.rank) == [0, 1]  # still usable


def test_close_from_another_thread_during_run():
    # the running call said "rank 0 ... was killed by signal SIGTERM" (a dead rank) instead
    cluster = tpcore.Cluster(2, deadline=DEADLINE)
    pids = cluster.pids
    got = []

    def target():
        try:
            got.append(cluster.run(_sleep_long))
        except BaseException as e:  # noqa: BLE001 - the exception is handed back for the test to check
            got.append(e)
    t = threading.Thread(target=target)
    t.start()
    t_end = time.monotonic() + 20
    while not cluster._busy.locked() and time.monotonic() < t_end:
        time.sleep(0.01)
    cluster.close()
    t.join(30)
    assert len(got) == 1 and isinstance(got[0], RuntimeError), got
    assert re.search(r"Cluster.run: the cluster was closed while this call ran \(close\(\) was called\)", str(got[0]))
    assert not any(alive(p) for p in pids)


def test_fd_relay_sync_waits_for_its_own_marker_after_one_timed_out():
    # sync() used a semaphore: the late marker of a sync that timed out released it, so the next
    # sync returned before its output was sent (the output then came after run() returned)
    from tpcore.launch.cluster_rank import _FdRelay
    fd = os.dup(2)  # a descriptor of our own for the relay to take over
    gate = threading.Event()
    got = []

    def send(msg):
        gate.wait()
        time.sleep(0.2)  # a slow parent
        got.append(msg[3])
    relay = _FdRelay(fd, "stdout", 0, send)
    try:
        os.write(fd, b"one\n")
        relay.sync(timeout=0.05)  # times out: send() is held
        gate.set()
        t_end = time.monotonic() + 10
        while not got and time.monotonic() < t_end:
            time.sleep(0.01)
        time.sleep(0.1)  # the pump sees the late marker right after sending "one"
        os.write(fd, b"two\n")
        relay.sync(timeout=10)
        assert "".join(got) == "one\ntwo\n"
    finally:
        os.close(fd)  # the pump reads its end, then stops
        for t in threading.enumerate():
            if t.name == f"tpcore-fd{fd}":
                t.join(10)
        os.close(relay.r)


def _c_write_holding_the_gil(comm, nbytes):
    import ctypes
    libc = ctypes.PyDLL(None)  # PyDLL keeps the GIL during the call, as C extension code does
    line = f"C line of rank {comm.rank}".ljust(99).encode() + b"\n"
    data = line * (nbytes // 100)
    assert libc.write(1, data, len(data)) == len(data)
    return comm.rank


def test_c_code_writing_much_while_holding_the_gil_does_not_hang(capfd):
    # the relay's pipe held 64 KiB: a C write of more, the GIL held, waited for the relay thread,
    # which waited for the GIL: the rank hung
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        assert cluster.run(_c_write_holding_the_gil, 512 * 1024) == [0, 1]
        out = capfd.readouterr().out
    for r in range(2):
        assert out.count(f"[rank{r}] C line of rank {r}") == 512 * 1024 // 100, out[-500:]


def _raise_then_die(comm):
    if comm.rank == 1:
        threading.Timer(0.2, os._exit, (7,)).start()
        raise ValueError("then dies")
    comm.barrier()


def _die_while_others_compute(comm):
    if comm.rank == 1:
        os._exit(5)
    time.sleep(60)  # not in a collective: nothing tells this rank that rank 1 died


@pytest.mark.parametrize("fn,said", [(_raise_then_die, "exited with code 7"), (_die_while_others_compute,
                                                                               "exited with code 5")])
def test_a_rank_that_dies_does_not_keep_run_waiting(fn, said):
    # a rank that raised and then died broke the rebuild's send (a bare BrokenPipeError, the cluster
    # left open, the next run hung); a dead rank made run() wait for the others to finish
    before = children()
    cluster = tpcore.Cluster(3, timeout=60, deadline=DEADLINE)
    pids = cluster.pids
    t0 = time.monotonic()
    with pytest.raises(tpcore.RankExitedError, match=f"rank 1 .*{said}") as ei:
        cluster.run(fn)
    assert time.monotonic() - t0 < 20
    assert ei.value.rank == 1 and cluster.closed
    assert not any(alive(p) for p in pids)
    assert children() <= before


GLOBALS = '''
lr = 0.1
counter = 0

def bump(comm, by=1):
    global counter
    counter += by
    return counter, lr

def boom(comm, k):
    raise ValueError(k)
'''


def test_a_partial_of_a_notebook_function_sees_the_ranks_globals():
    # a functools.partial kept the parent's globals: the rank's counter was 0 again, its own value lost
    import functools
    ns = as_main(GLOBALS)
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        assert cluster.run(ns["bump"]) == [(1, 0.1)] * 2
        assert cluster.run(functools.partial(ns["bump"], by=10)) == [(11, 0.1)] * 2
        assert cluster.run(ns["bump"]) == [(12, 0.1)] * 2
        with pytest.raises(ValueError) as ei:  # its traceback names the cell, as for the function itself
            cluster.run(functools.partial(ns["boom"], k="x"))
        assert 'File "<cell>", line 11, in boom' in str(ei.value), str(ei.value)


def test_a_function_that_uses_the_cluster_itself_is_refused_clearly():
    # it said "cannot pickle '_thread.lock' object"
    ns = as_main("def f(comm):\n    return cluster.size\n")
    with tpcore.Cluster(1, deadline=DEADLINE) as cluster:
        ns["cluster"] = cluster
        with pytest.raises(TypeError, match=r"Cluster.run: fn and its arguments must be picklable .*"
                                            r"a tpcore.Cluster cannot be pickled, so it cannot be sent to its ranks"):
            cluster.run(ns["f"])
        assert cluster.run(lambda comm: comm.size) == [1]


def _uses_fileno(comm):
    import faulthandler
    faulthandler.enable()  # needs sys.stderr.fileno()
    subprocess.run(["sh", "-c", f"echo echo of rank {comm.rank}"], stdout=sys.stdout, check=True)
    return sys.stdout.fileno(), sys.stderr.fileno()


def test_fileno_of_a_ranks_streams(capfd):
    # sys.stdout.fileno() raised io.UnsupportedOperation: faulthandler.enable() failed on the ranks
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        assert cluster.run(_uses_fileno) == [(1, 2)] * 2
        out = capfd.readouterr().out
    for r in range(2):
        assert f"[rank{r}] echo of rank {r}\n" in out, out


class _BrokenStream(io.StringIO):
    def write(self, s):
        raise OSError("stream broken")


def test_an_error_while_reading_answers_does_not_shift_later_results(monkeypatch):
    # an exception inside run()'s wait (here a broken sys.stdout) left the ranks' answers in the
    # pipes: every later run() returned the previous run's results
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        monkeypatch.setattr(sys, "stdout", _BrokenStream())
        assert cluster.run(lambda comm, k: (print("hello"), k)[1], "first") == ["first"] * 2  # output dropped
        monkeypatch.undo()
        assert cluster.run(lambda comm, k: k, "second") == ["second"] * 2
        # any other failure there closes the cluster rather than leave it out of step
        import tpcore.launch.cluster as tc

        def broken_rebuild(*a):
            raise MemoryError("no memory for the exception")
        monkeypatch.setattr(tc, "_rebuild", broken_rebuild)
        with pytest.raises(MemoryError):
            cluster.run(lambda comm: 1 / 0)
        monkeypatch.undo()
        assert cluster.closed
        with pytest.raises(RuntimeError, match=r"this cluster is closed \(a Cluster.run failed reading the ranks"):
            cluster.run(lambda comm, k: k, "third")


BAD_STR = '''
class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str() fails")

def raise_bad_str(comm):
    raise BadStr("x")
'''


def test_an_exception_whose_str_fails_keeps_the_cluster():
    # str(e) failed inside the rank's error report: the rank died and the cluster was closed
    ns = as_main(BAD_STR)
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        with pytest.raises(ns["BadStr"]) as ei:  # the notebook class, its rank and traceback as a note
            cluster.run(ns["raise_bad_str"])
        assert ei.value.rank in (0, 1)
        notes = "\n".join(getattr(ei.value, "__notes__", []))
        assert "raised BadStr: <str() of the BadStr failed>" in notes and "in raise_bad_str" in notes, notes
        assert not cluster.closed
        assert cluster.run(lambda comm: comm.rank) == [0, 1]
