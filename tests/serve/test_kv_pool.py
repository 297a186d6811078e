"""The paged KV cache's block pool (tpcore.serve.kv_pool.BlockPool), against a simulated cache:
random admissions, growth, commits and releases, with the "KV rows" written as the tokens they
hold; every request must read back exactly its own tokens through its block table, shared
blocks are never written, and every block is accounted for."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tpcore.serve.kv_pool import BlockPool


class _Sim:
    """The pool plus a simulated cache: rows[b][i] is the token whose KV row block b holds at i."""

    def __init__(self, num_blocks, bs, caching=True):
        self.pool, self.bs = BlockPool(num_blocks, bs, caching), bs
        self.rows = [[None] * bs for _ in range(num_blocks)]
        self.reqs = {}   # rid -> [tokens, computed]

    def admit(self, rid, tokens):
        cached = self.pool.admit(rid, tokens)
        assert cached % self.bs == 0 and 0 <= cached < len(tokens)
        table = self.pool.tables[rid]
        for p in range(cached):   # the cached prefix holds exactly these tokens
            assert self.rows[table[p // self.bs]][p % self.bs] == tokens[p], (rid, p)
        self.reqs[rid] = [list(tokens), cached]
        return cached

    def compute(self, rid, n):
        toks, done = self.reqs[rid]
        if not self.pool.grow(rid, done + n):
            return False
        table = self.pool.tables[rid]
        for p in range(done, done + n):
            b = table[p // self.bs]
            assert self.pool._ref[b] == 1, f"request {rid} writes block {b} that is shared"
            self.rows[b][p % self.bs] = toks[p]
        self.reqs[rid][1] = done + n
        self.pool.commit(rid, toks, done + n)
        return True

    def check(self):
        pool = self.pool
        held = {}
        for rid, table in pool.tables.items():
            toks, done = self.reqs[rid]
            assert len(table) >= pool.blocks_for(done)
            for p in range(done):
                assert self.rows[table[p // self.bs]][p % self.bs] == toks[p]
            for b in table:
                held[b] = held.get(b, 0) + 1
        for b in range(pool.num_blocks):
            assert pool._ref[b] == held.get(b, 0), b
        assert pool.free_blocks + len(held) == pool.num_blocks
        assert not set(held) & (set(pool._free) | set(pool._lru))


def test_a_shared_prefix_is_found_and_never_written():
    s = _Sim(16, 4)
    system = list(range(100, 110))     # 10 tokens: two full blocks and a part
    assert s.admit(0, system + [1, 2, 3]) == 0
    assert s.compute(0, 13)
    assert s.admit(1, system + [7, 8]) == 8          # the two full blocks of the system prompt
    assert s.pool.tables[1][:2] == s.pool.tables[0][:2]
    assert s.compute(1, 4)
    s.check()
    s.pool.release(0)
    s.pool.release(1)
    del s.reqs[0], s.reqs[1]
    s.check()
    # released, still findable; a prompt that is all cached recomputes its last block
    assert s.admit(2, system[:8]) == 4
    assert s.pool.stats()["prefix_hit_tokens"] == 12
    s.check()


def test_growth_fails_cleanly_when_full_and_evicts_cached_blocks_first():
    s = _Sim(4, 2)
    s.admit(0, [1, 2, 3, 4, 5])
    assert s.compute(0, 5)          # 3 blocks
    s.admit(1, [9, 9, 9, 9])
    assert not s.compute(1, 4)      # needs 2, 1 left: nothing taken
    assert s.pool.free_blocks == 1 and len(s.pool.tables[1]) == 0
    s.pool.release(0)
    del s.reqs[0]
    assert s.pool.stats()["cached_blocks"] == 2 and s.pool.free_blocks == 4
    assert s.compute(1, 4)          # the two free blocks: the cached ones stay
    s.check()
    s.admit(3, [7, 7])
    assert s.compute(3, 2)          # evicts the least recently released cached block: the prefix's tail
    s.check()
    assert s.admit(2, [1, 2, 3, 4, 5]) == 2
    s.check()


def test_without_prefix_caching_nothing_is_shared():
    s = _Sim(8, 2, caching=False)
    s.admit(0, [1, 2, 3, 4, 5])
    s.compute(0, 5)
    assert s.admit(1, [1, 2, 3, 4, 5]) == 0
    s.check()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 5), st.integers(2, 24))
def test_random_traffic_keeps_every_request_its_own_tokens(seed, bs, num_blocks):
    g = np.random.default_rng(seed)
    s = _Sim(num_blocks, bs)
    prefixes = [g.integers(0, 5, int(g.integers(1, 3 * bs + 2))).tolist() for _ in range(3)]
    rid = 0
    for _ in range(40):
        op = g.integers(3)
        if op == 0 or not s.reqs:
            toks = prefixes[int(g.integers(3))] + g.integers(0, 5, int(g.integers(1, 2 * bs + 2))).tolist()
            s.admit(rid, toks)
            rid += 1
        elif op == 1:
            r = list(s.reqs)[int(g.integers(len(s.reqs)))]
            toks, done = s.reqs[r]
            if done < len(toks):
                s.compute(r, int(g.integers(1, len(toks) - done + 1)))
        else:
            r = list(s.reqs)[int(g.integers(len(s.reqs)))]
            s.pool.release(r)
            del s.reqs[r]
        s.check()
    for r in list(s.reqs):
        s.pool.release(r)
    assert s.pool.free_blocks == num_blocks and s.pool.used_blocks == 0


def test_admitting_twice_is_refused():
    p = BlockPool(4, 2)
    p.admit(3, [1, 2])
    with pytest.raises(ValueError, match="request 3 is already in the pool"):
        p.admit(3, [1, 2])
