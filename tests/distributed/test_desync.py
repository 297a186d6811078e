"""The collective history and named desyncs: every communicator keeps a ring of its
last calls (op, dtype, count, root / peer, the collective's number, the caller's
"file.py:LINE", region, times, status), `comm.history()` returns it, a mismatch
names the first divergence across ranks on every rank ("rank 2 called all_gather(...)
at x.py:88 while ranks 0, 1, 3 called all_reduce(...) at x.py:91"), a timeout names
what the missing rank did last, and each rank prints its ring when that happens.
Per-region statistics: the layers tag their collectives, and the counts and bytes of
a transformer's decode step and training step are what its architecture implies."""
import os
import sys
import time

import numpy as np
import pytest

import tpcore
from conftest import WORLDS, rng_for, run
from tpcore.models.lm import Config, TransformerLM

ME = os.path.basename(__file__)


def _here() -> int:
    """The line number of the caller's line (a call on the same line has this site)."""
    return sys._getframe(1).f_lineno


def _site(line: int) -> str:
    return f"{ME}:{line}"


# ------------------------------------------------------------------- the ring


def _sequence(comm):
    r, n = comm.rank, comm.size
    rng = rng_for(5, r)
    lines, out = [], {}
    x = rng.standard_normal(7).astype(np.float32)
    comm.all_reduce(x); lines.append(_here())  # noqa: E702 (the call and its _here() line number on one line)
    out["all_reduce"] = x
    g = comm.all_gather(np.full(3, r + 1, np.int32)); lines.append(_here())  # noqa: E702 (the call and its _here() line number on one line)
    out["all_gather"] = g
    b = np.full(4, float(r), np.float64)
    comm.broadcast(b, root=n - 1); lines.append(_here())  # noqa: E702 (the call and its _here() line number on one line)
    out["broadcast"] = b
    comm.reduce(rng.standard_normal(5), root=0, op="max"); lines.append(_here())  # noqa: E702 (the call and its _here() line number on one line)
    comm.barrier(); lines.append(_here())  # noqa: E702 (the call and its _here() line number on one line)
    comm.reduce_scatter(np.arange(2 * n, dtype=np.float32) + r, op="min"); lines.append(_here())  # noqa: E702 (the call and its _here() line number on one line)
    if n > 1:
        if r == 0:
            comm.send(np.ones(6, np.int64), 1); lines.append(_here())  # noqa: E702 (the call and its _here() line number on one line)
        elif r == 1:
            comm.recv(np.empty(6, np.int64), 0); lines.append(_here())  # noqa: E702 (the call and its _here() line number on one line)
    return comm.history(), lines, out, comm.stats(), time.monotonic()


@pytest.mark.parametrize("world", WORLDS)
def test_ring_holds_the_calls_in_order(world):
    res = run(_sequence, world)
    refs = [rng_for(5, r).standard_normal(7).astype(np.float32).astype(np.float64) for r in range(world)]
    for r, (hist, lines, out, stats, t_end) in enumerate(res):
        np.testing.assert_allclose(out["all_reduce"], np.sum(refs, axis=0), rtol=1e-5, atol=1e-5)
        assert out["all_gather"].tolist() == [p + 1 for p in range(world) for _ in range(3)]
        assert out["broadcast"].tolist() == [float(world - 1)] * 4
        expect = [
            dict(seq=1, op="all_reduce", redop="sum", dtype="float32", count=7, root=None, peer=None),
            dict(seq=2, op="all_gather", redop=None, dtype="int32", count=3, root=None, peer=None),
            dict(seq=3, op="broadcast", redop=None, dtype="float64", count=4, root=world - 1, peer=None),
            dict(seq=4, op="reduce", redop="max", dtype="float64", count=5, root=0, peer=None),
            dict(seq=5, op="barrier", redop=None, dtype=None, count=0, root=None, peer=None),
            dict(seq=6, op="reduce_scatter", redop="min", dtype="float32", count=2, root=None, peer=None),
        ]
        if world > 1 and r == 0:
            expect.append(dict(seq=None, op="send", redop=None, dtype="int64", count=6, root=None, peer=1))
        if world > 1 and r == 1:
            expect.append(dict(seq=None, op="recv", redop=None, dtype="int64", count=6, root=None, peer=0))
        assert len(hist) == len(expect), (r, hist)
        for e, want, line in zip(hist, expect, lines):
            got = {k: e[k] for k in want}
            assert got == want, (r, e)
            assert e["site"] == _site(line), (r, e)
            assert e["status"] == "ok" and e["region"] == "other", e
            assert e["seconds"] is not None and 0 <= e["seconds"] < 30, e
        starts = [e["start"] for e in hist]
        assert starts == sorted(starts) and starts[-1] <= t_end
        # the statistics count the same calls
        assert stats["calls"] == len(expect) and stats["regions"] == {"other": stats["regions"]["other"]}
        assert stats["regions"]["other"]["calls"] == stats["calls"]


def _barriers(comm, k):
    for _ in range(k):
        comm.barrier()
    sub = comm.split(comm.rank % 2)
    return comm.history(), comm.stats()["calls"], sub.history() if sub is not None else None


def test_ring_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("TPCORE_HISTORY", "5")
    for hist, calls, _ in run(_barriers, 2, 9):
        assert calls == 10
        assert [e["seq"] for e in hist] == [6, 7, 8, 9, 10]
        assert [e["op"] for e in hist] == ["barrier"] * 4 + ["split"]
    monkeypatch.setenv("TPCORE_HISTORY", "0")
    for hist, calls, sub in run(_barriers, 3, 4):
        assert hist == [] and sub == [] and calls == 5  # off: nothing kept, statistics as before


@pytest.mark.parametrize("bad", ["-1", "abc", "12x", str(2 ** 21)])
def test_ring_size_must_be_valid(monkeypatch, bad):
    monkeypatch.setenv("TPCORE_HISTORY", bad)
    with pytest.raises(ValueError, match="TPCORE_HISTORY") as info:
        tpcore._C.Comm(1, 0, "desync_bad_env", 1.0)
    assert bad in str(info.value)


def _split_history(comm):
    comm.barrier(); l1 = _here()  # noqa: E702 (the call and its _here() line number on one line)
    sub = comm.split(comm.rank % 2, key=-comm.rank); l2 = _here()  # noqa: E702 (the call and its _here() line number on one line)
    x = np.ones(3, np.float32)
    sub.all_reduce(x); l3 = _here()  # noqa: E702 (the call and its _here() line number on one line)
    sub.barrier(); l4 = _here()  # noqa: E702 (the call and its _here() line number on one line)
    return comm.history(), sub.history(), (l1, l2, l3, l4), sub.rank, sub.size, x


def test_history_after_split():
    res = run(_split_history, 4)
    for r, (parent, child, (l1, l2, l3, l4), srank, ssize, x) in enumerate(res):
        assert [(e["seq"], e["op"], e["site"]) for e in parent] == [(1, "barrier", _site(l1)), (2, "split", _site(l2))]
        assert srank == (1 if r < 2 else 0) and ssize == 2 and x.tolist() == [2.0] * 3
        assert [(e["seq"], e["op"], e["count"], e["site"]) for e in child] == \
            [(1, "all_reduce", 3, _site(l3)), (2, "barrier", 0, _site(l4))]


# ------------------------------------------------------------------ desyncs


def _capture_stderr(path):
    """fd 2 into a file from now on (the ring is printed by C)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.close(fd)


def _desync(comm, tmp, odd):
    _capture_stderr(os.path.join(tmp, f"err{comm.rank}.txt"))
    comm.timeout = 20
    comm.barrier(); lb = _here()  # noqa: E702 (the call and its _here() line number on one line)
    lg, lr = _here() + 4, _here() + 6  # the lines of the two calls
    try:
        if comm.rank == odd:
            import ml_dtypes
            comm.all_gather(np.ones(4096, ml_dtypes.bfloat16))
        else:
            comm.all_reduce(np.ones(4096, np.float32))
        return ("no error", None, None, (lb, lg, lr))
    except tpcore.CommError as e:
        return (type(e).__name__, str(e), comm.history(), (lb, lg, lr))


@pytest.mark.parametrize("world,odd", [(2, 1), (3, 2), (4, 2), (4, 0)])
def test_desync_is_named_on_every_rank(world, odd, tmp_path):
    pytest.importorskip("ml_dtypes")
    res = run(_desync, world, str(tmp_path), odd)
    lb, lg, lr = res[0][3]
    src = open(__file__).read().splitlines()
    assert "comm.all_gather(np.ones(4096" in src[lg - 1] and "comm.all_reduce(np.ones(4096" in src[lr - 1]
    others = [p for p in range(world) if p != odd]
    rest = f"rank {others[0]}" if len(others) == 1 else "ranks " + ", ".join(map(str, others))
    line = (f"rank {odd} called all_gather(4096 bfloat16) at {ME}:{lg} while {rest} called "
            f"all_reduce(sum, 4096 float32) at {ME}:{lr}")
    if world == 2 and odd == 0:  # a tie names the group without rank 0 first
        line = f"rank 1 called all_reduce(sum, 4096 float32) at {ME}:{lr} while rank 0 called " \
               f"all_gather(4096 bfloat16) at {ME}:{lg}"
    for r, (etype, msg, hist, _) in enumerate(res):
        assert etype == "CommError", (r, etype, msg)
        assert "collective mismatch at #2" in msg and line in msg, (r, msg)
        assert [(e["seq"], e["site"], e["status"]) for e in hist] == \
            [(1, _site(lb), "ok"), (2, _site(lg if r == odd else lr), "collective mismatch")], (r, hist)
        err = (tmp_path / f"err{r}.txt").read_text()
        assert f"rank {r} of {world}: the communicator failed (collective mismatch)" in err, err
        mine = "all_gather(4096 bfloat16)" if r == odd else "all_reduce(sum, 4096 float32)"
        rows = [ln for ln in err.splitlines() if ln.startswith("tpcore:  ")]
        assert len(rows) == 3 and "barrier" in rows[1] and _site(lb) in rows[1], err  # header, #1, #2
        assert mine in rows[2] and _site(lg if r == odd else lr) in rows[2] and "mismatch" in rows[2], err


def _uneven_counts(comm):
    mine = 3 + comm.rank  # rank 1 says it has 4 elements, rank 0 thinks rank 1 has 5
    line = _here() + 2
    try:
        comm.all_gather(np.ones(mine, np.float32), sizes=[3, 4] if comm.rank == 1 else [3, 5])
    except tpcore.CommError as e:
        return str(e), line
    return "no error", line


def test_different_per_rank_counts_are_said_so_with_the_sites():
    for msg, line in run(_uneven_counts, 2):
        # the rank that saw it first says so; the other gets its sentence ("rank 0 failed: ...")
        assert "passed different per-rank counts to all_gather" in msg, msg
        assert f"rank 1 at {ME}:{line}" in msg and f"rank 0 at {ME}:{line}" in msg, msg


def _never_arrives(comm, tmp):
    _capture_stderr(os.path.join(tmp, f"err{comm.rank}.txt"))
    comm.timeout = 1.0
    comm.barrier(); lb = _here()  # noqa: E702 (the call and its _here() line number on one line)
    x = np.ones(4, np.float32)
    t0 = time.monotonic()
    if comm.rank == 1:
        time.sleep(3.0)
    la = _here() + 2
    try:
        comm.all_reduce(x)
        return ("no error", None, None, (lb, la))
    except tpcore.CommError as e:
        return (type(e).__name__, str(e), time.monotonic() - t0, (lb, la))


def test_rank_that_never_arrives_is_named_with_its_last_call(tmp_path):
    res = run(_never_arrives, 3, str(tmp_path), deadline=60)
    for r, (etype, msg, dt, (lb, la)) in enumerate(res):
        assert etype == "CommTimeout", (r, etype, msg)
        want = (f"rank 1 never arrived at #2 all_reduce(sum, 4 float32) at {ME}:{la}: its last collective was "
                f"#1 barrier at {ME}:{lb}, ")
        assert want in msg and " s ago" in msg, (r, msg)
        if r != 1:
            assert dt < 2.9, (r, dt)
        err = (tmp_path / f"err{r}.txt").read_text()
        assert "the communicator failed (timeout)" in err and _site(lb) in err, (r, err)


def _waits_in_recv(comm):
    comm.timeout = 1.0 if comm.rank == 0 else 10.0  # rank 0 times out first
    comm.barrier()
    try:
        if comm.rank == 0:
            comm.barrier()
        elif comm.rank == 1:
            comm.recv(np.empty(3, np.float32), 2)
        else:
            time.sleep(2.5)
            return None
    except tpcore.CommError as e:
        return str(e)
    return "no error"


def test_timeout_names_what_a_busy_peer_does():
    res = run(_waits_in_recv, 3, deadline=60)
    assert "timed out" in res[0] and "rank 1 is in recv with peer 2 (its last collective was #1)" in res[0], res[0]
    assert "rank 0 failed" in res[1] and "rank 1 is in recv with peer 2" in res[1], res[1]  # rank 0's abort


# ------------------------------------------------------------------ regions


def _model_regions(comm, cfg_kw, B, T0):
    cfg = Config(**cfg_kw)
    m = TransformerLM(cfg, comm, seed=3)
    m.cache(B, T0 + 4)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, cfg.vocab_size, (B, T0))
    m.forward(prompt, use_cache=True)  # the prefill (registered buffers are allocated here)
    before = comm.stats()
    nxt = rng.integers(0, cfg.vocab_size, (B, 1))
    h = m.forward(nxt, pos0=np.full(B, T0), use_cache=True); line = _here()  # noqa: E702 (the call and its _here() line number on one line)
    logits = m.gather_logits(m.logits_shard(h.reshape(B, cfg.hidden)))
    after = comm.stats()
    # the layers' collectives (issued in C) carry the line that called the model
    inside = [e for e in comm.history() if e["region"] in ("embedding", "attention", "mlp")][-(2 * cfg.layers + 1):]
    assert [e["site"] for e in inside] == [_site(line)] * (2 * cfg.layers + 1), inside
    assert [e["region"] for e in inside] == ["embedding"] + ["attention", "mlp"] * cfg.layers, inside
    assert all(e["op"] == "all_reduce" and e["count"] == B * cfg.hidden for e in inside), inside
    # a training step: loss (forward + cross-entropy) and backward; the second one is measured
    # (the first allocates the head's and the layers' backward buffers: collective allocs)
    targets = rng.integers(0, cfg.vocab_size, (B, T0))
    m.loss(prompt, targets)
    m.backward()
    warm = comm.stats()
    m.loss(prompt, targets)
    m.backward()
    trained = comm.stats()
    return before, after, warm, trained, logits.shape


def _delta(a, b):
    return {k: {f: b["regions"][k][f] - a["regions"].get(k, {f: 0})[f] for f in ("calls", "bytes", "seconds")}
            for k in b["regions"]}


@pytest.mark.parametrize("tie", [True, False])
def test_region_statistics_of_a_transformer(tie):
    cfg_kw = dict(vocab_size=37, hidden=16, layers=3, heads=4, max_positions=32, tie_embeddings=tie)
    B, T0, V, C, L = 2, 5, 37, 16, 3
    for before, after, warm, trained, shape in run(_model_regions, 2, cfg_kw, B, T0):
        assert shape == (B, V)
        f4 = 4  # float32 bytes
        d = _delta(before, after)
        M = B  # one decode step: B rows
        assert d["embedding"]["calls"] == 1 and d["embedding"]["bytes"] == M * C * f4, d
        assert d["attention"]["calls"] == L and d["attention"]["bytes"] == L * M * C * f4, d
        assert d["mlp"]["calls"] == L and d["mlp"]["bytes"] == L * M * C * f4, d
        assert d["head"]["calls"] == 1 and d["head"]["bytes"] == M * V * f4, d  # the logits' all-gather
        # the rest ("other": the ranks agreeing on their decode arguments) and the totals
        assert sum(v["calls"] for v in d.values()) == after["calls"] - before["calls"]
        assert sum(v["bytes"] for v in d.values()) == after["bytes"] - before["bytes"]
        # a training step of M = B * T0 rows: forward and backward per block, the cross-entropy's
        # two all-reduces ((M + 2n + 2) and 2M floats) and the head's input gradient (M x C)
        t = _delta(warm, trained)
        M, n = B * T0, 2
        assert t["embedding"]["calls"] == 1 and t["embedding"]["bytes"] == M * C * f4, t
        assert t["attention"]["calls"] == 2 * L and t["attention"]["bytes"] == 2 * L * M * C * f4, t
        assert t["mlp"]["calls"] == 2 * L and t["mlp"]["bytes"] == 2 * L * M * C * f4, t
        assert t["head"]["calls"] == 3, t
        assert t["head"]["bytes"] == ((M + 2 * n + 2) + 2 * M + M * C) * f4, t
        assert sum(v["calls"] for v in t.values()) == trained["calls"] - warm["calls"]
        for s in (after, trained):
            total = sum(v["seconds"] for v in s["regions"].values())
            assert abs(total - s["seconds"]) <= 1e-9 * max(1.0, s["seconds"]), s
            assert all(v["seconds"] >= 0 for v in s["regions"].values())


def _user_regions(comm):
    x = np.ones(8, np.float32)
    with comm._region("head"):
        comm.all_reduce(x)
        with comm._region("mine"):
            comm.all_reduce(x)
        comm.all_reduce(x)
    comm.all_reduce(x)
    lin = tpcore.ColumnParallelLinear(6, 4 * comm.size, comm, seed=1)  # a layer used alone: "other"
    before = comm.stats()["regions"]["other"]["calls"]
    y = lin.forward(np.ones((3, 6), np.float32))
    lin.backward(np.ones_like(y))
    st = comm.stats()["regions"]
    return st, st["other"]["calls"] - before, [e["region"] for e in comm.history()[:4]]


def test_regions_from_python_and_a_layer_used_alone():
    for st, lin_calls, regions in run(_user_regions, 2):
        assert regions == ["head", "mine", "head", "other"]
        assert st["head"]["calls"] == 2 and st["mine"]["calls"] == 1
        assert lin_calls >= 1 and set(st) == {"other", "head", "mine"}
