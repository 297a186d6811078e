"""What the model families add to `TransformerLM` (Gemma's final logit soft-capping, sliding
windows whose KV cache is a ring), kept apart from models/lm.py."""
from __future__ import annotations

from typing import Optional

import numpy as np

from tpcore import _C
from tpcore.models.norm import on_device
from tpcore.nn.common import softcap
from tpcore.utils.arrays import DeviceArray, asarray_device, device_string


class _FamilyMixin:
    """TransformerLM's embedding and its helpers for the families' options."""

    def _embed(self, tokens, pos, token_type_ids):
        B, T = tokens.shape
        if self._kdev is not None:  # every addition and the norm on the model's device
            C = self.config.hidden
            h = self._dev(self.wte(asarray_device(tokens, device=device_string(self.device)) if self._on_gpu()
                                   else tokens), (B * T, C))
            if self.config.embed_scale is not None:
                h = self._dev(h.to_numpy() * np.float32(self.config.embed_scale))
            if self.wpe is not None:
                _C.add(h, h, _C.embedding_forward(on_device(np.ascontiguousarray(pos.reshape(-1)), self._kdev),
                                                  self.wpe))
            if self.tte is not None:
                tt = np.zeros(B * T, np.int64) if token_type_ids is None else token_type_ids.reshape(-1)
                _C.add(h, h, _C.embedding_forward(on_device(np.ascontiguousarray(tt), self._kdev), self.tte))
            if self.emb_norm is not None:
                h = self.emb_norm.forward(h)
            return h.reshape((B, T, C))
        h = self.wte(tokens)                              # (B, T, C), all-reduced
        if self.config.embed_scale is not None:           # Gemma: times sqrt(hidden), in float32
            h *= np.float32(self.config.embed_scale)
        if self.wpe is not None:
            h += self.wpe[pos]
        if self.tte is not None:
            tt = np.zeros((B, T), np.int64) if token_type_ids is None else token_type_ids
            h += self.tte[tt]
        if self.emb_norm is not None:
            h = self.emb_norm.forward(h.reshape(B * T, h.shape[-1])).reshape(h.shape)
        return h

    def _softcapped(self, shard):
        """The logits shard soft-capped when the model has final_softcap (Gemma 2)."""
        cap = self.config.final_softcap
        if cap is None:
            return shard
        if isinstance(shard, DeviceArray):  # on the host (the logits go there to be sampled anyway)
            return self._dev(softcap(shard.to_numpy(), cap))
        return softcap(shard, cap, out=shard)

    def _cache_chunk(self) -> Optional[int]:
        """The most tokens one cached forward may add: window + 1 when a sliding layer's cache is a
        ring (max_len > 2 window), else None (no limit)."""
        ws = [b.sliding_window for b in self.blocks
              if b.sliding_window and getattr(b, "_cache_len", 0) > 2 * b.sliding_window]
        return min(ws) + 1 if ws else None

    def _run_chunks(self, h, pos0, chunk, slots):
        """run_blocks with the cache over T tokens in pieces of at most chunk (prefill past a
        sliding window): each piece through every block, then the final norm on the whole."""
        B, T, C = h.shape
        host = h.to_numpy() if isinstance(h, DeviceArray) else np.asarray(h)
        outs = []
        for t0 in range(0, T, chunk):
            x = np.ascontiguousarray(host[:, t0:t0 + chunk])
            x = self._layer_in(self._dev(x)) if self._kdev is not None else x
            for blk in self.blocks:
                x = blk.forward(x, pos0=pos0 + t0, use_cache=True, need_backward=False, _agreed=True, slots=slots)
            outs.append(x.to_numpy() if isinstance(x, DeviceArray) else np.asarray(x))
        h = np.concatenate(outs, axis=1)
        if self.final_norm is not None:
            h2 = self._dev(h, (B * T, C)) if self._kdev is not None else h.reshape(B * T, C)
            h = self.final_norm.forward(h2).reshape((B, T, C))
        elif self._kdev is not None:
            h = self._layer_in(self._dev(h))
        return h

    def _capped(self, shard):
        """With final_softcap: tanh(raw / cap) of the loss's logits shard (what its backward needs:
        d capped / d raw = 1 - tanh^2), kept before the cross-entropy's backward overwrites them."""
        cap = self.config.final_softcap
        if cap is None:
            return None
        host = shard.to_numpy() if isinstance(shard, DeviceArray) else shard
        return np.asarray(host, np.float32) / np.float32(cap)

    def _uncap(self, dshard, ctx):
        t = ctx.get("capped")
        if t is None:
            return dshard
        if isinstance(dshard, DeviceArray):
            return self._dev(dshard.to_numpy() * (1 - t * t))
        dshard *= 1 - t * t
        return dshard
