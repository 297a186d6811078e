"""Every promised error: bad arguments (TypeError / ValueError naming the
argument), mismatched collectives (CommError on every rank naming both sides),
a rank that raises, is killed or never arrives (the others fail within
seconds, naming it), and nothing left behind."""
import json
import os
import signal
import time
import traceback

import numpy as np
import pytest

import tpcore
from conftest import run

# ---------------------------------------------------------------- bad arguments


def _bad_args(comm):
    """Each bad call must raise the promised type with a message naming the
    argument; the communicator must stay usable afterwards."""
    x = np.ones(8, dtype=np.float32)
    cases = [
        (lambda: comm.all_reduce(np.ones(4, dtype=bool)), TypeError, ["x", "bool"]),
        (lambda: comm.all_reduce(np.ones(4, dtype=np.complex64)), TypeError, ["x", "complex64"]),
        (lambda: comm.all_reduce(np.ones(4, dtype=np.int16)), TypeError, ["x", "int16", "float32"]),
        (lambda: comm.all_reduce(np.ones(4, dtype=">f4")), TypeError, ["x"]),
        (lambda: comm.all_reduce(np.ones((4, 4), dtype=np.float32)[:, 1]), ValueError, ["x", "contiguous"]),
        (lambda: comm.all_reduce(np.ones((4, 4), dtype=np.float32).T), ValueError, ["x", "contiguous"]),
        (lambda: comm.all_reduce(np.frombuffer(bytes(32), dtype=np.float32)), ValueError, ["x", "read-only"]),
        (lambda: comm.all_reduce(x, out=np.ones(9, dtype=np.float32)), ValueError, ["out", "shape"]),
        (lambda: comm.all_reduce(x, out=np.ones(8, dtype=np.float64)), TypeError, ["out", "float64", "float32"]),
        (lambda: comm.all_reduce(x, op="median"), ValueError, ["op", "median"]),
        (lambda: comm.all_reduce(x, op=3), TypeError, ["op"]),
        (lambda: comm.all_reduce([1.0, 2.0]), TypeError, ["x", "list"]),
        (lambda: comm.broadcast(x, root=comm.size), ValueError, ["root", str(comm.size)]),
        (lambda: comm.broadcast(x, root=-1), ValueError, ["root"]),
        (lambda: comm.reduce(x, root=99), ValueError, ["root", "99"]),
        (lambda: comm.send(x, comm.size + 1), ValueError, ["peer"]),
        (lambda: comm.recv(x, -2), ValueError, ["peer"]),
        (lambda: comm.send(x, comm.rank), ValueError, ["peer", "itself"]),
        (lambda: comm.all_gather(x, axis=2), ValueError, ["axis"]),
        (lambda: comm.all_gather(x, sizes=[1] * (comm.size + 1)), ValueError, ["sizes"]),
        (lambda: comm.all_gather(x, out=np.empty(3, dtype=np.float32)), ValueError, ["out"]),
        (lambda: comm.reduce_scatter(x, sizes=[100] * comm.size), ValueError, ["sizes"]),
        (lambda: comm.alloc((-1, 2)), ValueError, ["negative"]),
        (lambda: comm.split("a"), ValueError, ["color"]),
    ]
    if comm.size > 1:
        cases.append((lambda: comm.reduce_scatter(np.ones(comm.size * 3 + 1, dtype=np.float32)),
                      ValueError, ["split evenly", "sizes"]))
    problems = []
    for i, (call, etype, words) in enumerate(cases):
        try:
            call()
            problems.append(f"case {i}: no error")
        except etype as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                problems.append(f"case {i}: {type(e).__name__}({e}) lacks {missing}")
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            problems.append(f"case {i}: {type(e).__name__} instead of {etype.__name__}: {e}")
    comm.barrier()
    y = np.full(3, comm.rank, dtype=np.int64)
    comm.all_reduce(y)
    if y[0] != sum(range(comm.size)):
        problems.append("communicator unusable after bad arguments")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bad_arguments(world):
    for r, problems in enumerate(run(_bad_args, world)):
        assert not problems, f"rank {r}: " + "; ".join(problems)


def _closed(comm):
    comm.close()
    comm.close()  # idempotent
    try:
        comm.barrier()
    except tpcore.CommError as e:
        return str(e)
    return None


def test_closed_communicator():
    msg = run(_closed, 2)
    assert all(m and "closed" in m for m in msg)


# ------------------------------------------------------------------- mismatches


def _mismatch(comm, kind):
    x = np.ones(1024, dtype=np.float32)
    # every rank is past init before two of them abort the communicator: a rank that is late
    # (4 ranks on 2 cores) would otherwise see the abort in its own init, rightly, and raise there
    comm.barrier()
    try:
        if kind == "op":
            if comm.rank == 0:
                comm.all_reduce(x)
            else:
                comm.all_gather(np.ones(1000, dtype=np.float32))
        elif kind == "count":
            comm.all_reduce(np.ones(1024 + (comm.rank == 1), dtype=np.float32))
        elif kind == "dtype":
            comm.all_reduce(np.ones(64, dtype=np.float32 if comm.rank == 0 else np.float64))
        elif kind == "root":
            comm.broadcast(x, root=comm.rank % 2)
        elif kind == "large":
            comm.all_reduce(np.ones(10**6 + comm.rank, dtype=np.float32))
        elif kind == "p2p":
            if comm.rank == 0:
                comm.send(np.ones(1000, dtype=np.float32), 1)
            elif comm.rank == 1:
                comm.recv(np.ones(1024, dtype=np.float32), 0)
            else:
                return ("skip", "", None)
        comm.barrier()  # an eager send learns of the mismatch here, from the receiver
    except tpcore.CommError as e:
        after = None
        try:
            comm.barrier()
        except tpcore.CommError as e2:
            after = str(e2)
        return (type(e).__name__, str(e), after)
    return ("no error", "", None)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind,words", [
    ("op", ["all_gather", "all_reduce", "1000", "1024", "float32"]),
    ("count", ["1024", "1025", "float32"]),
    ("dtype", ["float32", "float64"]),
    ("root", ["root 0", "root 1"]),
    ("large", ["1000001"]),
    ("p2p", ["1000", "1024", "rank 0", "rank 1", "sent", "expected"]),
])
def test_mismatch_names_both_sides(world, kind, words):
    res = run(_mismatch, world, kind, deadline=60)
    for r, (etype, msg, after) in enumerate(res):
        if etype == "skip":
            continue
        assert etype in ("CommError",), f"rank {r}: {etype} {msg}"
        if kind != "p2p" or r < 2:
            if kind == "large":
                words = [str(10**6 + r)]
            missing = [w for w in words if w not in msg]
            # a rank that learnt of the mismatch from a peer's abort sees the peer's sentence
            assert not missing or "failed:" in msg, f"rank {r}: '{msg}' lacks {missing}"
            assert "rank" in msg and ("mismatch" in msg or "failed:" in msg), msg
        assert after and ("cannot be used" in after or "failed" in after), f"rank {r}: after: {after}"


# ------------------------------------------------- failing, dying, missing ranks


def _raises(comm, path):
    if comm.rank == 1:
        time.sleep(0.2)
        raise KeyError("the cause")
    t0 = time.monotonic()
    try:
        comm.barrier()
        comm.all_reduce(np.ones(10))
    except tpcore.CommError as e:
        with open(os.path.join(path, f"rank{comm.rank}.json"), "w") as f:
            json.dump({"dt": time.monotonic() - t0, "msg": str(e), "peer": e.peer_failure}, f)
        raise


@pytest.mark.parametrize("world", [2, 4])
def test_rank_that_raises(world, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(KeyError) as info:
        run(_raises, world, str(tmp_path), deadline=60)
    assert time.monotonic() - t0 < 15
    text = str(info.value)
    assert "rank 1" in text and "the cause" in text and "Traceback" in text and "_raises" in text
    # a KeyError's str is the repr of its argument: the rank's message still reads as lines, not as
    # one escaped line with \n and \'
    assert "\n--- traceback on rank 1 ---\n" in text and "\\n" not in text and text.startswith("rank 1 raised")
    assert type(info.value).__name__ == "KeyError" and info.value.rank == 1
    assert "KeyError: rank 1 raised KeyError: 'the cause'" in "".join(
        traceback.format_exception_only(type(info.value), info.value))
    for r in range(world):
        if r == 1:
            continue
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rec["dt"] < 5, rec
        assert "rank 1" in rec["msg"] and "the cause" in rec["msg"], rec
        assert rec["peer"]


def _killed(comm, path):
    x = np.ones(1 << 20, dtype=np.float32)
    comm.all_reduce(x)  # everybody is up and running
    if comm.rank == comm.size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            comm.all_reduce(x)
    except tpcore.CommError as e:
        with open(os.path.join(path, f"rank{comm.rank}.json"), "w") as f:
            json.dump({"dt": time.monotonic() - t0, "msg": str(e)}, f)
        raise


@pytest.mark.parametrize("world", [2, 3, 4])
def test_rank_that_is_killed(world, tmp_path):
    with pytest.raises(tpcore.RankExitedError) as info:
        run(_killed, world, str(tmp_path), deadline=60)
    assert f"rank {world - 1}" in str(info.value) and "SIGKILL" in str(info.value)
    assert info.value.exitcode == -signal.SIGKILL
    for r in range(world - 1):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rec["dt"] < 5, rec
        assert f"rank {world - 1}" in rec["msg"] and ("died" in rec["msg"] or "closed" in rec["msg"]), rec


def _never_arrives(comm, path):
    comm.timeout = 1.0
    if comm.rank == 1:
        time.sleep(4)
        return "slept"
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(4))
    except tpcore.CommTimeout as e:
        assert isinstance(e, TimeoutError) and isinstance(e, tpcore.CommError)
        return {"dt": time.monotonic() - t0, "msg": str(e)}
    return "no timeout"


def test_rank_that_never_arrives():
    res = run(_never_arrives, 3, None, deadline=60)
    assert res[1] == "slept"
    for r in (0, 2):
        rec = res[r]
        assert isinstance(rec, dict), rec
        assert rec["dt"] < 4, rec
        # rank 0 waits for rank 1 itself; rank 2 may learn it from rank 0's abort
        assert "rank 1" in rec["msg"] and "timed out" in rec["msg"], rec


def test_init_timeout_names_missing_rank():
    t0 = time.monotonic()
    with pytest.raises(tpcore.CommTimeout) as info:
        tpcore._C.Comm(3, 0, "lonely_test_job", 0.5)
    assert time.monotonic() - t0 < 5
    assert "1, 2" in str(info.value) and "join" in str(info.value)


def test_init_timeout_for_a_late_creator():
    with pytest.raises(tpcore.CommTimeout) as info:
        tpcore._C.Comm(2, 1, "no_rank0_job", 0.5)
    assert "rank 0" in str(info.value)


def test_init_rejects_bad_world_and_job():
    with pytest.raises(ValueError, match="rank"):
        tpcore._C.Comm(2, 5, "job", 1.0)
    with pytest.raises(ValueError, match="job_id"):
        tpcore._C.Comm(1, 0, "bad/job", 1.0)
    with pytest.raises(ValueError, match="backend"):
        tpcore.init(backend="gloo")


def _sleeps(comm):
    time.sleep(60)


def test_spawn_deadline_stops_everything():
    t0 = time.monotonic()
    with pytest.raises(tpcore.CommTimeout) as info:
        tpcore.spawn(_sleeps, 3, deadline=1.5)
    assert time.monotonic() - t0 < 10
    assert "[0, 1, 2]" in str(info.value)


def _returns_rank(comm, k):
    return comm.rank * k, comm.size


def test_spawn_results_in_rank_order():
    assert tpcore.spawn(_returns_rank, 4, args=(10,), deadline=60) == [(0, 4), (10, 4), (20, 4), (30, 4)]


def _unpicklable(comm):
    return lambda: None


def test_spawn_unpicklable_result_is_an_error():
    with pytest.raises(TypeError, match="cannot be pickled"):
        run(_unpicklable, 2, deadline=60)


def _exits(comm):
    if comm.rank == 0:
        os._exit(7)
    comm.barrier()


def test_spawn_rank_exits_with_code():
    with pytest.raises(tpcore.RankExitedError) as info:
        run(_exits, 2, deadline=60)
    assert info.value.exitcode == 7 and "rank 0" in str(info.value)


def test_spawn_bad_arguments():
    with pytest.raises(ValueError):
        tpcore.spawn(_returns_rank, 0)
    with pytest.raises(TypeError):
        tpcore.spawn("not callable", 2)


def _two_threads(comm):
    """A communicator serves one thread at a time: a second concurrent caller
    gets a clear error instead of corrupting the first one's collective."""
    import threading
    errs = []
    if comm.rank == 0:
        t = threading.Thread(target=lambda: comm.barrier())
        t.start()
        time.sleep(0.3)  # rank 1 delays, so rank 0's thread is still inside barrier
        try:
            comm.barrier()
        except tpcore.CommError as e:
            errs.append(str(e))
        t.join()
    else:
        time.sleep(0.6)
        comm.barrier()
    return errs


def test_one_thread_at_a_time():
    res = run(_two_threads, 2, deadline=60)
    assert res[0] and "another thread" in res[0][0]
