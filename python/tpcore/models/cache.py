"""TransformerLM's KV caches: one of sequences (`cache`: batch sequences of max_len positions,
what `generate` and `tpcore.Engine`'s slots use) or a paged pool (`cache_paged`: num_blocks
blocks of block_size positions per layer, addressed by a forward's ``block_table``)."""
from __future__ import annotations

from tpcore.utils.args import int_arg


class _CacheMixin:
    """`cache` and `cache_paged` of TransformerLM (its blocks: self.blocks)."""

    blocks: list

    def cache(self, batch: int, max_len: int) -> None:
        """(Re)allocate every block's KV cache (for use_cache forwards; generate makes its own).

        Parameters
        ----------
        batch : int
            Sequences, >= 1.
        max_len : int
            Tokens per sequence, >= 1.

        Raises
        ------
        TypeError, ValueError
            Not an int in range.
        """
        batch = int_arg(batch, "TransformerLM.cache", "batch", lo=1, hi=2 ** 31 - 1)
        max_len = int_arg(max_len, "TransformerLM.cache", "max_len", lo=1, hi=2 ** 31 - 1)
        for b in self.blocks:
            b.cache(batch, max_len)

    def cache_paged(self, num_blocks: int, block_size: int) -> None:
        """(Re)allocate every block's KV cache as a pool of num_blocks blocks of block_size
        positions (contents reset): forwards with use_cache then take a ``block_table`` (B,
        cols), row b's position p in block ``block_table[b, p // block_size]`` at row ``p %
        block_size``, the same block ids in every layer; entries < 0 are no block (padding).
        `memory`'s "kv_cache" counts the pools: 2 x layers x num_blocks x block_size x this
        rank's KV heads x head_dim x 4 bytes.

        Parameters
        ----------
        num_blocks : int
            Blocks in the pool, >= 1.
        block_size : int
            Positions per block, >= 1.

        Raises
        ------
        TypeError, ValueError
            Not an int in range.
        MemoryError, RuntimeError
            The pool does not fit (the C layer's error).
        """
        num_blocks = int_arg(num_blocks, "TransformerLM.cache_paged", "num_blocks", lo=1, hi=2 ** 31 - 1)
        block_size = int_arg(block_size, "TransformerLM.cache_paged", "block_size", lo=1, hi=2 ** 31 - 1)
        for b in self.blocks:
            b.cache_paged(num_blocks, block_size)
