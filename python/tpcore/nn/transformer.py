"""The tensor-parallel Transformer block (Megatron) over the C core.

``TransformerBlock(config, comm)`` is one C object (csrc/layers/transformer.c):
norms, attention with this rank's heads (fused QKV projection, column-parallel;
output projection row-parallel), the parallel MLP, residuals, and a KV cache for
decoding.  Forward does exactly one all-reduce after attention and one after
the MLP; backward mirrors them at the QKV and fc1 inputs.  One C call per block
per step, with the GIL released.

Heads split in whole heads: ``head_partition`` gives the query heads of each
rank (any sizes, e.g. 12 heads on 5 ranks as 3,3,2,2,2, or weighted for
mismatched devices); with grouped-query attention a rank holds the KV heads its
query heads use, so KV heads are split with their groups, or replicated when
there are fewer KV heads than ranks (their weight gradients are then summed over
the ranks that hold them).

Full-tensor names (``load_full`` / ``gather_full``), Hugging Face's shapes:
``norm1.weight``, ``norm1.bias``, ``attn.q.weight`` (heads*D, hidden),
``attn.k.weight``, ``attn.v.weight`` (kv_heads*D, hidden), their ``.bias``,
``attn.out.weight`` (hidden, heads*D), ``attn.out.bias``, ``norm2.*``,
``mlp.fc1.weight`` (ffn, hidden; SwiGLU: (2 ffn, hidden) = [gate; up]),
``mlp.fc1.bias``, ``mlp.fc2.weight`` (hidden, ffn), ``mlp.fc2.bias``.

``device="cuda"`` (or ``"cuda:N"``; default the CPU): parameters, workspaces and the KV cache
live on that GPU; x and dy are float32 DLPack tensors there, outputs tpcore.DeviceArrays there,
``parameters()`` DeviceArray views; pos0 and key_mask stay host arrays (metadata); load_full
cuts the slices on the host and copies them to the GPU.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple, overload

import numpy as np

from tpcore import _C
from tpcore.utils.arrays import asarray, check_on_device, device_string, from_dlpack, resolve_device
from tpcore.distributed.agree import agreed
from tpcore.utils.args import bool_arg, int_arg, minmax, seed_arg
from tpcore.utils.dtypes import FLOAT_FORMATS, is_quantized, weight_formats
from tpcore.distributed.comm import Comm
from tpcore.io.formats import to_float32
from tpcore.nn.common import as_float32, check_grad, dev_back, dev_f32, kept_output, layer_memory, zero
from tpcore.nn.config import GATED, Config
from tpcore.nn.kvcache import block_table_array, positions, slot_array
from tpcore.nn.rotary import RopeState, layer_window
from tpcore.nn.partition import check_partition, partition_sizes
from tpcore.nn.quant import QuantTensor, as_format, dequantize
from tpcore.nn.weights import _host, load_weight


class HeadSplitWarning(UserWarning):
    """A head split that leaves ranks with no attention heads (more ranks than heads, or a
    partition with zeros): those ranks only wait in attention's all-reduce."""


def warn_headless_ranks(split: Sequence[Tuple[int, int]], heads: int, comm: Comm, who: str, blocks: int = 1) -> None:
    """Warns once (a HeadSplitWarning, from rank 0 of comm) when a head split gives some rank no head.

    Parameters
    ----------
    split : list of (int, int)
        Every rank's (offset, count) of query heads.
    heads : int
        The query heads split.
    comm : Comm
        The ranks of the split.
    who : str
        The layer or model named in the message.
    blocks : int, default 1
        How many blocks share the split (the model's warning stands for all of them).
    """
    counts = [int(n) for _, n in split]
    idle = [r for r, n in enumerate(counts) if n == 0]
    if not idle or comm.rank != 0:
        return
    whom = f"rank {idle[0]}" if len(idle) == 1 else f"ranks {', '.join(map(str, idle))}"
    where = f" in each of its {blocks} blocks" if blocks > 1 else ""
    warnings.warn(f"{who}: {heads} attention heads split over {len(counts)} ranks leave {whom} with no heads{where} "
                  f"(heads per rank: {counts}); {'it waits' if len(idle) == 1 else 'they wait'} in attention's "
                  f"all-reduce with nothing to compute.  At most {heads} ranks give every rank heads.",
                  HeadSplitWarning, stacklevel=3)


_PROJ = ("attn.qkv.weight", "attn.out.weight", "mlp.fc1.weight", "mlp.fc2.weight")
_PROJ_KEYS = {"qkv": "attn.qkv.weight", "out": "attn.out.weight", "fc1": "mlp.fc1.weight", "fc2": "mlp.fc2.weight"}


def _block_dtypes(dtype: Any, who: str) -> Dict[str, str]:
    """A block's weight storage per projection: one dtype for all, or a dict with keys "qkv",
    "out", "fc1", "fc2" (missing ones float32), e.g. a GGUF file's mix of formats."""
    return {_PROJ_KEYS[k]: v for k, v in weight_formats(dtype, who, tuple(_PROJ_KEYS)).items()}


class TransformerBlock:
    """One Transformer block (norms, attention, MLP, residuals) split over the ranks.

    Heads are split in whole heads, the MLP by columns (see the module doc for the
    full-tensor names of `load_full` / `gather_full`).

    Parameters
    ----------
    config : Config
        The model's shape (hidden, heads, kv_heads, head_dim, ffn_hidden, norm, eps,
        activation, pre_norm, bias, causal, positions / rope_theta).
    comm : Comm
        The ranks that share the block.
    seed : int, default 0
        The parameters' random stream (an integer in [0, 2**64)): the same logical
        weights at every world size and partition.
    head_partition : list of int or list of (int, int), optional
        Query heads per rank (any sizes adding up to config.heads; `tpcore.partition`'s
        pairs accepted).  Default None: even.  With grouped-query attention a rank holds
        the KV heads its query heads use (replicated when there are fewer KV heads than
        ranks).
    ffn_partition : list of int or list of (int, int), optional
        MLP columns per rank (adding up to config.ffn_hidden).  Default None: even.
    device : str, optional
        "cpu" (default) or "cuda[:N]": parameters, workspaces and KV cache on that GPU.
    dtype : str or dtype, default "float32"
        The projections' weight storage (QKV, output, MLP): "float32", "bfloat16" or
        "float16"; norm weights, biases, activations and gradients stay float32.
    plan : Plan, optional
        A `tpcore.plan_partition` plan giving head_partition and ffn_partition.
    layer : int, optional
        The model's layer this block is, in [0, config.layers): its sliding window
        (config.sliding(layer)) and rotary base (Gemma 3's local layers).  Default None: a
        standalone block (every layer's window, refused when config.layer_types mixes them).

    Attributes
    ----------
    q0, nq, k0, nk : int
        This rank's query heads [q0, q0 + nq) and KV heads [k0, k0 + nk).
    head_partition, ffn_partition : list of (int, int)
        Every rank's (offset, count) of heads and MLP columns.

    Raises
    ------
    TypeError
        config not a Config, comm not a Comm, an argument of the wrong type.
    ValueError
        A partition that does not add up, an unsupported dtype, ranks that disagree.

    Notes
    -----
    Collectives: forward: one all-reduce after attention and one after the MLP (plus one
    small all-gather that checks the ranks agree when pos0, slots or use_cache are
    given); backward: one all-reduce at the QKV input and one at fc1's.  Construction
    all-gathers the partitions.
    """

    _attention_only = False

    def __init__(self, config: Config, comm: Comm, seed: int = 0, head_partition: Optional[Sequence[Any]] = None,
                 ffn_partition: Optional[Sequence[Any]] = None, device: Optional[str] = None, dtype: Any = "float32",
                 plan: Any = None, layer: Optional[int] = None) -> None:
        self.device = resolve_device(device, type(self).__name__)
        self.dtypes = _block_dtypes(dtype, type(self).__name__)
        self.dtype = self.dtypes["attn.qkv.weight"]
        if not isinstance(comm, Comm):
            raise TypeError(f"TransformerBlock: comm must be a tpcore.Comm, got {type(comm).__name__}")
        if not isinstance(config, Config):
            raise TypeError(f"{type(self).__name__}: config must be a tpcore.Config, got {type(config).__name__}")
        cfg = config.validate()
        self.config, self.comm = cfg, comm
        if plan is not None:
            from tpcore.nn.plan import plan_arg
            plan = plan_arg(plan, comm, type(self).__name__, head_partition=head_partition, ffn_partition=ffn_partition)
            plan.check_config(cfg, type(self).__name__)
            head_partition, ffn_partition = plan.heads, plan.ffn
        hp = partition_sizes(head_partition, cfg.heads, comm.size, "heads", f"{type(self).__name__}: head_partition")
        fp = partition_sizes(ffn_partition, cfg.ffn_hidden, comm.size, "ffn_hidden",
                             f"{type(self).__name__}: ffn_partition")
        self.layer = None if layer is None else int_arg(layer, type(self).__name__, "layer", lo=0, hi=cfg.layers - 1)
        self.sliding_window = layer_window(cfg, self.layer, type(self).__name__)
        self._rope = RopeState(cfg, self.layer) if cfg.positions == "rope" else None
        freq, factor = self._rope.initial() if self._rope is not None else (None, 0.0)
        self._c = _C.TransformerBlock(comm._c, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn_hidden,
                                      norm=cfg.norm, eps=float(cfg.eps), activation=cfg.activation,
                                      pre_norm=cfg.pre_norm, bias=cfg.bias, causal=cfg.causal,
                                      rope_theta=self._rope.theta if self._rope is not None else 0.0,
                                      bias_parts=8 | cfg.qkv_bias | cfg.out_bias << 1 | cfg.mlp_bias << 2,
                                      qk_norm=cfg.qk_norm, post_norms=cfg.post_norms,
                                      attn_scale=float(cfg.attn_scale or 0.0),
                                      attn_softcap=float(cfg.attn_softcap or 0.0),
                                      sliding_window=self.sliding_window or 0, rope_inv_freq=freq, rope_factor=factor,
                                      head_partition=hp, ffn_partition=fp, seed=seed_arg(seed, "TransformerBlock"),
                                      attention_only=self._attention_only,
                                      weight_dtype=tuple(self.dtypes[k] for k in _PROJ),
                                      **({} if self.device[0] == "cpu" else {"device": device_string(self.device)}))
        info = self._c.info
        self.q0, self.nq, self.k0, self.nk = info["q0"], info["nq"], info["k0"], info["nk"]
        self.kv_replicated = info["kv_replicated"]
        self.head_partition = check_partition(comm, self.q0, self.nq, cfg.heads, "TransformerBlock heads")
        warn_headless_ranks(self.head_partition, cfg.heads, comm, type(self).__name__)
        self._p = self._c.params()  # (param, grad) views; grad None until _alloc_grads or a backward
        self._grads = False
        g = 2 if cfg.activation in GATED else 1
        self.ffn_local = self._p["mlp.fc1.weight"][0].shape[0] // g if "mlp.fc1.weight" in self._p else 0
        offs = comm.all_gather(np.array([self.ffn_local], np.int64))
        self.ffn_offset = int(offs[:comm.rank].sum())
        self.ffn_partition = [(int(offs[:r].sum()), int(offs[r])) for r in range(comm.size)]

    # ------------------------------------------------------------- parameters
    def _alloc_grads(self) -> None:
        """The gradient buffers, zeroed, if no backward made them yet (a block made for
        inference holds none); the cached views then include them."""
        if not self._grads:
            self._c.alloc_grads()
            self._p = self._c.params()
            self._grads = True

    def _frozen(self, local: str) -> bool:
        """Whether a local tensor is a quantized weight (frozen: no gradient, ever)."""
        return is_quantized(self.dtypes.get(local, "float32"))

    def parameters(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """This rank's (parameter, gradient) pairs (views of C memory), for `tpcore.optim`;
        quantized weights (frozen, no gradient) are left out.  The gradients are allocated
        (zeroed) here if no backward has yet."""
        self._alloc_grads()
        return [pg for name, pg in self._p.items() if not self._frozen(name)]

    def named_parameters(self) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
        """This rank's local tensors by name ("attn.qkv.weight", "mlp.fc1.weight", ...) ->
        (parameter, gradient); the gradient None for a quantized weight (frozen).  Allocates
        the gradients (zeroed) if no backward has yet."""
        self._alloc_grads()
        return dict(self._p)

    def zero_grad(self) -> None:
        """Set every gradient to zero (allocating them if no backward has yet)."""
        self._alloc_grads()
        for _, g in self._p.values():
            if g is not None:
                zero(g)

    def _slices(self):
        """name of a full tensor -> (local param name, rows of the local tensor, how to cut the full one)."""
        cfg, D = self.config, self.config.head_dim
        q = slice(self.q0 * D, (self.q0 + self.nq) * D)
        kv = slice(self.k0 * D, (self.k0 + self.nk) * D)
        nq, nk = self.nq * D, self.nk * D
        lo, n = self.ffn_offset, self.ffn_local
        F = cfg.ffn_hidden
        fc1_rows = (np.r_[lo:lo + n, F + lo:F + lo + n] if cfg.activation in GATED else np.arange(lo, lo + n))
        out = {
            "norm1.weight": ("norm1.weight", slice(None), slice(None)),
            "norm1.bias": ("norm1.bias", slice(None), slice(None)),
            "norm2.weight": ("norm2.weight", slice(None), slice(None)),
            "norm2.bias": ("norm2.bias", slice(None), slice(None)),
            "attn.q.weight": ("attn.qkv.weight", slice(0, nq), q),
            "attn.k.weight": ("attn.qkv.weight", slice(nq, nq + nk), kv),
            "attn.v.weight": ("attn.qkv.weight", slice(nq + nk, nq + 2 * nk), kv),
            "attn.q.bias": ("attn.qkv.bias", slice(0, nq), q),
            "attn.k.bias": ("attn.qkv.bias", slice(nq, nq + nk), kv),
            "attn.v.bias": ("attn.qkv.bias", slice(nq + nk, nq + 2 * nk), kv),
            "attn.out.weight": ("attn.out.weight", slice(None), (slice(None), q)),
            "attn.out.bias": ("attn.out.bias", slice(None), slice(None)),
            "mlp.fc1.weight": ("mlp.fc1.weight", slice(None), fc1_rows),
            "mlp.fc1.bias": ("mlp.fc1.bias", slice(None), fc1_rows),
            "mlp.fc2.weight": ("mlp.fc2.weight", slice(None), (slice(None), slice(lo, lo + n))),
            "mlp.fc2.bias": ("mlp.fc2.bias", slice(None), slice(None)),
            "attn.q_norm.weight": ("attn.q_norm.weight", slice(None), slice(None)),
            "attn.k_norm.weight": ("attn.k_norm.weight", slice(None), slice(None)),
            "attn_post_norm.weight": ("attn_post_norm.weight", slice(None), slice(None)),
            "attn_post_norm.bias": ("attn_post_norm.bias", slice(None), slice(None)),
            "mlp_post_norm.weight": ("mlp_post_norm.weight", slice(None), slice(None)),
            "mlp_post_norm.bias": ("mlp_post_norm.bias", slice(None), slice(None)),
        }
        return {k: v for k, v in out.items() if v[0] in self._p}

    def _local_cols(self, local: str) -> int:
        """Columns (elements) of the rows of a local weight (its raw rows when quantized)."""
        cfg = self.config
        if local == "attn.out.weight":
            return self.nq * cfg.head_dim
        if local == "mlp.fc2.weight":
            return self.ffn_local
        return cfg.hidden

    def full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """The shape of every full tensor of the block, by its full name (module doc)."""
        cfg, D = self.config, self.config.head_dim
        C, H, Hk, F = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden
        g = 2 if cfg.activation in GATED else 1
        shapes = {"norm1.weight": (C,), "norm1.bias": (C,), "norm2.weight": (C,), "norm2.bias": (C,),
                  "attn.q.weight": (H * D, C), "attn.k.weight": (Hk * D, C), "attn.v.weight": (Hk * D, C),
                  "attn.q.bias": (H * D,), "attn.k.bias": (Hk * D,), "attn.v.bias": (Hk * D,),
                  "attn.out.weight": (C, H * D), "attn.out.bias": (C,), "mlp.fc1.weight": (g * F, C),
                  "mlp.fc1.bias": (g * F,), "mlp.fc2.weight": (C, F), "mlp.fc2.bias": (C,),
                  "attn.q_norm.weight": (D,), "attn.k_norm.weight": (D,), "attn_post_norm.weight": (C,),
                  "attn_post_norm.bias": (C,), "mlp_post_norm.weight": (C,), "mlp_post_norm.bias": (C,)}
        return {k: shapes[k] for k in self._slices()}

    def load_full(self, tensors: Dict[str, Any], strict: bool = True) -> None:
        """Keep this rank's slices of the full tensors.

        Parameters
        ----------
        tensors : dict of str to array_like
            Full tensors by name (module doc), of `full_shapes`; any float dtype,
            memory-mapped arrays and lazy views included: only this rank's slices are read.
        strict : bool, default True
            Every tensor of the block must be given and no other.

        Raises
        ------
        KeyError
            strict and a tensor missing or unexpected.
        ValueError
            A tensor of the wrong shape.

        Notes
        -----
        No collective.
        """
        shapes = self.full_shapes()
        if strict:
            missing = sorted(set(shapes) - set(tensors))
            extra = sorted(set(tensors) - set(shapes))
            if missing or extra:
                raise KeyError(f"TransformerBlock.load_full: missing {missing}, unexpected {extra}")
        gpu = self.device[0] != "cpu"
        staged = {}  # a GPU block: host copies of its local tensors, written back whole at the end
        for name, (local, rows, cut) in self._slices().items():
            if name not in tensors:
                continue
            t = tensors[name]  # an array, a memory-mapped array or a lazy view (hf.View): only the cut is read
            if not hasattr(t, "shape") or (not isinstance(t, np.ndarray) and hasattr(t, "__dlpack__")):
                t = asarray(t, name, f"{type(self).__name__}.load_full")
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"TransformerBlock.load_full: {name} has shape {tuple(t.shape)}, "
                                 f"expected {shapes[name]}")
            whole = self._p[local][0]
            fmt = self.dtypes.get(local, "float32")
            quant = is_quantized(fmt)
            if len(shapes[name]) == 2 and not isinstance(t, QuantTensor):
                # a weight: its slice streamed into its rows chunk by chunk (tpcore.io.stream.fill;
                # on a GPU each host chunk copied to the device rows), the slice's shape checked
                # first from the cut (nothing read)
                r, c = (cut if isinstance(cut, tuple) else (cut, None))
                n_rows = np.arange(whole.shape[0])[rows].size
                want = (n_rows, self._local_cols(local)) if quant else (n_rows,) + tuple(whole.shape[1:])
                got = (np.arange(shapes[name][0])[r].size, np.arange(shapes[name][1])[c if c is not None else
                                                                                   slice(None)].size)
                if got != want:
                    raise ValueError(f"TransformerBlock.load_full: {name}: slice has shape {got}, expected {want}")
                if want[0]:
                    who = f"TransformerBlock.load_full: {name}"
                    if local in staged:
                        load_weight(staged[local][rows], fmt, t, r, c, who)
                    elif gpu:
                        load_weight(whole, fmt, t, r, c, who, at=rows.start or 0)
                    else:
                        load_weight(whole[rows], fmt, t, r, c, who)
                continue
            if gpu:
                if local not in staged:
                    staged[local] = np.array(whole.to_numpy()) if quant else np.array(whole.to_numpy(), np.float32)
                whole = staged[local]
            dst = whole[rows]
            want = (dst.shape[0], self._local_cols(local)) if quant else dst.shape
            part = t[cut]
            part = np.asarray(part) if isinstance(part, np.ndarray) else part
            if tuple(np.shape(part)) != want:
                raise ValueError(f"TransformerBlock.load_full: {name}: slice has shape {np.shape(part)}, "
                                 f"expected {want}")
            if quant:  # raw rows: a QuantTensor of this format as it is, anything else quantized
                if want[0]:
                    whole[rows] = as_format(part, fmt, f"TransformerBlock.load_full: {name}")
                continue
            whole[rows] = to_float32(part)
        for local, host in staged.items():  # host -> the GPU, one copy per local tensor
            self._p[local][0][...] = host

    def gather_full(self, grads: bool = False) -> Dict[str, np.ndarray]:
        """The full tensors (or their gradients) rebuilt from every rank.

        Parameters
        ----------
        grads : bool, default False
            The gradients instead of the parameters.

        Returns
        -------
        dict of str to numpy.ndarray
            By full name, of `full_shapes`; quantized weights as float32 (dequantized), and
            with grads=True without them (frozen: no gradient).

        Notes
        -----
        Collective: all-gathers over comm.
        """
        cfg, D, comm = self.config, self.config.head_dim, self.comm
        if grads:
            self._alloc_grads()
        shapes = self.full_shapes()
        out = {}
        which = 1 if grads else 0
        # attention rows/cols by head; replicated KV heads are identical on their ranks: keep one
        heads = comm.all_gather(np.array([self.q0, self.nq, self.k0, self.nk], np.int64)).reshape(-1, 4)
        for name, (local, rows, _cut) in self._slices().items():
            if grads and self._frozen(local):  # a quantized weight's gradient: none (frozen)
                continue
            mine = np.ascontiguousarray(_host(self._p[local][which])[rows])
            if which == 0 and is_quantized(self.dtypes.get(local, "float32")):  # gathered as float32
                mine = dequantize(mine, self.dtypes[local], self._local_cols(local)) if mine.shape[0] else \
                    np.zeros((0, self._local_cols(local)), np.float32)
            shape = shapes[name]
            if name.startswith(("norm", "attn.out.bias", "mlp.fc2.bias", "attn.q_norm", "attn.k_norm",
                                "attn_post_norm", "mlp_post_norm")):
                out[name] = mine.copy()
                continue
            if name == "attn.out.weight":
                out[name] = comm.all_gather(mine, axis=1, sizes=[int(h[1]) * D for h in heads])
                continue
            if name.startswith("mlp.fc2.weight"):
                out[name] = comm.all_gather(mine, axis=1, sizes=[s for _, s in self.ffn_partition])
                continue
            if name.startswith("mlp.fc1"):
                g = 2 if cfg.activation in GATED else 1
                blocks = comm.all_gather(mine, sizes=[g * s for _, s in self.ffn_partition])
                if g == 2:
                    o, gates, ups = 0, [], []
                    for _, s in self.ffn_partition:
                        gates.append(blocks[o:o + s])
                        ups.append(blocks[o + s:o + 2 * s])
                        o += 2 * s
                    blocks = np.concatenate(gates + ups)
                out[name] = blocks
                continue
            # q/k/v weight or bias: rank-major head blocks
            is_q = name.startswith("attn.q")
            sizes = [int(h[1] if is_q else h[3]) * D for h in heads]
            blocks = comm.all_gather(mine, sizes=sizes)
            full = np.zeros(shape, mine.dtype)  # the parameter's own dtype (a 16-bit weight stays so)
            o = 0
            for h in heads:
                first, count = (int(h[0]), int(h[1])) if is_q else (int(h[2]), int(h[3]))
                full[first * D:(first + count) * D] = blocks[o:o + count * D]
                o += count * D
            out[name] = full
        return out

    def memory(self) -> Dict[str, Any]:
        """The bytes this rank's shard holds now, by kind.

        Returns
        -------
        dict
            The keys of `ColumnParallelLinear.memory`: "params" (the QKV, output and MLP
            weights in their storage formats, biases and norms), "grads" (the gradient
            buffers that exist), "kv_cache" (the K and V caches of `cache`: 2 x batch x
            max_len x this rank's KV heads x head_dim x 4 bytes), "kv_cache_used" (of
            which written: each cache sequence up to the highest position written; a new
            `cache` clears it), "workspace" (the activations and attention scratch of
            the largest batch seen, the MLP's and the output projection's), "comm" (the
            collective buffers), "total".
        """
        return layer_memory(self._c.memory())

    # ---------------------------------------------------------------- compute
    def cache(self, batch: int, max_len: int) -> None:
        """(Re)allocate the KV cache of this rank's KV heads (for use_cache forwards).

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
        batch = int_arg(batch, f"{type(self).__name__}.cache", "batch", lo=1, hi=2 ** 31 - 1)
        max_len = int_arg(max_len, f"{type(self).__name__}.cache", "max_len", lo=1, hi=2 ** 31 - 1)
        self._c.cache(batch, max_len)
        self._filled = np.zeros(batch, np.int64)  # tokens cached per sequence (a forward may not skip past them)
        self._cache_len, self._paged = max_len, None

    def cache_paged(self, num_blocks: int, block_size: int) -> None:
        """(Re)allocate the KV cache as a pool of blocks (contents reset): forwards with use_cache
        then take a ``block_table`` (B, cols), row b's position p in block ``block_table[b, p //
        block_size]`` at row ``p % block_size`` (a sliding-window layer masks the keys outside
        its window: no ring).  Memory: 2 x num_blocks x block_size x this rank's KV heads x
        head_dim x 4 bytes ("kv_cache" of `memory`).

        Parameters
        ----------
        num_blocks : int
            Blocks in the pool, >= 1.
        block_size : int
            Positions per block, >= 1.
        """
        who = f"{type(self).__name__}.cache_paged"
        num_blocks = int_arg(num_blocks, who, "num_blocks", lo=1, hi=2 ** 31 - 1)
        block_size = int_arg(block_size, who, "block_size", lo=1, hi=2 ** 31 - 1)
        self._c.cache_paged(num_blocks, block_size)
        self._filled, self._cache_len, self._paged = None, 0, (num_blocks, block_size)

    @overload
    def forward(self, x: np.ndarray, pos0: Any = None, key_mask: Any = None, use_cache: bool = False,
                need_backward: bool = True, _agreed: bool = False, slots: Any = None,
                block_table: Any = None) -> np.ndarray: ...
    @overload
    def forward(self, x: Any, pos0: Any = None, key_mask: Any = None, use_cache: bool = False,
                need_backward: bool = True, _agreed: bool = False, slots: Any = None,
                block_table: Any = None) -> Any: ...
    def forward(self, x: Any, pos0: Any = None, key_mask: Any = None, use_cache: bool = False,
                need_backward: bool = True, _agreed: bool = False, slots: Any = None,
                block_table: Any = None) -> Any:
        """The block's output for x (also ``block(x)``).

        Parameters
        ----------
        x : array_like, shape (B, T, hidden)
            The full input on every rank; float32 (16-bit floats computed in float32, the
            output in x's dtype).  On a GPU block: a DLPack tensor on its device.
        pos0 : array_like of int, shape (B,), optional
            The position of each sequence's first token (decoding).  Default None: 0.
        key_mask : array_like, shape (B, T), optional
            Nonzero for the tokens to attend to (padding is 0).  Default None: all.
        use_cache : bool, default False
            Append the keys and values to the KV cache (`cache`) and attend to what it
            holds (causal models).
        need_backward : bool, default True
            False skips saving what backward needs (inference).
        slots : array_like of int, shape (B,), optional
            With use_cache: the KV-cache sequence of each batch row, each in [0, cache
            batch) and none twice (continuous batching, `tpcore.Engine`).  Default None:
            row b uses sequence b.
        block_table : array_like of int, shape (B, cols), optional
            With use_cache over a paged cache (`cache_paged`; required there): the blocks
            of each row, entries < 0 for none (`tpcore.nn.kvcache.block_table_array`).

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (B, T, hidden)
            The same on every rank.

        Raises
        ------
        TypeError, ValueError
            A bad argument (shape, dtype, range), a cache too small or not allocated, a
            forward that skips past the cached tokens, or (with pos0, slots or use_cache)
            ranks that passed different pos0, slots, B, T or use_cache: ValueError on every
            rank.
        CommError, CommTimeout
            A collective failed.

        Notes
        -----
        Collectives: one all-reduce after attention, one after the MLP; plus one small
        all-gather with pos0, slots or use_cache.
        """
        if _agreed:  # from TransformerLM.forward, which checked every argument and that the ranks agree
            dt = None
            if self.device[0] != "cpu":
                x, dt = self._device_x(x, "x", type(self).__name__)
            B, T, C = x.shape
            kept_output(self, None)
            self._update_rope(pos0, T)
            y = self._c.forward(x.reshape((B * T, C)), B, T, pos0=pos0, key_mask=None if key_mask is None else
                                key_mask.reshape(-1), use_cache=use_cache, need_backward=need_backward, slots=slots,
                                block_table=block_table)
            kept_output(self, (B, T, C) if need_backward else None)
            if use_cache and self._filled is not None:
                self._filled[slice(None, B) if slots is None else slots] = T if pos0 is None else pos0 + T
            return dev_back(y, dt).reshape((B, T, C))
        who = type(self).__name__
        gpu = self.device[0] != "cpu"
        cached = bool(use_cache) if isinstance(use_cache, (bool, np.bool_)) else True  # (a bad value: refused below)
        io_dt = [None]  # a GPU block's 16-bit input dtype: the output goes back in it

        def inputs():
            if gpu:
                x32, io_dt[0] = self._device_x(x, "x", who)
            else:
                x32 = as_float32(x, "x", who)
            if x32.ndim != 3 or x32.shape[-1] != self.config.hidden:
                raise ValueError(f"{who}: x must have shape (B, T, {self.config.hidden}), got {tuple(x32.shape)}")
            B, T, _ = x32.shape
            bool_arg(use_cache, who, "use_cache")
            bool_arg(need_backward, who, "need_backward")
            p = None if pos0 is None else positions(pos0, B, who)
            m = None if key_mask is None else mask_array(key_mask, B, T, who, "key_mask").reshape(-1)
            sl = None if slots is None else self._slots(slots, B, use_cache, who)
            bt = block_table_array(block_table, B, T, p, getattr(self, "_paged", None), use_cache, sl, who)
            if use_cache and bt is None:
                self._check_cache(p, B, T, who, sl)
            return x32, p, m, sl, bt

        x32, p, m, sl, bt = agreed(self.comm, f"{who}.forward", pos0 is not None or slots is not None or cached,
                                   inputs, lambda v: [("the batch shape (B, T) differs", v[0].shape[:2]),
                                                      ("pos0 differs", (v[1],)), ("key_mask differs", (v[2],)),
                                                      ("slots differ", (v[3],)), ("block_table differs", (v[4],)),
                                                      ("use_cache differs", (bool(use_cache),))])
        B, T, C = x32.shape
        kept_output(self, None)  # (a forward that fails in C keeps nothing: its backward is refused, naming why)
        self._update_rope(p, T)
        y = self._c.forward(x32.reshape((B * T, C)), B, T, pos0=p, key_mask=m, use_cache=use_cache,
                            need_backward=need_backward, slots=sl, block_table=bt)
        kept_output(self, (B, T, C) if need_backward else None)
        if use_cache and self._filled is not None:
            self._filled[slice(None, B) if sl is None else sl] = T if p is None else p + T
        return dev_back(y, io_dt[0]).reshape((B, T, C))

    def _update_rope(self, pos0: Optional[np.ndarray], T: int) -> None:
        """The rotary frequencies of a scaling that depends on the length (dynamic NTK, LongRoPE)
        for this forward's longest position, as transformers picks them."""
        if self._rope is None or not self._rope.dynamic:
            return
        seq = (int(np.max(pos0)) if pos0 is not None and len(pos0) else 0) + T
        new = self._rope.for_length(seq)
        if new is not None:
            self._c.set_rope(*new)

    def _slots(self, slots, B, use_cache, who):
        """slots as B distinct int64 cache sequences in [0, cache batch) (a ValueError naming the
        first bad one otherwise)."""
        return slot_array(slots, B, None if getattr(self, "_filled", None) is None else self._filled.size,
                          use_cache, who)

    def _device_x(self, x, name: str, who: str):
        """A GPU block's activation: a float32, bfloat16 or float16 DLPack tensor on its device (a
        TypeError naming the block, the argument and both devices otherwise), as a float32
        DeviceArray (a view, or the 16-bit one converted on the GPU) and the dtype to give the
        result back in (None: float32).  pos0 and key_mask stay host arrays (metadata the block
        copies itself)."""
        check_on_device(x, name, who, self.device)
        if not hasattr(x, "__dlpack__"):
            raise TypeError(f"{who}: {name} must be a tensor on {device_string(self.device)} (a tpcore.DeviceArray "
                            f"or any DLPack tensor), got {type(x).__name__}")
        xa = from_dlpack(x)
        if xa.dtype not in FLOAT_FORMATS:
            raise TypeError(f"{who}: {name} must be float32, bfloat16 or float16 on {device_string(self.device)}, "
                            f"got {xa.dtype}")
        return dev_f32(xa)

    def _check_cache(self, p, B, T, who, slots=None):
        filled = getattr(self, "_filled", None)
        if filled is None:
            raise ValueError(f"{who}: use_cache=True needs a KV cache: call cache(batch, max_len) first")
        if p is None or not B or not T:  # an empty forward writes and reads nothing
            return
        if B > filled.size or minmax(p)[1] + T > self._cache_len:
            return  # the C layer names the cache's batch or length
        seq = list(range(B)) if slots is None else slots.tolist()
        pl, fl = p.tolist(), filled[seq].tolist()
        for b in range(B):
            if pl[b] > fl[b]:
                raise ValueError(f"{who}: pos0[{b}] = {pl[b]} skips past the {fl[b]} tokens cached for sequence "
                                 f"{seq[b]}; a cached forward continues a sequence (pos0 <= its cached length)")

    __call__ = forward

    @overload
    def backward(self, dy: np.ndarray) -> np.ndarray: ...
    @overload
    def backward(self, dy: Any) -> Any: ...
    def backward(self, dy: Any) -> Any:
        """The input gradient for the last forward; accumulates every gradient.

        Parameters
        ----------
        dy : array_like, shape (B, T, hidden)
            The gradient of forward's output: exactly its shape (the same on every rank).

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (B, T, hidden)
            The gradient of x.

        Raises
        ------
        TypeError, ValueError
            dy of a wrong dtype or layout; a ValueError naming both shapes when dy's shape
            is not the last forward's output's (B, T, hidden): (T, B, hidden) is refused.
        RuntimeError
            No forward with need_backward ran before.

        Notes
        -----
        Collectives: one all-reduce at the QKV input and one at fc1's input.
        """
        C = self.config.hidden
        self._alloc_grads()  # (the C block would make them too; this keeps the cached views current)
        if self.device[0] != "cpu":  # dy a tensor on the block's GPU; dx a DeviceArray there, in dy's dtype
            d, dt = self._device_x(dy, "dy", type(self).__name__)
            if d.ndim < 1 or d.shape[-1] != C:
                raise ValueError(f"{type(self).__name__}: dy must have shape (B, T, {C}), got {tuple(d.shape)}")
            check_grad(self, d.shape)
            shape = tuple(d.shape)
            return dev_back(self._c.backward(d.reshape((d.size // C, C))), dt).reshape(shape)
        d = as_float32(dy, "dy", type(self).__name__)
        if d.ndim < 1 or d.shape[-1] != C:
            raise ValueError(f"{type(self).__name__}: dy must have shape (B, T, {C}), got {d.shape}")
        check_grad(self, d.shape)
        shape = d.shape
        return self._c.backward(d.reshape(-1, C)).reshape(shape)

    def __repr__(self) -> str:
        return (f"TransformerBlock(hidden={self.config.hidden}, heads {self.q0}:{self.q0 + self.nq} and kv heads "
                f"{self.k0}:{self.k0 + self.nk} on rank {self.comm.rank})")


def mask_array(mask, B: int, T: int, who: str, name: str) -> np.ndarray:
    """A (B, T) mask of bools or numbers (non-zero: attend) as uint8 (C-contiguous)."""
    m = asarray(mask, name, who)
    if m.dtype.kind not in "biuf":
        raise TypeError(f"{who}: {name} must be a (B, T) array of bools or 0/1 numbers, got dtype {m.dtype}")
    if m.shape != (B, T):
        raise ValueError(f"{who}: {name} must have shape (B, T) = {(B, T)}, got {m.shape}")
    return np.ascontiguousarray(m != 0, np.uint8)


class ParallelAttention(TransformerBlock):
    """Attention alone, heads split over the ranks (Megatron).

    Fused QKV projection (column-parallel), rotary positions when config.positions ==
    "rope", causal or bidirectional softmax attention with a padding mask, grouped-query
    heads, a KV cache, and the row-parallel output projection: y = attn(x).  No norms,
    MLP or residual (those are TransformerBlock's).  Parameters: attn.q/k/v/out weights
    (and biases).

    Parameters
    ----------
    config : Config
        hidden, heads, kv_heads, head_dim, bias, causal, positions / rope_theta are used.
    comm : Comm
        The ranks that share the heads.
    seed : int, default 0
        As `TransformerBlock`.
    head_partition : list of int or list of (int, int), optional
        Query heads per rank (default None: even).
    ffn_partition : None
        Unused (no MLP); accepted for the signature's sake.
    device : str, optional
        "cpu" (default) or "cuda[:N]".
    dtype : str or dtype, default "float32"
        The projections' weight storage.
    plan : Plan, optional
        A `tpcore.plan_partition` plan giving head_partition.
    layer : int, optional
        The model's layer this block is, in [0, config.layers): its sliding window
        (config.sliding(layer)) and rotary base (Gemma 3's local layers).  Default None: a
        standalone block (every layer's window, refused when config.layer_types mixes them).

    Raises
    ------
    TypeError, ValueError
        As `TransformerBlock`.

    Notes
    -----
    Collectives: one all-reduce in forward, one (at the QKV input) in backward.
    """

    _attention_only = True

    def __repr__(self) -> str:
        return (f"ParallelAttention(hidden={self.config.hidden}, heads {self.q0}:{self.q0 + self.nq} and kv heads "
                f"{self.k0}:{self.k0 + self.nk} on rank {self.comm.rank})")


def build_blocks(cfg: Config, comm: Comm, seeds: Sequence[int], head_partition: Any, ffn_partition: Any,
                 device: Any, dtype: Any, who: str, layers: Optional[Sequence[int]] = None) -> List["TransformerBlock"]:
    """One TransformerBlock per seed (of the model's layers `layers`: their windows and rotary
    bases), all on one head and FFN split; a split that leaves some rank without heads warns
    once for them all (`HeadSplitWarning`), not once per block."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadSplitWarning)
        layers = [None] * len(seeds) if layers is None else list(layers)
        blocks = [TransformerBlock(cfg, comm, seed=s, head_partition=head_partition, ffn_partition=ffn_partition,
                                   device=device, dtype=dtype, layer=i) for s, i in zip(seeds, layers)]
    if blocks:
        warn_headless_ranks(blocks[0].head_partition, cfg.heads, comm, who, len(blocks))
    return blocks
