"""Every collective x dtype x world size 1-4 x sizes, in place and out of
place, against references computed here in float64 / exact integers from the
ranks' regenerated random inputs."""
import hashlib

import numpy as np
import pytest

from conftest import DLPackOnly, DTYPES, WORLDS, make_input, mismatches, np_dtype, reference, rng_for, run

OPS = ["sum", "prod", "min", "max", "avg"]
# 0, 1, small primes, around the one-round threshold (32 KiB), and a few MiB past the 1 MiB chunk.
SIZES = [0, 1, 2, 7, 13, 997, 8191, 16411, 65537]
BIG = 1_310_719  # prime; 5 MiB of float32, several chunks


def _all_reduce_case(comm, dtype, sizes, ops, seed):
    bad = []
    digests = []
    n = comm.size
    for op in ops:
        for count in sizes:
            ins = [make_input(dtype, op, seed + count, r, (count,)) for r in range(n)]
            ref = reference(dtype, op, ins)
            x = ins[comm.rank].copy()
            out = np.empty_like(x)
            comm.all_reduce(x, op=op, out=out)
            assert np.array_equal(x, ins[comm.rank]), "out-of-place all_reduce changed its input"
            m1 = mismatches(dtype, out, ref)
            comm.all_reduce(x, op=op)  # in place
            m2 = mismatches(dtype, x, ref)
            if m1 or m2:
                bad.append((op, count, m1, m2))
            if not np.array_equal(x.view(np.uint8), out.view(np.uint8)):
                bad.append((op, count, "in-place and out-of-place differ"))
            digests.append(hashlib.sha1(x.tobytes()).hexdigest())
    return bad, digests


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce(world, dtype):
    np_dtype(dtype)
    res = run(_all_reduce_case, world, dtype, SIZES, OPS, 11)
    for r, (bad, _) in enumerate(res):
        assert not bad, f"rank {r}: (op, count, wrong out-of-place, wrong in-place): {bad}"
    # NCCL's guarantee: every rank holds the same bits.
    assert all(d == res[0][1] for _, d in res)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "float64"])
def test_all_reduce_large(world, dtype):
    np_dtype(dtype)
    res = run(_all_reduce_case, world, dtype, [BIG], ["sum", "max"], 12)
    for r, (bad, _) in enumerate(res):
        assert not bad, f"rank {r}: {bad}"
    assert all(d == res[0][1] for _, d in res)


def _gather_case(comm, dtype, seed):
    n, r = comm.size, comm.rank
    bad = []
    for rows in (0, 1, 5, 4099, 300_007):
        parts = [make_input(dtype, "sum", seed + rows, p, (rows, 3)) for p in range(n)]
        got = comm.all_gather(parts[r])
        if not np.array_equal(got, np.concatenate(parts, axis=0)):
            bad.append(("axis0", rows))
        cols = [make_input(dtype, "sum", seed + rows + 1, p, (3, rows)) for p in range(n)]
        got = comm.all_gather(cols[r], axis=1)
        if not np.array_equal(got, np.concatenate(cols, axis=1)):
            bad.append(("axis1", rows))
        # uneven: rank p holds rows + 2p rows
        sizes = [rows + 2 * p for p in range(n)]
        up = [make_input(dtype, "sum", seed + rows + 2, p, (sizes[p], 2)) for p in range(n)]
        got = comm.all_gather(up[r], sizes=sizes)
        if not np.array_equal(got, np.concatenate(up, axis=0)):
            bad.append(("uneven", rows))
        out = np.empty((sum(sizes), 2), dtype=up[r].dtype)
        res = comm.all_gather(up[r], sizes=sizes, out=out)
        if res is not out or not np.array_equal(out, np.concatenate(up, axis=0)):
            bad.append(("out", rows))
    return bad


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8", "int64", "bfloat16"])
def test_all_gather(world, dtype):
    np_dtype(dtype)
    for r, bad in enumerate(run(_gather_case, world, dtype, 21)):
        assert not bad, f"rank {r}: {bad}"


def _scatter_case(comm, dtype, ops, seed):
    n, r = comm.size, comm.rank
    bad = []
    for op in ops:
        for per in (0, 1, 3, 1031, 200_003):
            full = [make_input(dtype, op, seed + per, p, (per * n, 2)) for p in range(n)]
            ref = reference(dtype, op, full)
            got = comm.reduce_scatter(full[r], op=op)
            if got.shape != (per, 2) or mismatches(dtype, got, ref[r * per:(r + 1) * per]):
                bad.append((op, per, "axis0"))
            # along axis 1
            fullt = [np.ascontiguousarray(f.T) for f in full]
            got = comm.reduce_scatter(fullt[r], op=op, axis=1)
            if got.shape != (2, per) or mismatches(dtype, got, ref.T[:, r * per:(r + 1) * per]):
                bad.append((op, per, "axis1"))
            # uneven blocks
            sizes = [per + p for p in range(n)]
            tot = sum(sizes)
            uf = [make_input(dtype, op, seed + per + 7, p, (tot,)) for p in range(n)]
            uref = reference(dtype, op, uf)
            lo = sum(sizes[:r])
            got = comm.reduce_scatter(uf[r], op=op, sizes=sizes)
            if got.shape != (sizes[r],) or mismatches(dtype, got, uref[lo:lo + sizes[r]]):
                bad.append((op, per, "uneven"))
    return bad


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "int32", "uint8"])
def test_reduce_scatter(world, dtype):
    np_dtype(dtype)
    ops = ["sum", "max", "avg"] if dtype != "uint8" else ["sum", "min", "prod"]
    for r, bad in enumerate(run(_scatter_case, world, dtype, ops, 31)):
        assert not bad, f"rank {r}: {bad}"


def _bcast_reduce_case(comm, dtype, seed):
    n, r = comm.size, comm.rank
    bad = []
    for count in (0, 1, 17, 40_000, 1_000_003):
        for root in range(n):
            ins = [make_input(dtype, "sum", seed + count + root, p, (count,)) for p in range(n)]
            x = ins[r].copy()
            comm.broadcast(x, root=root)
            if not np.array_equal(x, ins[root]):
                bad.append(("broadcast", count, root))
            out = np.empty_like(x)
            comm.broadcast(ins[r], root=root, out=out)
            if not np.array_equal(out, ins[root]):
                bad.append(("broadcast out", count, root))
            for op in ("sum", "min"):
                x = ins[r].copy()
                comm.reduce(x, root=root, op=op)
                ref = reference(dtype, op, ins)
                if r == root and mismatches(dtype, x, ref):
                    bad.append(("reduce", op, count, root))
                if r != root and not np.array_equal(x, ins[r]):
                    bad.append(("reduce changed a non-root input", count, root))
    return bad


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["float32", "int64", "float16"])
def test_broadcast_and_reduce(world, dtype):
    for r, bad in enumerate(run(_bcast_reduce_case, world, dtype, 41)):
        assert not bad, f"rank {r}: {bad}"


def _p2p_case(comm, seed):
    n, r = comm.size, comm.rank
    bad = []
    for count in (0, 1, 1000, 300_001):  # the last is past the eager size
        mine = rng_for(seed + count, r).standard_normal(count)
        prev = rng_for(seed + count, (r - 1) % n).standard_normal(count)
        got = np.empty(count)
        comm.sendrecv(mine, (r + 1) % n, got, (r - 1) % n)
        if not np.array_equal(got, prev):
            bad.append(("ring", count))
        if n > 1:
            # ordered pairs: even ranks send first, odd ranks receive first
            peer = r ^ 1
            if peer < n:
                x = rng_for(seed + count + 1, r).integers(-5, 5, count).astype(np.int32)
                want = rng_for(seed + count + 1, peer).integers(-5, 5, count).astype(np.int32)
                y = np.empty(count, dtype=np.int32)
                if r % 2 == 0:
                    comm.send(x, peer)
                    comm.recv(y, peer)
                else:
                    comm.recv(y, peer)
                    comm.send(x, peer)
                if not np.array_equal(y, want):
                    bad.append(("pair", count))
    return bad


@pytest.mark.parametrize("world", WORLDS)
def test_send_recv_ring(world):
    for r, bad in enumerate(run(_p2p_case, world, 51)):
        assert not bad, f"rank {r}: {bad}"


def _split_case(comm):
    n, r = comm.size, comm.rank
    out = {}
    sub = comm.split(r % 2, key=-r)  # reversed order inside each group
    members = [p for p in range(n) if p % 2 == r % 2]
    out["size_ok"] = sub.size == len(members)
    out["rank_ok"] = sub.rank == sorted(members, reverse=True).index(r)
    x = np.array([float(r)])
    sub.all_reduce(x)
    out["sum_ok"] = x[0] == sum(members)
    g = sub.all_gather(np.array([r]))
    out["order_ok"] = list(g) == sorted(members, reverse=True)
    # nested split of the sub-communicator, and collectives on parent and child interleaved
    sub2 = sub.split(0)
    y = np.array([1])
    comm.all_reduce(y)
    out["parent_ok"] = y[0] == n
    sub2.all_reduce(y)
    out["nested_ok"] = y[0] == n * sub2.size
    none = comm.split(None if r else 0)
    out["nocolor_ok"] = (none is None) == (r != 0)
    for c in (sub2, sub, none):
        if c is not None:
            c.close()
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_split(world):
    for r, res in enumerate(run(_split_case, world)):
        assert all(res.values()), f"rank {r}: {res}"


def _registered_case(comm, seed):
    n, r = comm.size, comm.rank
    bad = []
    count = 1_000_003
    buf = comm.alloc((count,), "float32")
    assert buf.flags.writeable and buf.flags.c_contiguous and not buf.any()
    ins = [make_input("float32", "sum", seed, p, (count,)) for p in range(n)]
    ref = reference("float32", "sum", ins)
    before = comm.stats()["zero_copy"]
    buf[...] = ins[r]
    comm.all_reduce(buf)
    if mismatches("float32", buf, ref):
        bad.append("all_reduce in place")
    out = comm.alloc((count,), "float32")
    buf[...] = ins[r]
    comm.all_reduce(buf, out=out)
    if mismatches("float32", out, ref) or not np.array_equal(buf, ins[r]):
        bad.append("all_reduce out of place")
    # all_gather with the input in place in the output
    per = 100_003
    g = comm.alloc((n, per), "float64")
    parts = [rng_for(seed + 1, p).standard_normal(per) for p in range(n)]
    g[r] = parts[r]
    comm.all_gather(g[r], out=g.reshape(-1))
    if not np.array_equal(g, np.stack(parts)):
        bad.append("all_gather")
    # reduce_scatter and broadcast from registered arrays
    rs_in = comm.alloc((n * per,), "float64")
    full = [rng_for(seed + 2, p).standard_normal(n * per) for p in range(n)]
    rs_in[...] = full[r]
    got = comm.reduce_scatter(rs_in)
    if mismatches("float64", got, np.sum(full, axis=0)[r * per:(r + 1) * per]):
        bad.append("reduce_scatter")
    b = comm.alloc((per,), "float64")
    b[...] = parts[r]
    comm.broadcast(b, root=n - 1)
    if not np.array_equal(b, parts[n - 1]):
        bad.append("broadcast")
    used = comm.stats()["zero_copy"] - before
    if n > 1 and used < 5:
        bad.append(f"registered path taken only {used} times")
    # Mixed: only some ranks pass registered arrays -> still right (staged path).
    x = buf if r % 2 == 0 else ins[r].copy()
    x[...] = ins[r]
    comm.all_reduce(x)
    if mismatches("float32", x, ref):
        bad.append("mixed registered / private")
    return bad


@pytest.mark.parametrize("world", WORLDS)
def test_registered_memory(world):
    for r, bad in enumerate(run(_registered_case, world, 61)):
        assert not bad, f"rank {r}: {bad}"


def _dlpack_case(comm):
    base = np.arange(10, dtype=np.float32) * (comm.rank + 1)
    t = DLPackOnly(base)
    res = comm.all_reduce(t)
    ok = res is t and np.allclose(base, np.arange(10) * sum(range(1, comm.size + 1)))
    g = comm.all_gather(DLPackOnly(np.full(3, comm.rank, dtype=np.int64)))
    return ok and list(g) == [p for p in range(comm.size) for _ in range(3)]


@pytest.mark.parametrize("world", [1, 3])
def test_dlpack_inputs(world):
    assert all(run(_dlpack_case, world))


def _torch_case(comm):
    import torch
    t = torch.arange(6, dtype=torch.float32) + comm.rank
    comm.all_reduce(t)  # in place on the torch tensor's memory
    return t.tolist()


def test_torch_tensors_in_place():
    pytest.importorskip("torch")
    res = run(_torch_case, 2)
    assert res[0] == res[1] == [float(2 * i + 1) for i in range(6)]


def _scalar_and_shapes(comm):
    s = np.float64(comm.rank + 1)
    g = comm.all_gather(np.array(s))
    x = np.ones((2, 3, 4), dtype=np.float32)
    comm.all_reduce(x, op="avg")
    return list(g), x.shape, float(x.sum())


def test_shapes_kept_and_scalars():
    for g, shape, s in run(_scalar_and_shapes, 3):
        assert g == [1.0, 2.0, 3.0] and shape == (2, 3, 4) and s == 24.0


@pytest.mark.parametrize("path", ["single-copy", "staged"])
@pytest.mark.parametrize("world", [2, 3])
def test_both_private_paths(world, path, monkeypatch):
    """Large private arrays go through the kernel's single-copy transfer when
    the ranks may read each other's memory, else through staging; sizes pick
    one by default, so force each everywhere."""
    if path == "single-copy":
        monkeypatch.setenv("TPCORE_SHM_CMA_BYTES", "0")
    else:
        monkeypatch.setenv("TPCORE_SHM_CMA", "0")
    for r, (bad, _) in enumerate(run(_all_reduce_case, world, "float32", [1, 997, 65537, 300_007],
                                     ["sum", "max"], 71)):
        assert not bad, f"rank {r}: {bad}"
    for r, bad in enumerate(run(_gather_case, world, "int32", 72)):
        assert not bad, f"rank {r}: {bad}"
    for r, bad in enumerate(run(_scatter_case, world, "float64", ["sum"], 73)):
        assert not bad, f"rank {r}: {bad}"
    for r, bad in enumerate(run(_bcast_reduce_case, world, "float32", 74)):
        assert not bad, f"rank {r}: {bad}"
