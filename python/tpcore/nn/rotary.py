"""A block's rotary frequencies over its life (`RopeState`): rope_theta's formula (no table:
the C kernel computes 1 / theta^(2i / D) itself), a table from ``Config.rope_scaling``
(`tpcore.nn.rope.rope_frequencies`: linear, llama3, yarn, longrope, dynamic), or Gemma 3's
local base on its sliding layers.  The scalings whose frequencies depend on the sequence
length (dynamic NTK, LongRoPE) are recomputed for each forward's longest position, as
transformers does, and handed to the C block only when they change.  `layer_window`: a layer's
sliding window."""
from __future__ import annotations

from typing import List, Optional, Tuple

from tpcore.nn.config import Config


def _kind(scaling) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


class RopeState:
    """The rotary frequencies of one block (layer `layer` of cfg; None: a standalone block)."""

    def __init__(self, cfg: Config, layer: Optional[int]) -> None:
        self.cfg = cfg
        local = cfg.rope_local_theta is not None and layer is not None and cfg.sliding(layer)
        self.theta = float(cfg.rope_local_theta if local else cfg.rope_theta)
        self.scaled = not local and cfg.rope_scaling is not None and _kind(cfg.rope_scaling) != "default"
        self.dynamic = False
        self._key: Optional[Tuple[bytes, float]] = None
        self._ntk = self.scaled and _kind(cfg.rope_scaling) == "dynamic"
        self._cached = cfg.max_positions   # dynamic NTK: the longest length its table has grown to
        self._long = False                 # LongRoPE: whether the block holds the long table
        self._memo: dict = {}
        if self.scaled:
            from tpcore.nn.rope import depends_on_length
            self.dynamic = bool(depends_on_length(cfg))

    def _table(self, seq_len: Optional[int]) -> Tuple[Optional[List[float]], float]:
        from tpcore.nn.rope import rope_frequencies
        freq, factor = rope_frequencies(self.cfg, seq_len=seq_len)
        return [float(v) for v in freq], float(factor)

    def initial(self) -> Tuple[Optional[List[float]], float]:
        """(table or None, factor; 0.0: none) for the block's construction."""
        if not self.scaled:
            return None, 0.0
        freq, factor = self._table(None)
        self._key = (repr(freq).encode(), factor)
        return freq, factor

    def for_length(self, seq_len: int) -> Optional[Tuple[List[float], float]]:
        """The (table, factor) a forward reaching position seq_len - 1 needs, or None when the
        block already has them."""
        if not self.dynamic:
            return None
        if self._ntk:  # transformers' dynamic_frequency_update: grow past the longest seen, reset below the original
            grown, orig = self._cached, self.cfg.max_positions
            length = None
            if seq_len > grown:
                length = self._cached = seq_len
            if seq_len < orig and grown > orig:
                length, self._cached = None, orig
            elif seq_len <= grown:
                return None   # the table it has
            freq, factor = self._table(length)
        else:  # LongRoPE: the short table up to the original length, the long one past it (each made once)
            s = self.cfg.rope_scaling
            long = seq_len > (s.get("original_max_position_embeddings") or self.cfg.max_positions)
            if long == self._long:
                return None
            self._long = long
            if long not in self._memo:
                self._memo[long] = self._table(seq_len)
            freq, factor = self._memo[long]
        key = (repr(freq).encode(), factor)
        if key == self._key:
            return None
        self._key = key
        return freq, factor


def layer_window(cfg: Config, layer: Optional[int], who: str) -> Optional[int]:
    """The sliding window of layer `layer` of cfg (None: a standalone block: every layer's when
    they all slide), or None."""
    if cfg.sliding_window is None:
        return None
    if layer is None:
        if cfg.layer_types is not None and len(set(cfg.layer_types)) > 1:
            raise ValueError(f"{who}: config.layer_types mixes sliding and full layers: give layer=")
        return cfg.sliding_window if cfg.layer_types is None or cfg.layer_types[0] == "sliding_attention" else None
    return cfg.sliding_window if cfg.sliding(layer) else None
