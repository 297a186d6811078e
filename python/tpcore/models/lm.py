"""`TransformerLM`: the tensor-parallel Transformer model assembled over the C blocks.

    model = tpcore.models.TransformerLM(cfg, comm, seed=0)      # random, the same at any world size
    logits = model.logits(tokens)                               # (B, T, vocab), full on every rank
    hidden = model.encode(tokens, attention_mask=None)          # encoders (BERT)
    loss = model.loss(tokens, targets); model.backward(); opt.step()
    out = model.generate(prompts, max_new_tokens=16)            # models/generate.py

The token embedding is vocab-parallel (each rank holds its rows of the table); the LM head
is column-parallel over the vocabulary (tied: the embedding's shard), so logits stay
sharded for the loss (vocab-parallel cross-entropy) and are all-gathered only for
``logits()`` and generation.  Position / type embeddings and the norms outside the blocks
are replicated (models/norm.py).  Checkpoint state: models/state.py; loaders: models/loader/.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from tpcore import _C
from tpcore.distributed.agree import agreed
from tpcore.distributed.comm import Comm
from tpcore.models.cache import _CacheMixin
from tpcore.models.families import _FamilyMixin
from tpcore.models.generate import _GenerationMixin, check_vocab
from tpcore.models.memory import MODEL_PARTS, _aligned_heads, model_memory
from tpcore.models.moe_block import build_blocks
from tpcore.models.norm import _Norm, _normal, on_device
from tpcore.models.state import _CheckpointMixin
from tpcore.models.text_generate import _TextMixin
from tpcore.nn.common import zero
from tpcore.nn.config import Config, head_partition
from tpcore.nn.linear import ColumnParallelLinear
from tpcore.nn.moe import load_balancing_loss
from tpcore.nn.partition import partition as partition_dim, partition_sizes
from tpcore.nn.kvcache import block_table_array
from tpcore.nn.transformer import TransformerBlock, mask_array, positions
from tpcore.nn.weights import put_weight
from tpcore.nn.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding
from tpcore.utils.args import bool_arg, int_arg, minmax, seed_arg, shown
from tpcore.utils.dtypes import is_quantized, weight_formats
from tpcore.utils.arrays import DeviceArray, asarray_device, device_string, int_array, resolve_device

__all__ = ["Config", "TransformerLM", "head_partition", "on_device"]


def _stage_arg(stage, layers: int) -> Tuple[int, int, bool, bool]:
    """TransformerLM's stage checked: (lo, hi, first, last), 0 <= lo <= hi <= layers."""
    if not isinstance(stage, (tuple, list)) or len(stage) != 4:
        raise TypeError(f"TransformerLM: stage must be (lo, hi, first, last), got {shown(stage)}")
    who = "TransformerLM"
    lo = int_arg(stage[0], who, "stage's lo", lo=0, hi=layers)
    return (lo, int_arg(stage[1], who, "stage's hi", lo=lo, hi=layers), bool_arg(stage[2], who, "stage's first"),
            bool_arg(stage[3], who, "stage's last"))


class TransformerLM(_GenerationMixin, _TextMixin, _CheckpointMixin, _FamilyMixin, _CacheMixin):
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
    stage : (int, int, bool, bool), optional
        (lo, hi, first, last): only a part of the model, as a pipeline stage holds it
        (`tpcore.PipelineLM`): the blocks [lo, hi) (made with the seeds of the whole model),
        the embeddings when first, the final norm and the LM head when last (tied: with its
        own copy of the token embedding).  Default None: the whole model.  The stage
        interface (`embed`, `run_blocks`, `head_loss` and their backwards) drives it.

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
                 _device_path: bool = False, stage: Any = None, plan: Any = None, _loading: bool = False) -> None:
        self.device = resolve_device(device, "TransformerLM")
        self.dtypes = weight_formats(dtype, "TransformerLM", MODEL_PARTS)
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
            from tpcore.nn.plan import plan_arg
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
        lo, hi, first, last = (0, cfg.layers, True, True) if stage is None else _stage_arg(stage, cfg.layers)
        self._first, self._last, self.layer_range = first, last, (lo, hi)
        if first or (last and cfg.tie_embeddings):
            self.wte = VocabParallelEmbedding(cfg.vocab_size, C, comm, partition=vocab_partition, seed=seed,
                                              device=dev, dtype=self.dtypes["embedding"])
            if _loading:  # the checkpoint's values come next: no host copy of the table to scale
                pass
            elif is_quantized(self.wte.dtype):  # scaled in float32, quantized again (on the host)
                if self.wte.local:
                    put_weight(self.wte.weight, self.wte.dtype, self.wte.weight_float() * 0.02, "TransformerLM")
            elif dev is None:
                self.wte.weight[...] *= 0.02  # GPT-2 / BERT initialisation scale (N(0, 0.02))
            else:  # the same values, scaled on the host
                self.wte.weight[...] = self.wte.weight.to_numpy() * 0.02
            self.vocab_partition = self.wte.partition
        else:
            self.wte = None
            sizes = partition_sizes(vocab_partition, cfg.vocab_size, comm.size, "vocab_size",
                                    "TransformerLM: vocab_partition")
            self.vocab_partition = partition_dim(cfg.vocab_size, comm.size) if sizes is None else \
                [(int(sum(sizes[:r])), int(sizes[r])) for r in range(comm.size)]
        # position / type embeddings and the norms outside the blocks: replicated, float32; on a GPU
        # they live there (DeviceArrays) and run the d_ kernels
        learned = cfg.positions == "learned" and first
        self.wpe = on_device(_normal(seed, 1, (cfg.max_positions, C), 0.02), self._kdev) if learned else None
        self.tte = on_device(_normal(seed, 2, (cfg.type_vocab_size, C), 0.02), self._kdev) \
            if cfg.type_vocab_size and first else None
        self.wpe_grad = self.tte_grad = None  # gradients on demand (_alloc_grads): none for inference
        self.emb_norm = _Norm(cfg.norm, C, cfg.eps, self._kdev) if cfg.embedding_norm and first else None
        bd = {k: self.dtypes[k] for k in ("qkv", "out", "fc1", "fc2")}
        self.blocks = build_blocks(cfg, comm, [(seed + 1000 * (i + 1)) % 2 ** 64 for i in range(lo, hi)], partition,
                                   ffn_partition, dev, bd, "TransformerLM", layers=range(lo, hi))
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
            self.wpe_grad = on_device(np.zeros(self.wpe.shape, np.float32), self._kdev)
        if self.tte is not None and self.tte_grad is None:
            self.tte_grad = on_device(np.zeros(self.tte.shape, np.float32), self._kdev)

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

    def weights(self) -> list:
        """This rank's parameters, those of `parameters()` in their order, without gradients
        (nothing is allocated): what a sharded checkpoint holds."""
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
        return int(sum(p.nbytes for p in self.weights()) + sum(w.nbytes for w in self._frozen()))

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
        return model_memory(self, optimizer)

    def _head_fmt(self):
        """The tied head's weight format for the kernels (None unless quantized)."""
        return self.wte.dtype if is_quantized(self.wte.dtype) else None

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

    def _inputs_slots(self, tokens, pos0, attention_mask, token_type_ids, use_cache, need_backward, who, slots=None,
                      block_table=None):
        """The forward's arguments checked and converted: tokens (B, T) int64 in the vocabulary,
        pos0 (B,) or None, positions (B, T), the mask (B, T) uint8 or None, token types or None,
        the KV-cache slots (B,) or None and a paged cache's block table or None, checked against
        the cache."""
        cfg = self.config
        tokens = int_array(tokens, who, "tokens")
        if tokens.ndim != 2:
            raise ValueError(f"{who}: tokens must have shape (batch, time), got {tokens.shape}")
        B, T = tokens.shape  # an empty batch gives an empty result, as in torch
        check_vocab(tokens, cfg.vocab_size, who, "tokens")
        bool_arg(use_cache, who, "use_cache")
        bool_arg(need_backward, who, "need_backward")
        p0 = None if pos0 is None else positions(pos0, B, who)
        pos = (np.zeros(B, np.int64) if p0 is None else p0)[:, None] + np.arange(T)[None, :]
        last = (0 if p0 is None or not B else minmax(p0)[1]) + T - 1 if B and T else -1  # -1: no positions
        if cfg.positions == "learned" and last >= cfg.max_positions:
            raise ValueError(f"{who}: position {last} is past max_positions ({cfg.max_positions})")
        mask = None if attention_mask is None else mask_array(attention_mask, B, T, who, "attention_mask")
        tt = None
        if token_type_ids is not None:
            if self.tte is None:
                raise ValueError(f"{who}: token_type_ids given, but this model has no token types "
                                 f"(type_vocab_size=0)")
            tt = int_array(token_type_ids, who, "token_type_ids")
            if tt.shape != (B, T):
                raise ValueError(f"{who}: token_type_ids must have shape (B, T) = {(B, T)}, got {tt.shape}")
            check_vocab(tt, cfg.type_vocab_size, who, "token_type_ids", "type_vocab_size")
        sl = None if slots is None else self.blocks[0]._slots(slots, B, use_cache, who)
        paged = getattr(self.blocks[0], "_paged", None) if self.blocks else None  # a pipeline stage may hold none
        bt = block_table_array(block_table, B, T, p0, paged, use_cache, sl, who)
        if use_cache and bt is None:
            self.blocks[0]._check_cache(np.zeros(B, np.int64) if p0 is None else p0, B, T, who, sl)
        return tokens, p0, pos, mask, tt, sl, bt

    def forward(self, tokens: Any, pos0: Any = None, attention_mask: Any = None, token_type_ids: Any = None,
                use_cache: bool = False, need_backward: bool = False, _agreed: bool = False,
                slots: Any = None, block_table: Any = None) -> np.ndarray:
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
        block_table : array_like of int, shape (B, cols), optional
            With use_cache over a paged cache (`cache_paged`; required there): row b's
            position p in block ``block_table[b, p // block_size]``; entries < 0: no block
            (padding); a row with a block covers pos0[b] + T.

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
        h = self._forward(tokens, pos0, attention_mask, token_type_ids, use_cache, need_backward, _agreed, slots,
                          block_table)
        return h.to_numpy() if isinstance(h, DeviceArray) else h

    def _forward(self, tokens, pos0=None, attention_mask=None, token_type_ids=None, use_cache: bool = False,
                 need_backward: bool = False, _agreed: bool = False, slots=None, block_table=None):
        """forward, the hidden states left where they are (a DeviceArray on a GPU model)."""
        who = "TransformerLM"
        cached = bool(use_cache) if isinstance(use_cache, (bool, np.bool_)) else True  # (a bad value: refused)
        tokens, p0, pos, mask, tt, sl, bt = agreed(
            self.comm, f"{who}.forward", (pos0 is not None or slots is not None or cached) and not _agreed,
            lambda: self._inputs_slots(tokens, pos0, attention_mask, token_type_ids, use_cache, need_backward, who,
                                       slots, block_table),
            lambda v: [("the batch shape (B, T) differs", v[0].shape), ("pos0 differs", (v[1],)),
                       ("the tokens differ", (v[0],)), ("attention_mask differs", (v[3],)),
                       ("slots differ", (v[5],)), ("block_table differs", (v[6],)),
                       ("use_cache differs", (bool(use_cache),))])
        h = self.embed(tokens, pos, tt) if self._first else tokens
        h = self.run_blocks(h, p0, mask, use_cache, need_backward, sl, bt)
        self._ctx = dict(pos=pos, token_type_ids=tt) if need_backward else None
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

    def logits_shard(self, h2: Any, reuse: bool = False) -> Any:
        """This rank's logits (N, its vocabulary rows) from the LM head, where the model lives.

        Parameters
        ----------
        h2 : array, shape (N, hidden), float32
            Rows of `run_blocks`'s hidden states.
        reuse : bool, default False
            Write into a buffer this model keeps (a CPU model), overwritten by the next call.
        """
        with self.comm._region("head"):  # the head's collectives (if any) in comm.stats()["regions"]
            return self._softcapped(self._logits_shard_(h2, reuse))

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

    def gather_logits(self, shard: Any) -> np.ndarray:
        """The logits (N, vocab_size) on every rank: each rank's `logits_shard` all-gathered.

        Parameters
        ----------
        shard : array, shape (N, this rank's vocabulary rows), float32
        """
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
        return self.gather_logits(self.logits_shard(h.reshape((B * T, C)))).reshape(B, T, self.config.vocab_size)

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
            The mean over the counted targets, the same on every rank; a MoE model with
            config.router_aux_loss_coef > 0 adds coef x its routers' load-balancing loss
            (`tpcore.nn.moe.load_balancing_loss`, transformers'), whose gradient `backward` adds.

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
        value = self.head_loss(h, targets, ignore_index)
        coef = self.config.router_aux_loss_coef
        if self.config.experts and coef:  # MoE: the routers' load-balancing loss (tpcore.nn.moe)
            value += coef * load_balancing_loss(self, attention_mask, coef)
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
        ctx = self._ctx
        dh = self.blocks_backward(self.head_backward(dloss))
        if self._first:
            self.embed_backward(dh, ctx["pos"], ctx["token_type_ids"])

    def _backward_device(self, ctx, dloss):
        """backward with every tensor where the model lives (its GPU; the CPU device path)."""
        comm, B, T, C = self.comm, ctx["B"], ctx["T"], self.config.hidden
        self._alloc_grads()
        dshard = ctx["xent"].backward(dloss, out=ctx["xent_logits"])  # dlogits over the logits, in place
        dshard = self._uncap(dshard, ctx)
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
            _C.embedding_backward(self.wpe_grad, on_device(np.ascontiguousarray(ctx["pos"].reshape(-1)), self._kdev),
                                  dh2)
        if self.tte is not None:
            tt = np.zeros(B * T, np.int64) if ctx["token_type_ids"] is None else \
                np.asarray(ctx["token_type_ids"], np.int64).reshape(-1)
            _C.embedding_backward(self.tte_grad, on_device(np.ascontiguousarray(tt), self._kdev), dh2)
        if self.config.embed_scale is not None:
            dh2 = self._dev(dh2.to_numpy() * np.float32(self.config.embed_scale))
        self.wte.backward((dh2 if self._on_gpu() else dh2.to_numpy()).reshape((B, T, C)))  # its forward's shape

    # ------------------------------------------------------------- stage interface
    # The steps a pipeline schedule (tpcore.parallel.pipeline) drives a stage through: embed
    # (first stage), run_blocks, head_loss (last stage), then head_backward, blocks_backward,
    # embed_backward.  A whole model's forward, loss and backward are the same steps.  The
    # backward steps take NumPy arrays (a CPU model); backward() runs a GPU model's.
    def check_inputs(self, tokens: Any, attention_mask: Any = None,
                     who: str = "TransformerLM") -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
        """(tokens (B, T) int64, their positions (B, T), the mask (B, T) uint8 or None),
        checked as `forward` does (TypeError, ValueError; no collective).

        Parameters
        ----------
        tokens, attention_mask
            As `forward`'s.
        who : str, default "TransformerLM"
            The caller, named in the errors.
        """
        tokens, _, pos, mask, _, _, _ = self._inputs_slots(tokens, None, attention_mask, None, False, False, who)
        return tokens, pos, mask

    def embed(self, tokens: np.ndarray, pos: np.ndarray, token_type_ids: Optional[np.ndarray] = None) -> Any:
        """The first stage's step: the hidden states (B, T, hidden) `run_blocks` takes.

        The token embedding (an all-reduce), the position and type embeddings and the
        embedding norm where the model has them.

        Parameters
        ----------
        tokens, pos : numpy.ndarray, shape (B, T), int64
            Checked tokens (`check_inputs`) and their positions.
        token_type_ids : numpy.ndarray, shape (B, T), int64, optional
            BERT's segment ids (default None: 0).
        """
        return self._layer_in(self._embed(tokens, pos, token_type_ids))

    def run_blocks(self, h: Any, pos0: Optional[np.ndarray] = None, attention_mask: Optional[np.ndarray] = None,
                   use_cache: bool = False, need_backward: bool = False, slots: Optional[np.ndarray] = None,
                   block_table: Optional[np.ndarray] = None) -> Any:
        """This model's blocks over h (B, T, hidden), then the final norm when it holds it
        (two all-reduces per block): the hidden states (B, T, hidden).

        Parameters
        ----------
        h : array, shape (B, T, hidden), float32
            `embed`'s result, or the previous stage's.
        pos0, attention_mask, use_cache, need_backward, slots, block_table
            As `forward`'s, checked (`check_inputs`); need_backward keeps what
            `blocks_backward` needs.
        """
        B, T = h.shape[:2]
        bp0 = pos0 if pos0 is not None else (np.zeros(B, np.int64) if use_cache else None)
        chunk = self._cache_chunk() if use_cache else None
        if chunk is not None and T > chunk:  # a sliding window's ring takes at most chunk new tokens at once
            return self._run_chunks(h, bp0, chunk, slots)
        for blk in self.blocks:
            h = blk.forward(h, pos0=bp0, key_mask=attention_mask, use_cache=use_cache, need_backward=need_backward,
                            _agreed=True, slots=slots, block_table=block_table)
        C = self.config.hidden
        if self.final_norm is not None:
            h2 = self._dev(h, (B * T, C)) if self._kdev is not None else h.reshape(B * T, C)
            h = self.final_norm.forward(h2).reshape((B, T, C))
        return h

    def head_loss(self, h: Any, targets: np.ndarray, ignore_index: int = -100) -> float:
        """The last stage's step: the LM head and the vocab-parallel cross-entropy (its
        all-reduces), the mean loss on every rank; keeps what `head_backward` needs.

        Parameters
        ----------
        h : array, shape (B, T, hidden), float32
            `run_blocks`'s result.
        targets : numpy.ndarray, shape (B, T), int64
            The next token of each position (a ValueError for another shape).
        ignore_index : int, default -100
            Targets with no loss.
        """
        B, T, C = h.shape
        if targets.shape != (B, T):
            self._ctx = None
            raise ValueError(f"TransformerLM.loss: targets must have shape {(B, T)}, got {targets.shape}")
        ctx = self._ctx = dict(self._ctx or {}, B=B, T=T)
        lo = self.vocab_partition[self.comm.rank][0]
        if self._kdev is not None:
            h2 = self._dev(h, (B * T, C))
            shard = self.logits_shard(h2)
            if self._on_gpu():
                dev = device_string(self.device)
                xent = VocabParallelCrossEntropy(self.comm, ignore_index=ignore_index, device=dev)
                value = xent(shard, asarray_device(targets.reshape(B * T), device=dev), vocab_offset=lo)
            else:  # the device path on the CPU: the CPU cross-entropy takes NumPy
                shard = shard.to_numpy() if isinstance(shard, DeviceArray) else shard
                xent = VocabParallelCrossEntropy(self.comm, ignore_index=ignore_index)
                value = xent(shard, targets.reshape(B * T), vocab_offset=lo)
            ctx.update(xent=xent, h2=h2, xent_logits=shard, capped=self._capped(shard))
            return value
        h2 = np.ascontiguousarray(h.reshape(B * T, C))
        shard = self.logits_shard(h2, reuse=True)
        xent = VocabParallelCrossEntropy(self.comm, ignore_index=ignore_index)
        value = xent(shard, targets.reshape(B * T), vocab_offset=lo)
        ctx.update(xent=xent, h2=h2, xent_logits=shard, capped=self._capped(shard))
        return value

    def head_backward(self, dloss: float = 1.0) -> np.ndarray:
        """The last stage's backward: the last `head_loss`'s gradient into the LM head (tied:
        the embedding's), the gradient (B, T, hidden) of run_blocks's output returned
        (RuntimeError without a head_loss; an all-reduce when tied).

        Parameters
        ----------
        dloss : float, default 1.0
            The gradient of the loss (a scale).
        """
        ctx, comm = self._ctx, self.comm
        if not ctx or "xent" not in ctx:
            raise RuntimeError("TransformerLM.head_backward: call head_loss() first")
        dshard = ctx["xent"].backward(dloss, out=ctx["xent_logits"])  # dlogits over the logits, in place
        self._ctx = None  # (after the cross-entropy's argument checks: a bad dloss keeps the loss)
        dshard = self._uncap(dshard, ctx)
        h2 = ctx["h2"]
        with comm._region("head"):
            if self.lm_head is None:
                dh = _C.linear_backward(np.ascontiguousarray(dshard), h2, self.wte.weight, self.wte.grad_weight,
                                        None, self._head_fmt())
                if comm.size > 1:
                    comm.all_reduce(dh)       # column-parallel head: the input gradient sums over ranks
            else:  # the C layer's backward: logits_shard ran the C layer's forward, not the Python face's
                dh = self.lm_head._c.backward(np.ascontiguousarray(dshard, np.float32))
        return dh.reshape(ctx["B"], ctx["T"], self.config.hidden)

    def blocks_backward(self, dh: np.ndarray) -> np.ndarray:
        """The backward of the last need_backward `run_blocks` (two all-reduces per block):
        the gradient (B, T, hidden) of its input returned.

        Parameters
        ----------
        dh : numpy.ndarray, shape (B, T, hidden), float32
            The gradient of its output (`head_backward`'s, or the next stage's).
        """
        if self.final_norm is not None:
            B, T, C = dh.shape
            dh = self.final_norm.backward(dh.reshape(B * T, C)).reshape(B, T, C)
        for blk in reversed(self.blocks):
            dh = blk.backward(dh)
        return dh

    def embed_backward(self, dh: np.ndarray, pos: np.ndarray, token_type_ids: Optional[np.ndarray] = None) -> None:
        """The first stage's backward: dh into the embeddings' gradients (no collective).

        Parameters
        ----------
        dh : numpy.ndarray, shape (B, T, hidden), float32
            The gradient of `embed`'s output (`blocks_backward`'s).
        pos, token_type_ids
            What `embed` took.
        """
        B, T = pos.shape
        self._alloc_grads()
        dh2 = dh.reshape(B * T, self.config.hidden)
        if self.emb_norm is not None:
            dh2 = self.emb_norm.backward(dh2)
        if self.wpe is not None:
            np.add.at(self.wpe_grad, pos.reshape(-1), dh2)
        if self.tte is not None:
            tt = np.zeros(B * T, np.int64) if token_type_ids is None else \
                np.asarray(token_type_ids, np.int64).reshape(-1)
            np.add.at(self.tte_grad, tt, dh2)
        if self.config.embed_scale is not None:
            dh2 = dh2 * np.float32(self.config.embed_scale)
        self.wte.backward(np.ascontiguousarray(dh2).reshape(B, T, self.config.hidden))  # its forward's shape

    def drop_backward(self) -> None:
        """Forget what the last need_backward forward and head_loss kept (an aborted step)."""
        self._ctx = None

    def __repr__(self):
        c = self.config
        return (f"TransformerLM({c.model_type}: {c.layers} layers, hidden {c.hidden}, heads {c.heads}/{c.kv_heads}, "
                f"vocab {c.vocab_size}{'' if self.dtype == 'float32' else ', ' + self.dtype}; rank {self.comm.rank} "
                f"of {self.comm.size})")
