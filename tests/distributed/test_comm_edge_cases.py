"""Communicator edge cases, each of which once broke:
a registered-root broadcast to ranks that no longer hold the allocation,
partially overlapping x/out, per-rank disagreement on uneven counts, path
settings that differ between ranks, close() from another thread during a call,
counts that overflow, and the staged fallback for mixed registered/private
arrays when single-copy transfers are off."""
import gc
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tpcore
from conftest import JOB_PREFIX, run


def _bcast_released(comm, count):
    buf = comm.alloc((count,), "float32")
    if comm.rank != 0:
        del buf
        gc.collect()  # this rank no longer holds the allocation
        x = np.zeros(count, np.float32)
    else:
        buf[...] = 5.0
        x = buf
    comm.broadcast(x, root=0)
    comm.barrier()
    return int(np.count_nonzero(x != 5.0))


@pytest.mark.parametrize("count", [100, 5000, 300_000])
@pytest.mark.parametrize("cma", ["0", "1"])
def test_broadcast_from_registered_root_to_private_ranks(count, cma, monkeypatch):
    monkeypatch.setenv("TPCORE_SHM_CMA", cma)
    assert run(_bcast_released, 3, count) == [0, 0, 0]


def _overlap(comm):
    errs = []
    buf = np.arange(100_000, dtype=np.float32)
    for call in (lambda: comm.all_reduce(buf[:-1], out=buf[1:]),
                 lambda: comm.all_gather(buf[:10], out=buf[5:5 + 10 * comm.size]),
                 lambda: comm._c.all_gather(buf[50:60], buf[50 - 10 * ((comm.rank + 1) % comm.size):][:10 * comm.size],
                                            None)):
        try:
            call()
            errs.append("no error")
        except ValueError as e:
            errs.append("overlap" in str(e) and "x" in str(e) and "out" in str(e))
    comm.barrier()
    return errs


def test_partially_overlapping_buffers_are_rejected():
    for r, errs in enumerate(run(_overlap, 2)):
        assert errs == [True, True, True], f"rank {r}: {errs}"


def _asym_counts(comm):
    sizes = [1, 1, 1] if comm.rank != 2 else [2, 0, 1]
    x = np.ones(sizes[comm.rank], np.float32)
    try:
        comm.all_gather(x, sizes=sizes)
        return "no error"
    except tpcore.CommError as e:
        return str(e)


def test_disagreeing_uneven_counts_fail_on_every_rank():
    for r, msg in enumerate(run(_asym_counts, 3)):
        assert msg != "no error", f"rank {r} did not see the mismatch"
        assert "counts" in msg or "failed" in msg, msg


def test_path_settings_are_taken_from_rank_0(tmp_path):
    """One rank with TPCORE_SHM_SMALL=0, the other default: both must get the sum."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import sys, numpy as np\nfrom tpcore import _C\n"
        "r, job = int(sys.argv[1]), sys.argv[2]\n"
        "c = _C.Comm(2, r, job, 20.0)\n"
        "for n in (4096, 300_000):\n"
        "    x = np.full(n, r + 1.0, np.float32)\n"
        "    c.all_reduce(x, x, 'sum')\n"
        "    assert (x == 3).all(), np.unique(x)\n"
        "c.barrier()\nc.close()\nprint('ok', r)\n")
    job = f"{JOB_PREFIX}envdiff{os.getpid()}"
    procs = [subprocess.Popen([sys.executable, str(script), str(r), job], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, TPCORE_SHM_SMALL="0" if r else "32768",
                                       TPCORE_SHM_CMA_BYTES="0" if r else "1000000000"))
             for r in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    for r, (out, err) in enumerate(outs):
        assert procs[r].returncode == 0 and f"ok {r}" in out, err


def _close_during_call(comm):
    if comm.rank == 0:
        res = []

        def waiter():
            try:
                comm.barrier()
                res.append("ok")
            except tpcore.CommError as e:
                res.append(str(e))

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.3)
        comm.close()  # while the other thread is inside barrier
        t.join(10)
        return res
    time.sleep(1.0)
    try:
        comm.barrier()  # may still complete: rank 0's thread had arrived before the close
        comm.barrier()
    except tpcore.CommError as e:
        return str(e)
    return "ok"


def test_close_from_another_thread_fails_the_call_not_the_process():
    res = run(_close_during_call, 2, timeout=10)
    assert len(res[0]) == 1 and "closed by another thread" in res[0][0], res
    assert "rank 0" in res[1], res


def test_counts_that_overflow_are_rejected():
    def fn(comm):
        x = np.ones(5, np.float32)
        out = np.empty(3, np.float32)
        try:
            comm._c.all_gather(x, out, [5, 2**63 - 1, 2**63 - 1])
        except ValueError as e:
            return str(e)
        return "no error"
    for msg in run(fn, 3):
        assert "counts" in msg, msg


def _mixed(comm, count):
    buf = comm.alloc((count,), "float64")
    x = buf if comm.rank % 2 == 0 else np.empty(count)
    x[...] = np.arange(count) * (comm.rank + 1)
    comm.all_reduce(x)
    want = np.arange(count) * sum(range(1, comm.size + 1))
    g = comm.all_gather(x[:1000] if comm.rank % 2 else buf[:1000])
    return bool(np.array_equal(x, want)) and bool(np.array_equal(g, np.tile(want[:1000], comm.size)))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mixed_registered_private_staged(world, monkeypatch):
    monkeypatch.setenv("TPCORE_SHM_CMA", "0")
    assert all(run(_mixed, world, 600_000))


def _single_copy_flag(comm):
    return comm.stats()["single_copy"]


def test_single_copy_state_is_reported(monkeypatch):
    assert run(_single_copy_flag, 1) == [False]
    monkeypatch.setenv("TPCORE_SHM_CMA", "0")
    assert run(_single_copy_flag, 2) == [False, False]
    monkeypatch.setenv("TPCORE_SHM_CMA", "1")
    flags = run(_single_copy_flag, 2)
    assert flags[0] == flags[1]  # all ranks agree, whatever this machine allows


class _OwnStr(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.code = code

    def __str__(self):
        return f"custom failure {self.code}"


def _raises_own_str(comm):
    if comm.rank == 1:
        raise _OwnStr(7)
    comm.barrier()


def test_exception_with_its_own_str_keeps_rank_and_traceback():
    with pytest.raises(_OwnStr) as info:
        run(_raises_own_str, 2)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert info.value.rank == 1 and "rank 1" in notes and "Traceback" in notes and "custom failure 7" in notes


def _rank(comm):
    return comm.rank


def test_spawn_forkserver_and_spawn_methods():
    assert tpcore.spawn(_rank, 2, start_method="forkserver", deadline=120) == [0, 1]
    assert tpcore.spawn(_rank, 2, start_method="spawn", deadline=120) == [0, 1]


# ---- an error on one rank only must never leave the others waiting

def _gen_one_rank_huge(comm):
    cfg = tpcore.Config(vocab_size=23, hidden=8, layers=1, heads=2, max_positions=16)
    model = tpcore.models.TransformerLM(cfg, comm, seed=3)
    mine = 2 ** 63 if comm.rank == 0 else 1  # past int64 on one rank only
    try:
        model.generate([[1, 2, 3]], max_new_tokens=mine)
        return "no error"
    except (TypeError, ValueError) as e:
        err = str(e)
    x = np.full(3, comm.rank + 1.0)
    comm.all_reduce(x)  # the communicator is still in step
    return err, list(x)


@pytest.mark.parametrize("world", [2, 3])
def test_generate_arguments_past_int64_on_one_rank_fail_every_rank(world):
    want = float(world * (world + 1) // 2)
    for r, res in enumerate(run(_gen_one_rank_huge, world)):
        assert res != "no error", r
        err, x = res
        assert "max_new_tokens" in err or "refused" in err, (r, err)
        assert x == [want] * 3


def _xent_offset_past_int64(comm):
    x = tpcore.VocabParallelCrossEntropy(comm)
    logits = np.random.default_rng(comm.rank).standard_normal((2, 3)).astype(np.float32)
    offset = 3 * comm.rank if comm.rank != comm.size - 1 else 2 ** 63 - 2
    try:
        x(logits, np.array([0, 1]), vocab_offset=offset)
        return "no error"
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("world", [2, 3])
def test_cross_entropy_offset_past_int64_on_one_rank_fails_every_rank(world):
    for r, err in enumerate(run(_xent_offset_past_int64, world)):
        assert err != "no error" and "vocab_offset" in err, (r, err)


def _sharded_other_partition(comm, path):
    cfg = tpcore.Config(vocab_size=19, hidden=16, layers=1, heads=4, max_positions=8)
    tpcore.models.TransformerLM(cfg, comm, partition=[2, 1, 1]).save_pretrained(path, sharded=True)
    comm.barrier()
    try:
        tpcore.models.from_pretrained(path, comm, partition=[1, 2, 1], progress=False)
        return "loaded"
    except (ValueError, tpcore.CommError) as e:
        return type(e).__name__


def test_sharded_checkpoint_of_another_partition_fails_every_rank(tmp_path):
    out = run(_sharded_other_partition, 3, str(tmp_path / "ck"))
    assert "loaded" not in out, out


def test_block_out_of_memory_message_does_not_read_the_freed_block():
    """Formatted after the block was freed (heap-use-after-free under ASan; this file runs
    under ASan+UBSan in tests/csrc/test_sanitized.py)."""
    def job(comm):
        try:
            tpcore._C.TransformerBlock(comm._c, 2 ** 29 - 1, 1024, 512, 1, 1)
        except MemoryError as e:
            return str(e)
        return "no error"
    [msg] = run(job, 1)
    assert "out of memory" in msg and "2048 x 536870911" in msg, msg


HUGE = 2 ** 61 - 1  # float32 elements: a view NumPy can make (zero strides), an output it cannot


def _unallocatable(comm, seed, case):
    """One rank (at random, after a random number of collectives) calls a collective whose new
    output it cannot allocate: a size past what an array can hold, or a MemoryError.  Its error
    and every peer's CommError name the call's number, that rank and why; at world 1 the
    communicator stays usable.  Returns the message, the call's number, the seconds it took."""
    g = np.random.default_rng(seed)
    bad, before = int(g.integers(comm.size)), int(g.integers(0, 4))
    for _ in range(before):
        comm.all_reduce(g.standard_normal(int(g.integers(1, 9))).astype(np.float32))
    seq = max([h["seq"] or 0 for h in comm.history()] + [0]) + 1  # the number the next collective gets
    me, other = comm.rank == bad, (bad + 1) % comm.size
    sizes = [2 ** int(g.choice([58, 62])) if r == other and me else 1 for r in range(comm.size)]
    view = np.broadcast_to(np.float32(1), (HUGE // comm.size * comm.size,))
    calls = {  # the C fast path (its own allocation), then the Python path (axis, sizes)
        "all_gather": lambda: comm.all_gather(view if me else np.ones(2, np.float32)),
        "reduce_scatter": lambda: comm.reduce_scatter(view if me else np.ones(comm.size, np.float32)),
        "all_gather_sizes": lambda: comm.all_gather(np.ones((2, 1), np.float32), axis=1, sizes=sizes),
    }
    t0 = time.monotonic()
    try:
        calls[case]()
        return "no error", seq, 0.0
    except (MemoryError, ValueError, tpcore.CommError) as e:
        msg, secs = f"{type(e).__name__}: {e}", time.monotonic() - t0
    if comm.size == 1:
        x = np.ones(3, np.float32)
        comm.all_reduce(x)  # still usable: nobody waited
        msg += f" | after: {x.tolist()}"
    return msg, seq, secs


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("case", ["all_gather", "reduce_scatter", "all_gather_sizes"])
def test_an_output_one_rank_cannot_allocate_fails_every_rank(world, case):
    if case == "all_gather_sizes" and world == 1:
        pytest.skip("at world 1 the sizes are x's own")
    seed = int(np.random.default_rng().integers(2 ** 31))
    res = run(_unallocatable, world, seed, case, deadline=120)
    bad = int(np.random.default_rng(seed).integers(world))
    op = "reduce_scatter" if case == "reduce_scatter" else "all_gather"
    assert len({s for _, s, _ in res}) == 1, (seed, res)
    sentence = f"{op} #{res[0][1]}: rank {bad} could not allocate its output of "
    for r, (msg, _, secs) in enumerate(res):
        if r == bad:
            assert msg.split(":")[0] in ("MemoryError", "ValueError") and sentence in msg, (seed, msg)
        else:  # in the call or entering it: the abort's sentence, promptly (not at the timeout)
            assert msg.startswith("CommError: ") and f"rank {bad} aborted the communicator: {sentence}" in msg, \
                (seed, r, msg)
            assert secs < 60, (seed, r, secs, msg)
    if world == 1:
        assert res[0][0].endswith("| after: [1.0, 1.0, 1.0]"), (seed, res)
