"""Tensor-parallel Transformer models assembled over the C blocks.

    cfg = tpcore.models.Config.from_hf("path/")
    model = tpcore.models.from_pretrained("path/", comm)        # sliced per rank
    model = tpcore.models.TransformerLM(cfg, comm, seed=0)      # random, the same at any world size
    logits = model.logits(tokens)                               # (B, T, vocab), full on every rank
    hidden = model.encode(tokens, attention_mask=None)          # encoders (BERT)
    loss = model.loss(tokens, targets); model.backward(); opt.step()
    out = model.generate(prompts, max_new_tokens=16, temperature=0.0)

The token embedding is vocab-parallel (each rank holds its rows of the table);
the LM head is column-parallel over the vocabulary (tied: the same shard as the
embedding), so logits stay sharded for the loss (vocab-parallel
cross-entropy, no rank holds the full logits) and are all-gathered only for
``logits()`` and generation.  Learned position / token-type embeddings and the
final norm are replicated (small).  Blocks are one C call each.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional

import numpy as np

from . import _C
from .comm import Comm
from .layers import ColumnParallelLinear, check_seed
from .transformer import Config, TransformerBlock, head_partition, positions0
from .vocab import VocabParallelCrossEntropy, VocabParallelEmbedding

__all__ = ["Config", "TransformerLM", "from_pretrained", "head_partition"]


def _normal(seed: int, tag: int, shape, std: float) -> np.ndarray:
    return (np.random.default_rng([seed, tag]).standard_normal(shape) * std).astype(np.float32)


class _Norm:
    """A replicated LayerNorm/RMSNorm (C kernels)."""

    def __init__(self, kind: str, C: int, eps: float):
        self.kind, self.eps = kind, float(eps)
        self.weight = np.ones(C, np.float32)
        self.bias = np.zeros(C, np.float32) if kind == "layernorm" else None
        self.grad_weight = np.zeros(C, np.float32)
        self.grad_bias = None if self.bias is None else np.zeros(C, np.float32)
        self._ctx = None

    def parameters(self):
        return [(self.weight, self.grad_weight)] + ([] if self.bias is None else [(self.bias, self.grad_bias)])

    def forward(self, x2):
        y, mu, rs = _C.norm_forward(self.kind, x2, self.weight, self.bias, self.eps)
        self._ctx = (x2, mu, rs)
        return y

    def backward(self, dy2):
        x2, mu, rs = self._ctx
        return _C.norm_backward(self.kind, np.ascontiguousarray(dy2, np.float32), x2, self.weight, mu, rs,
                                self.grad_weight, self.grad_bias)


class TransformerLM:
    """A GPT-2 / Llama-style decoder or a BERT-style encoder split over the ranks of comm."""

    def __init__(self, config: Config, comm: Comm, seed: int = 0, partition=None, ffn_partition=None,
                 vocab_partition=None):
        if not isinstance(comm, Comm):
            raise TypeError(f"TransformerLM: comm must be a tpcore.Comm, got {type(comm).__name__}")
        cfg = self.config = config
        self.comm, self.seed = comm, check_seed(seed, "TransformerLM")
        seed = self.seed  # derived seeds below wrap modulo 2**64, as in C
        C = cfg.hidden
        self.wte = VocabParallelEmbedding(cfg.vocab_size, C, comm, partition=vocab_partition, seed=seed)
        self.wte.weight[...] *= 0.02  # GPT-2 / BERT initialisation scale (N(0, 0.02))
        self.vocab_partition = self.wte.partition
        self.wpe = _normal(seed, 1, (cfg.max_positions, C), 0.02) if cfg.positions == "learned" else None
        self.wpe_grad = None if self.wpe is None else np.zeros_like(self.wpe)
        self.tte = _normal(seed, 2, (cfg.type_vocab_size, C), 0.02) if cfg.type_vocab_size else None
        self.tte_grad = None if self.tte is None else np.zeros_like(self.tte)
        self.emb_norm = _Norm(cfg.norm, C, cfg.eps) if cfg.embedding_norm else None
        self.blocks = [TransformerBlock(cfg, comm, seed=(seed + 1000 * (i + 1)) % 2**64, head_partition=partition,
                                        ffn_partition=ffn_partition) for i in range(cfg.layers)]
        self.final_norm = _Norm(cfg.norm, C, cfg.eps) if cfg.final_norm and cfg.pre_norm else None
        if cfg.tie_embeddings:
            self.lm_head = None
        else:
            self.lm_head = ColumnParallelLinear(C, cfg.vocab_size, comm, bias=False,
                                                partition=[s for _, s in self.vocab_partition], seed=(seed + 7) % 2**64)
        self._ctx = None

    # ------------------------------------------------------------- parameters
    def parameters(self):
        ps = list(self.wte.parameters())
        if self.wpe is not None:
            ps.append((self.wpe, self.wpe_grad))
        if self.tte is not None:
            ps.append((self.tte, self.tte_grad))
        for m in ([self.emb_norm] if self.emb_norm else []) + self.blocks + \
                ([self.final_norm] if self.final_norm else []) + ([self.lm_head] if self.lm_head else []):
            ps.extend(m.parameters())
        return ps

    def zero_grad(self):
        for _, g in self.parameters():
            g[...] = 0

    def param_bytes(self) -> int:
        return int(sum(p.nbytes for p, _ in self.parameters()))

    def _head_weight(self):
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def cache(self, batch: int, max_len: int) -> None:
        for b in self.blocks:
            b.cache(batch, max_len)

    # ---------------------------------------------------------------- compute
    def _embed(self, tokens, pos, token_type_ids):
        B, T = tokens.shape
        h = self.wte(tokens)                                  # (B, T, C), all-reduced
        if self.wpe is not None:
            if pos.max(initial=0) >= self.config.max_positions:
                raise ValueError(f"position {int(pos.max())} is past max_positions ({self.config.max_positions})")
            h += self.wpe[pos]
        if self.tte is not None:
            tt = np.zeros((B, T), np.int64) if token_type_ids is None else np.asarray(token_type_ids, np.int64)
            h += self.tte[tt]
        if self.emb_norm is not None:
            h = self.emb_norm.forward(h.reshape(B * T, h.shape[-1])).reshape(h.shape)
        return h

    def forward(self, tokens, pos0=None, attention_mask=None, token_type_ids=None, use_cache: bool = False,
                need_backward: bool = False) -> np.ndarray:
        """Hidden states (B, T, hidden) after the last block (and the final norm)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(f"tokens must have shape (batch, time), got {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"tokens must be integers, got {tokens.dtype}")
        tokens = np.ascontiguousarray(tokens, np.int64)
        B, T = tokens.shape
        p0 = np.zeros(B, np.int64) if pos0 is None else positions0(pos0, B, T, "TransformerLM.forward")
        pos = p0[:, None] + np.arange(T)[None, :]
        sw = getattr(self.config, "sliding_window", None)
        if sw and B and T and int(pos.max()) >= sw:
            raise ValueError(f"position {int(pos.max())} needs sliding-window attention (window {sw}), which tpcore "
                             f"does not implement: sequences up to {sw} tokens are exact")
        mask = None if attention_mask is None else np.ascontiguousarray(np.asarray(attention_mask).reshape(B, T) != 0,
                                                                       np.uint8)
        h = self._embed(tokens, pos, token_type_ids)
        for blk in self.blocks:
            h = blk.forward(h, pos0=p0 if use_cache or pos0 is not None else None, key_mask=mask,
                            use_cache=use_cache, need_backward=need_backward)
        if self.final_norm is not None:
            h = self.final_norm.forward(h.reshape(B * T, h.shape[-1])).reshape(h.shape)
        self._ctx = dict(tokens=tokens, pos=pos, token_type_ids=token_type_ids, B=B, T=T) if need_backward else None
        return h

    def encode(self, tokens, attention_mask=None, token_type_ids=None) -> np.ndarray:
        """(B, T, hidden) hidden states (BERT's last_hidden_state)."""
        return self.forward(tokens, attention_mask=attention_mask, token_type_ids=token_type_ids)

    def _logits_shard(self, h2, reuse: bool = False):
        # tpcore's BLAS in C (GIL released): NumPy's own BLAS threads would spin after each call
        # and compete with tpcore's for the cores.  reuse: write into a buffer kept across training
        # steps (the logits shard is the largest activation; a fresh one costs page faults each step)
        h2 = np.ascontiguousarray(h2, np.float32)
        out = None
        if reuse:
            shape = (h2.shape[0], self.vocab_partition[self.comm.rank][1])
            buf = getattr(self, "_logits_buf", None)
            if buf is None or buf.shape != shape:
                buf = self._logits_buf = np.empty(shape, np.float32)
            out = buf
        if self.lm_head is None:
            return _C.linear_forward(h2, self.wte.weight, None, out)
        return self.lm_head._c.forward(h2, out)

    def _gather_logits(self, shard):
        return self.comm.all_gather(np.ascontiguousarray(shard), axis=-1, sizes=[s for _, s in self.vocab_partition])

    def logits(self, tokens, attention_mask=None, token_type_ids=None) -> np.ndarray:
        """(B, T, vocab) float32 logits, the full vocabulary on every rank."""
        h = self.forward(tokens, attention_mask=attention_mask, token_type_ids=token_type_ids)
        B, T, C = h.shape
        return self._gather_logits(self._logits_shard(h.reshape(B * T, C))).reshape(B, T, self.config.vocab_size)

    def loss(self, tokens, targets, attention_mask=None, ignore_index: int = -100) -> float:
        """Mean cross-entropy of next-token targets (B, T) over the full vocabulary, from the
        vocab-parallel logits; keeps what backward() needs."""
        h = self.forward(tokens, attention_mask=attention_mask, need_backward=True)
        B, T, C = h.shape
        h2 = np.ascontiguousarray(h.reshape(B * T, C))
        shard = self._logits_shard(h2, reuse=True)
        xent = VocabParallelCrossEntropy(self.comm, ignore_index=ignore_index)
        targets = np.asarray(targets)
        if targets.shape != (B, T):
            raise ValueError(f"targets must have shape {(B, T)}, got {targets.shape}")
        lo = self.vocab_partition[self.comm.rank][0]
        value = xent(shard, targets.reshape(B * T), vocab_offset=lo)
        self._ctx.update(xent=xent, h2=h2, xent_logits=shard)
        return value

    def backward(self, dloss: float = 1.0) -> None:
        """Gradients of the last loss() into every parameter (accumulated)."""
        if not self._ctx or "xent" not in self._ctx:
            raise RuntimeError("TransformerLM.backward: call loss() first")
        ctx, comm = self._ctx, self.comm
        B, T = ctx["B"], ctx["T"]
        dshard = ctx["xent"].backward(dloss, out=ctx["xent_logits"])  # dlogits over the logits, in place
        h2 = ctx["h2"]
        if self.lm_head is None:
            dh = _C.linear_backward(np.ascontiguousarray(dshard), h2, self.wte.weight, self.wte.grad_weight)
            if comm.size > 1:
                comm.all_reduce(dh)       # column-parallel head: the input gradient sums over ranks
        else:
            dh = self.lm_head.backward(dshard)
        if self.final_norm is not None:
            dh = self.final_norm.backward(dh)
        dh = dh.reshape(B, T, self.config.hidden)
        for blk in reversed(self.blocks):
            dh = blk.backward(dh)
        dh2 = dh.reshape(B * T, self.config.hidden)
        if self.emb_norm is not None:
            dh2 = self.emb_norm.backward(dh2)
        if self.wpe is not None:
            np.add.at(self.wpe_grad, ctx["pos"].reshape(-1), dh2)
        if self.tte is not None:
            tt = np.zeros(B * T, np.int64) if ctx["token_type_ids"] is None else \
                np.asarray(ctx["token_type_ids"], np.int64).reshape(-1)
            np.add.at(self.tte_grad, tt, dh2)
        self.wte.backward(np.ascontiguousarray(dh2))
        self._ctx = None

    # ------------------------------------------------------------- generation
    def generate(self, prompts, max_new_tokens: int = 16, temperature: float = 0.0, top_k: Optional[int] = None,
                 seed: int = 0, eos_token_id: Optional[int] = None, pad_token_id: Optional[int] = None):
        """Batched prefill, then KV-cache decoding.  prompts: (B, T) ints, or a list of
        sequences of their own lengths.  Greedy (temperature 0) gives the same tokens at
        every world size.  A sequence that emits eos_token_id is finished: pad_token_id
        fills the rest (both default to the checkpoint's generation_config.json, as in
        Hugging Face; pass eos_token_id=-1 to never stop).  Returns (B, T + new) int64 when
        the prompts have one length, else a list of 1-D arrays."""
        cfg = self.config
        gen = getattr(self, "generation_config", {}) or {}
        if eos_token_id is None:
            eos_token_id = gen.get("eos_token_id")
        # one id or several (Llama 3 Instruct stops on any of three); ids outside the vocabulary
        # (e.g. GPT-2's 50256 in a small test model) can never be emitted
        eos_ids = [] if eos_token_id is None else [int(e) for e in np.atleast_1d(eos_token_id)]
        eos_ids = [e for e in eos_ids if 0 <= e < cfg.vocab_size]
        if pad_token_id is None:
            pad_token_id = gen.get("pad_token_id")
            if pad_token_id is None:
                pad_token_id = eos_ids[0] if eos_ids else 0
        pad_token_id = int(np.atleast_1d(pad_token_id)[0])
        if not cfg.causal:
            raise ValueError("generate: needs a causal (decoder) model")
        if isinstance(prompts, np.ndarray):
            batch = list(prompts) if prompts.ndim == 2 else [prompts]
        elif len(prompts) and all(isinstance(t, (int, np.integer)) for t in prompts):
            batch = [prompts]  # one flat prompt
        else:
            batch = list(prompts)
        seqs = [np.asarray(p, np.int64).reshape(-1) for p in batch]
        if not seqs or any(s.size == 0 for s in seqs):
            raise ValueError("generate: every prompt needs at least one token")
        B, lens = len(seqs), np.array([s.size for s in seqs], np.int64)
        total = int(lens.max()) + int(max_new_tokens)
        if cfg.positions == "learned" and total > cfg.max_positions:
            raise ValueError(f"generate: {total} tokens exceed max_positions ({cfg.max_positions})")
        self.cache(B, total)
        padded = np.zeros((B, int(lens.max())), np.int64)
        for b, s in enumerate(seqs):
            padded[b, :s.size] = s
        rng = np.random.default_rng(seed)
        h = self.forward(padded, pos0=np.zeros(B, np.int64), use_cache=True)   # right padding is causal-safe
        last = h[np.arange(B), lens - 1]                                         # (B, C)
        out = [list(s) for s in seqs]
        cur = lens.copy()
        done = np.zeros(B, bool)
        for step in range(int(max_new_tokens)):
            logits = self._gather_logits(self._logits_shard(np.ascontiguousarray(last)))   # (B, V) on every rank
            nxt = self._sample(logits, temperature, top_k, rng)
            if eos_ids:
                nxt = np.where(done, pad_token_id, nxt)
                done |= np.isin(nxt, eos_ids)
            for b in range(B):
                out[b].append(int(nxt[b]))
            if step == max_new_tokens - 1 or (eos_ids and done.all()):
                break
            h = self.forward(nxt.reshape(B, 1), pos0=cur, use_cache=True)
            last = h[:, 0]
            cur = cur + 1
        res = [np.array(o, np.int64) for o in out]
        if len(set(r.size for r in res)) == 1:
            return np.stack(res)
        return res

    @staticmethod
    def _sample(logits, temperature, top_k, rng):
        if temperature <= 0:
            return logits.argmax(-1).astype(np.int64)
        z = logits.astype(np.float64) / temperature
        if top_k:
            kth = np.sort(z, -1)[:, -int(top_k)][:, None]
            z = np.where(z >= kth, z, -np.inf)
        z -= z.max(-1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(-1, keepdims=True)
        u = rng.random(len(p))[:, None]
        return np.minimum((np.cumsum(p, -1) < u).sum(-1), p.shape[-1] - 1).astype(np.int64)

    # ------------------------------------------------------------ checkpoints
    def state_dict_full(self) -> dict:
        """Full tensors in tpcore's names (collective)."""
        sd = {"wte.weight": self.wte.gather_full()}
        if self.wpe is not None:
            sd["wpe.weight"] = self.wpe.copy()
        if self.tte is not None:
            sd["tte.weight"] = self.tte.copy()
        if self.emb_norm is not None:
            sd["emb_norm.weight"] = self.emb_norm.weight.copy()
            if self.emb_norm.bias is not None:
                sd["emb_norm.bias"] = self.emb_norm.bias.copy()
        for i, blk in enumerate(self.blocks):
            for k, v in blk.gather_full().items():
                sd[f"blocks.{i}.{k}"] = v
        if self.final_norm is not None:
            sd["final_norm.weight"] = self.final_norm.weight.copy()
            if self.final_norm.bias is not None:
                sd["final_norm.bias"] = self.final_norm.bias.copy()
        if self.lm_head is not None:
            sd["lm_head.weight"] = self.lm_head.gather_full()[0]
        return sd

    def load_state_dict_full(self, sd, progress: bool = False) -> None:
        """Load full tensors (tpcore's names); each rank keeps its slices.  Values may be
        arrays or memory-mapped views (only the rank's slices are read)."""
        def take(name):
            if name not in sd:
                raise KeyError(f"checkpoint: missing tensor {name!r}")
            return sd[name]

        _load_embedding(self.wte, take("wte.weight"))
        if self.wpe is not None:
            _assign(self.wpe, take("wpe.weight"), "wpe.weight")
        if self.tte is not None:
            _assign(self.tte, take("tte.weight"), "tte.weight")
        for nm, norm in (("emb_norm", self.emb_norm), ("final_norm", self.final_norm)):
            if norm is not None:
                _assign(norm.weight, take(f"{nm}.weight"), f"{nm}.weight")
                if norm.bias is not None:
                    _assign(norm.bias, take(f"{nm}.bias"), f"{nm}.bias")
        bar = _Progress(len(self.blocks), progress and self.comm.rank == 0)
        for i, blk in enumerate(self.blocks):
            blk.load_full({k: take(f"blocks.{i}.{k}") for k in blk.full_shapes()})
            bar.step()
        bar.done()
        if self.lm_head is not None:
            W = take("lm_head.weight")
            lo, n = self.vocab_partition[self.comm.rank]
            if tuple(W.shape) != (self.config.vocab_size, self.config.hidden):
                raise ValueError(f"checkpoint: lm_head.weight has shape {tuple(W.shape)}")
            self.lm_head.weight[...] = _f32(W[lo:lo + n])

    def save_pretrained(self, path: str, sharded: bool = False, hf: bool = False) -> None:
        """tpcore_config.json + model.safetensors (full, rank 0 writes; loadable at any world
        size) or one file per rank (sharded: model.rank<r>-of-<n>.safetensors, the same layout
        only).  hf=True: full tensors under Hugging Face's names with its config.json, for
        transformers' from_pretrained (GPT-2, Llama, BERT)."""
        from .checkpoint import write_safetensors
        import dataclasses
        import json
        comm = self.comm
        if hf:
            if sharded:
                raise ValueError("save_pretrained: hf=True writes one consolidated file (sharded=False)")
            from .hf import to_hf
            tensors, conf = to_hf(self.config, self.state_dict_full())
            if comm.rank == 0:
                os.makedirs(path, exist_ok=True)
                write_safetensors(os.path.join(path, "model.safetensors"), tensors, {"format": "pt"})
                with open(os.path.join(path, "config.json"), "w") as f:
                    json.dump(conf, f, indent=1)
            comm.barrier()
            return
        if comm.rank == 0:
            os.makedirs(path, exist_ok=True)
            with open(os.path.join(path, "tpcore_config.json"), "w") as f:
                json.dump(dataclasses.asdict(self.config), f, indent=1)
        comm.barrier()
        if sharded:
            tensors = {}
            for i, (p, _) in enumerate(self.parameters()):
                tensors[f"param.{i}"] = np.ascontiguousarray(p)
            write_safetensors(os.path.join(path, f"model.rank{comm.rank}-of-{comm.size}.safetensors"), tensors,
                              {"format": "tpcore-sharded", "world": str(comm.size), "rank": str(comm.rank)})
        else:
            sd = self.state_dict_full()
            if comm.rank == 0:
                write_safetensors(os.path.join(path, "model.safetensors"), sd, {"format": "tpcore"})
        comm.barrier()

    def __repr__(self):
        c = self.config
        return (f"TransformerLM({c.model_type}: {c.layers} layers, hidden {c.hidden}, heads {c.heads}/{c.kv_heads}, "
                f"vocab {c.vocab_size}; rank {self.comm.rank} of {self.comm.size})")


def _f32(a) -> np.ndarray:
    from .checkpoint import to_float32
    return to_float32(a)


def _assign(dst, src, name):
    if tuple(src.shape) != dst.shape:
        raise ValueError(f"checkpoint: {name} has shape {tuple(src.shape)}, expected {dst.shape}")
    dst[...] = _f32(src[...])


def _load_embedding(emb, table):
    if tuple(table.shape) != (emb.num_embeddings, emb.embedding_dim):
        raise ValueError(f"checkpoint: the token embedding has shape {tuple(table.shape)}, expected "
                         f"{(emb.num_embeddings, emb.embedding_dim)}")
    emb.weight[...] = _f32(table[emb.offset:emb.offset + emb.local])


class _Progress:
    def __init__(self, n, on):
        self.n, self.i, self.on, self.t0 = n, 0, on and n > 0, time.monotonic()

    def step(self):
        self.i += 1
        if self.on:
            w = 30
            k = w * self.i // self.n
            sys.stderr.write(f"\rloading [{'#' * k}{'.' * (w - k)}] {self.i}/{self.n} blocks "
                             f"{time.monotonic() - self.t0:.1f}s")
            sys.stderr.flush()

    def done(self):
        if self.on:
            sys.stderr.write("\n")


def from_pretrained(path: str, comm: Comm, partition=None, progress: bool = True) -> TransformerLM:
    """A Hugging Face GPT-2, Llama or BERT checkpoint (config.json + *.safetensors) or one
    saved by save_pretrained; each rank reads only its slices (memory-mapped)."""
    from . import hf
    return hf.load(path, comm, partition=partition, progress=progress)
