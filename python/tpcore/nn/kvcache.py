"""The KV cache's per-forward arguments, checked: each sequence's first position (pos0), the cache
sequence of each batch row (slots, continuous batching over a cache of sequences) and the block
table of a paged cache (`TransformerBlock.cache_paged`: a pool of fixed-size blocks, row b's
position p in block ``block_table[b, p // block_size]`` at row ``p % block_size``)."""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from tpcore.utils.args import minmax
from tpcore.utils.arrays import int_array


def positions(pos0, B: int, who: str) -> np.ndarray:
    """pos0 as B non-negative int64 positions (an integer applies to every sequence)."""
    p = int_array(pos0, who, "pos0")
    if p.ndim == 0:
        p = np.full(B, int(p), np.int64)
    if p.shape != (B,):
        raise ValueError(f"{who}: pos0 must have one position per sequence, shape ({B},), got shape {p.shape}")
    if B and minmax(p)[0] < 0:
        raise ValueError(f"{who}: pos0 must be >= 0, got {int(p.min())} (sequence {int(np.argmin(p))})")
    return p


def slot_array(slots, B: int, cache_batch: Optional[int], use_cache, who: str) -> np.ndarray:
    """slots as B distinct int64 KV-cache sequences in [0, cache_batch) (None: no cache yet), for a
    forward with use_cache; a ValueError / TypeError naming the first bad entry otherwise."""
    if use_cache is not True and not (isinstance(use_cache, np.bool_) and use_cache):
        raise ValueError(f"{who}: slots map batch rows to KV-cache sequences: they need use_cache=True")
    if cache_batch is None:
        raise ValueError(f"{who}: slots need a KV cache: call cache(batch, max_len) first")
    s = int_array(slots, who, "slots")
    if s.shape != (B,):
        raise ValueError(f"{who}: slots must have one cache sequence per batch row, shape ({B},), got shape "
                         f"{s.shape}")
    if not B:
        return s
    lo, hi = minmax(s)
    if lo < 0 or hi >= cache_batch:
        b = int(np.argmax((s < 0) | (s >= cache_batch)))
        raise ValueError(f"{who}: slots[{b}] = {int(s[b])} is outside the KV cache's {cache_batch} sequences "
                         f"[0, {cache_batch})")
    if len(set(s.tolist())) != B:
        first = {}
        for b, v in enumerate(s.tolist()):
            if v in first:
                raise ValueError(f"{who}: slots[{first[v]}] and slots[{b}] are both {v}: two batch rows would "
                                 f"write one KV-cache sequence")
            first[v] = b
    return s


def block_table_array(block_table, B: int, T: int, pos0: Optional[np.ndarray], paged: Optional[Tuple[int, int]],
                      use_cache, slots, who: str) -> Optional[np.ndarray]:
    """The block table of a forward over a paged KV cache (None without one): int64 (B, cols),
    cols >= 1, each entry < 0 (no block: nothing written there, keys there never read) or a
    block of the pool [0, num_blocks); a row with a block (not all < 0: padding) covers its
    positions, cols x block_size >= pos0[b] + T.  paged: the cache's (num_blocks, block_size),
    None when it is not paged.  A ValueError / TypeError naming the first bad entry otherwise,
    or block_table missing where the paged cache needs one (use_cache), or given without one."""
    cached = use_cache is True or (isinstance(use_cache, np.bool_) and bool(use_cache))
    if block_table is None:
        if paged is not None and cached:
            raise ValueError(f"{who}: the KV cache is paged (cache_paged): use_cache=True needs block_table, the "
                             f"blocks of each batch row")
        return None
    if not cached:
        raise ValueError(f"{who}: block_table maps positions to blocks of a paged KV cache: it needs use_cache=True")
    if paged is None:
        raise ValueError(f"{who}: block_table needs a paged KV cache: call cache_paged(num_blocks, block_size) first")
    if slots is not None:
        raise ValueError(f"{who}: slots and block_table exclude each other (a paged cache has no sequences)")
    num_blocks, bs = paged
    t = int_array(block_table, who, "block_table")
    if t.ndim != 2 or t.shape[0] != B or t.shape[1] < 1:
        raise ValueError(f"{who}: block_table must have shape (B, cols) = ({B}, cols >= 1), got shape {t.shape}")
    if t.size and minmax(t)[1] >= num_blocks:
        b, c = np.argwhere(t >= num_blocks)[0]
        raise ValueError(f"{who}: block_table[{b}, {c}] = {int(t[b, c])} is outside the paged KV cache's "
                         f"{num_blocks} blocks [0, {num_blocks}) (< 0: no block)")
    end = (np.zeros(B, np.int64) if pos0 is None else pos0) + T
    short = (t.max(axis=1) >= 0) & (end > t.shape[1] * bs) if B else np.zeros(0, bool)
    if short.any():
        b = int(np.argmax(short))
        raise ValueError(f"{who}: block_table's {t.shape[1]} columns of {bs} positions cover {t.shape[1] * bs}, "
                         f"but row {b} reaches position {int(end[b])} (pos0 + T); rows of padding are all < 0")
    return np.ascontiguousarray(t)
