"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-request block tables, and
prefix caching (vLLM's automatic prefix caching, llama.cpp's cache reuse).

    pool = BlockPool(num_blocks=512, block_size=16)
    cached = pool.admit(rid, tokens)        # blocks of the longest cached prefix, by reference
    pool.grow(rid, n_tokens)                # blocks for the first n_tokens of the request (False: full)
    pool.commit(rid, tokens, n_computed)    # its full, computed blocks become shareable
    pool.release(rid)                       # back to the pool (cached blocks stay findable)

Every rank holds the same pool (the engine is SPMD: every rank makes the same calls in the same
order), so the block tables agree without a message.  The model's cache holds the key/value rows
of block b at rows b * block_size ... (b + 1) * block_size - 1 of every layer.

Prefix caching: a full block that holds computed tokens gets a hash chained over every token
before it and its own (the block's whole prefix: equal hashes are equal prefixes, up to a
64-bit-per-link collision of Python's tuple hash over (parent, tokens), checked: a hit compares
the tokens too).  A new request takes the blocks of its longest cached prefix by reference
(refcount + 1) and computes the rest.  A block whose last holder leaves keeps its hash and
contents on an LRU list: it is found again until a new allocation needs it (the least recently
released first).  Only full blocks are shared, so a shared block is never written (a request
writes only at positions past its cached prefix, in blocks of its own).
"""
from __future__ import annotations

import collections
from typing import Dict, List, Optional, OrderedDict, Tuple

__all__ = ["BlockPool"]


class BlockPool:
    """Fixed-size KV blocks shared by the requests of an engine (see the module docstring).

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool (>= 1).
    block_size : int
        Token positions per block (>= 1).
    prefix_caching : bool, default True
        Share the full blocks of equal prompt prefixes.
    """

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.num_blocks, self.block_size, self.prefix_caching = int(num_blocks), int(block_size), bool(prefix_caching)
        self._free: collections.deque = collections.deque(range(self.num_blocks))  # never hashed (or forgotten)
        self._lru: OrderedDict[int, None] = collections.OrderedDict()  # refcount 0, hashed: reusable or evictable
        self._ref = [0] * self.num_blocks
        self._hash: List[Optional[int]] = [None] * self.num_blocks
        self._toks: List[Optional[Tuple[int, ...]]] = [None] * self.num_blocks
        self._by_hash: Dict[int, int] = {}
        self.tables: Dict[int, List[int]] = {}     # request id -> its blocks, in position order
        self._chains: Dict[int, List[int]] = {}    # request id -> the chained hashes of its leading full blocks
        self.hits = self.queries = 0               # prefix-cache tokens found / asked for

    # ------------------------------------------------------------------ queries
    @property
    def free_blocks(self) -> int:
        """Blocks a new allocation can take now (free, or cached and unused)."""
        return len(self._free) + len(self._lru)

    @property
    def used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.free_blocks

    def blocks_for(self, n_tokens: int) -> int:
        """Blocks that hold n_tokens positions."""
        return -(-int(n_tokens) // self.block_size)

    def _chain(self, parent: Optional[int], toks: Tuple[int, ...]) -> int:
        return hash((parent, toks))

    # ------------------------------------------------------------------ lifecycle
    def admit(self, rid: int, tokens: List[int]) -> int:
        """Start request rid's table with the blocks of its longest cached prefix (by reference).

        Parameters
        ----------
        rid : int
            The request (not in the pool yet).
        tokens : list of int
            Its tokens (the prompt, or prompt + output when it is recomputed).

        Returns
        -------
        int
            Tokens served by the cache (a multiple of block_size, < len(tokens): at least the
            last token is computed, its logits give the next token).
        """
        if rid in self.tables:
            raise ValueError(f"BlockPool.admit: request {rid} is already in the pool")
        table: List[int] = []
        chain: List[int] = []
        bs, parent = self.block_size, None
        if self.prefix_caching:
            for i in range((len(tokens) - 1) // bs):
                toks = tuple(tokens[i * bs:(i + 1) * bs])
                h = self._chain(parent, toks)
                b = self._by_hash.get(h)
                if b is None or self._toks[b] != toks:
                    break
                self._take(b)
                table.append(b)
                chain.append(h)
                parent = h
            self.queries += len(tokens)
            self.hits += len(table) * bs
        self.tables[rid] = table
        self._chains[rid] = chain
        return len(table) * bs

    def _take(self, b: int) -> None:
        if self._ref[b] == 0:
            self._lru.pop(b, None)
        self._ref[b] += 1

    def _new_block(self) -> Optional[int]:
        if self._free:
            b = self._free.popleft()
        elif self._lru:
            b, _ = self._lru.popitem(last=False)   # the least recently released cached block
            h = self._hash[b]
            if h is not None and self._by_hash.get(h) == b:
                del self._by_hash[h]
            self._hash[b] = self._toks[b] = None
        else:
            return None
        self._ref[b] = 1
        return b

    def grow(self, rid: int, n_tokens: int) -> bool:
        """Give request rid blocks for its first n_tokens positions.

        Parameters
        ----------
        rid : int
            A request in the pool.
        n_tokens : int
            Positions it must be able to hold.

        Returns
        -------
        bool
            False when the pool cannot (nothing taken then).
        """
        table = self.tables[rid]
        need = self.blocks_for(n_tokens) - len(table)
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        for _ in range(need):
            b = self._new_block()
            assert b is not None  # free_blocks counted them
            table.append(b)
        return True

    def commit(self, rid: int, tokens: List[int], n_computed: int) -> None:
        """Make request rid's full blocks among its first n_computed tokens shareable.

        Parameters
        ----------
        rid : int
            A request in the pool.
        tokens : list of int
            Its tokens (at least n_computed of them).
        n_computed : int
            Positions whose keys and values are in its blocks.
        """
        if not self.prefix_caching:
            return
        table, bs, chain = self.tables[rid], self.block_size, self._chains[rid]
        full = min(n_computed // bs, len(table))
        for i in range(len(chain), full):
            b, toks = table[i], tuple(tokens[i * bs:(i + 1) * bs])
            h = self._chain(chain[-1] if chain else None, toks)
            if self._hash[b] is None and h not in self._by_hash:  # else an equal block is cached already
                self._hash[b], self._toks[b] = h, toks
                self._by_hash[h] = b
            chain.append(h)

    def release(self, rid: int) -> None:
        """Return request rid's blocks (cached ones stay findable until reused).

        Parameters
        ----------
        rid : int
            A request in the pool (absent: nothing happens).
        """
        table = self.tables.pop(rid, None)
        self._chains.pop(rid, None)
        if table is None:
            return
        for b in reversed(table):  # the tail first: evicted before the prefix it extends
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is not None:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    def reset_cache(self) -> None:
        """Forget every cached block not held by a request."""
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            h = self._hash[b]
            if h is not None and self._by_hash.get(h) == b:
                del self._by_hash[h]
            self._hash[b] = self._toks[b] = None
            self._free.append(b)

    def stats(self) -> Dict[str, int]:
        """Blocks and prefix-cache counters.

        Returns
        -------
        dict
            num_blocks, block_size, used_blocks, cached_blocks (unused, findable), free_blocks,
            prefix_hit_tokens, prefix_query_tokens.
        """
        return dict(num_blocks=self.num_blocks, block_size=self.block_size, used_blocks=self.used_blocks,
                    cached_blocks=len(self._lru), free_blocks=self.free_blocks, prefix_hit_tokens=self.hits,
                    prefix_query_tokens=self.queries)
