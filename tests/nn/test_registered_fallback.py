"""Layers on a backend without registered memory: with
TPCORE_REGISTERED_MEMORY=0 the communicator declines tp_comm_mem_alloc
(TP_ERR_UNSUPPORTED) and every layer must fall back to plain device memory for
its collective buffers and give the same results: the linear layers, the MLP,
the vocab-parallel embedding and cross-entropy and the Transformer block
(forward, backward, KV-cache decode) against their references at world 2 and 3.
TPCORE_SHM_SMALL=0 sends every message down the path that counts zero-copy
calls, so that a rank can also show that none of its collectives took it."""
import numpy as np
import pytest

from conftest import run
from test_layers import FLAGS, _layer_case
from test_transformer import CONFIGS, _block_case, _cache_case
from test_vocab import _emb_case, _xent_case

PLAIN_ENV = {"TPCORE_REGISTERED_MEMORY": "0", "TPCORE_SHM_SMALL": "0"}


@pytest.fixture
def plain(monkeypatch):
    for k, v in PLAIN_ENV.items():
        monkeypatch.setenv(k, v)


def _declined(comm):
    """Whether this communicator declines registered memory (the mode the tests need)."""
    from tpcore import CommError
    try:
        comm.alloc(16)
    except CommError:  # TP_ERR_UNSUPPORTED surfaces as a CommError from Comm.alloc
        return True
    return False


def _with_zero_copy(comm, fn, *args):
    declined = _declined(comm)
    before = comm.stats()["zero_copy"]
    out = fn(comm, *args)
    return out, declined, comm.stats()["zero_copy"] - before


def _results(world, fn, *args):
    res = run(_with_zero_copy, world, fn, *args)
    for r, (_, declined, zero_copy) in enumerate(res):
        if declined:  # plain memory only: no collective may have read a peer's buffer in place
            assert zero_copy == 0, f"rank {r}: {zero_copy} zero-copy collectives without registered memory"
    return [out for out, _, _ in res]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("flags", FLAGS, ids=["plain", "gather-or-full-input"])
def test_linear_without_registered_memory(plain, world, kind, flags):
    for r, bad in enumerate(_results(world, _layer_case, kind, flags, True, True, 100 + world)):
        assert not bad, f"rank {r}: {bad}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name,uneven,masked", [("gpt2", True, True), ("llama_gqa", True, False)])
def test_block_without_registered_memory(plain, world, name, uneven, masked):
    for r, (errs, heads) in enumerate(_results(world, _block_case, name, uneven, masked)):
        assert not errs, f"rank {r} (heads {heads}): {errs}"


@pytest.mark.parametrize("world", [2, 3])
def test_kv_cache_without_registered_memory(plain, world):
    for r, (e_full, e_len, e_again, errs) in enumerate(_results(world, _cache_case, "llama_gqa")):
        assert e_full < 1e-5 and e_len < 1e-5 and e_again < 1e-5 and not errs, (r, e_full, e_len, e_again, errs)


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_without_registered_memory(plain, world):
    for r, (a, b, c, errs) in enumerate(_results(world, _emb_case, True)):
        assert a and b and c and not errs, f"rank {r}: out {a} grad {b} full {c} {errs}"
    res = _results(world, _xent_case, True, "none")
    for r, (ok_loss, ok_grad, _) in enumerate(res):
        assert ok_loss and ok_grad, f"rank {r}: loss {ok_loss} grad {ok_grad}"
    assert len({m for _, _, m in res}) == 1


def _same_numbers_case(comm):
    """One block step whose outputs are compared across the two memory modes."""
    import tpcore
    from conftest import rng_for
    cfg = tpcore.Config(vocab_size=10, **CONFIGS["llama_gqa"])
    blk = tpcore.TransformerBlock(cfg, comm, seed=9)
    g = rng_for(3, 0)
    x = g.standard_normal((2, 5, cfg.hidden)).astype(np.float32)
    y = blk(x)
    dx = blk.backward(g.standard_normal(x.shape).astype(np.float32))
    return y, dx


@pytest.mark.parametrize("world", [2, 3])
def test_plain_memory_gives_the_registered_numbers(monkeypatch, world):
    registered = run(_same_numbers_case, world)
    for k, v in PLAIN_ENV.items():
        monkeypatch.setenv(k, v)
    plain_mem = _results(world, _same_numbers_case)
    for r, ((y0, dx0), (y1, dx1)) in enumerate(zip(registered, plain_mem)):
        assert np.allclose(y0, y1, rtol=1e-6, atol=1e-6) and np.allclose(dx0, dx1, rtol=1e-6, atol=1e-6), r
