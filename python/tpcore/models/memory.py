"""Per-rank memory: `estimate_memory` before anything is loaded, and `model_memory` (what
`TransformerLM.memory` reports) of a loaded model, so that the two sit side by side.

A user picks a world size (and a planner a split) from what each rank will hold.  The
estimate counts, per rank, the bytes `TransformerLM.memory()` reports once the model is
loaded and has run the step the arguments describe:

- inference (training=False): the weights in their storage formats, a KV cache of
  batch x max_len tokens (filled: a prompt of max_len tokens), and the workspaces and
  communication buffers of that prefill forward;
- training (training=True): the weights, float32 gradients of every trainable weight,
  the optimizer's state (AdamW: two float32 moments, and a float32 master copy of a
  16-bit weight; SGD with momentum: one), and the workspaces of a forward and backward
  of batch x max_len tokens with the cross-entropy over this rank's vocabulary shard.

The sizes come from the config and the split alone (the same head, MLP and vocabulary
partitions the model takes), the workspaces from the C layers' own arena plans
(csrc/layers: each slice rounded up to TP_DEVICE_ALIGN bytes; registered communication
buffers grow to 1.5x what a call asks for).  Nothing is allocated.
"""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Optional, Tuple

from tpcore.io import formats
from tpcore.utils.args import int_arg, shown
from tpcore.utils.dtypes import block_size, is_quantized, row_bytes, weight_formats
from tpcore.nn.common import MEMORY_KEYS
from tpcore.nn.config import ACTIVATIONS, GATED, NORMS, POSITIONS, Config
from tpcore.nn.partition import partition as partition_dim
from tpcore.nn.partition import partition_sizes
from tpcore.models.norm import _array_device
from tpcore.utils.arrays import device_string

ALIGN = 64            # TP_DEVICE_ALIGN (csrc/include/tpcore/device.h)
QBLOCK = 64           # query rows per block of the CPU attention (csrc/kernels/cpu/attention.c)
MIN_WORK = 1 << 16    # the CPU pool's work per thread (csrc/kernels/cpu/parallel.c)
MAX_THREADS = 64


MODEL_PARTS = ("embedding", "head", "qkv", "out", "fc1", "fc2")
"""The parts of a model whose weights take a storage format each (TransformerLM's dtype keys)."""


def _aligned_heads(cfg: Config, world: int, out_dtype: str) -> Optional[List[int]]:
    """A head split whose output-projection slices (heads x head_dim columns) are whole blocks
    of a quantized out_dtype, when the even split's are not (None: the even split will do, or
    no split can: the layer then names the problem)."""
    blk = block_size(out_dtype)
    if blk <= 1:
        return None
    unit = blk // math.gcd(blk, cfg.head_dim)  # heads per whole number of blocks
    even = partition_dim(cfg.heads, world)
    if all(s * cfg.head_dim % blk == 0 for _, s in even) or cfg.heads % unit:
        return None
    return [s for _, s in partition_dim(cfg.heads, world, align=unit)]


def _a(nbytes: int) -> int:
    """One arena slice: rounded up to the alignment, never empty (csrc/layers/arena.h)."""
    n = max(int(nbytes), 1)
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _reg(nbytes: int) -> int:
    """A registered communication buffer asked for nbytes: 4096 bytes at least, else 1.5x."""
    return 4096 if nbytes <= 4096 else nbytes + nbytes // 2


def _wbytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of a rows x cols weight in storage format fmt."""
    return rows * row_bytes(fmt, cols) if rows and cols else 0


def _plan(rows: int, work: int, threads: int) -> int:
    """tp_parallel_plan: the threads a CPU kernel splits rows x work over."""
    if rows <= 0:
        return 1
    t = min(threads, rows * max(work, 1) // MIN_WORK, rows, MAX_THREADS)
    return max(t, 1)


def _even(n: int, world: int, align: int = 1) -> List[int]:
    """tp_partition's even split in whole align units (the first ranks one unit more)."""
    units, extra = divmod(n // align, world)
    return [(units + (r < extra)) * align for r in range(world)]


def _split(part, n: int, world: int, what: str, who: str, align: int = 1) -> List[int]:
    sizes = partition_sizes(part, n, world, what, f"{who}: {what} partition")
    if sizes is not None:
        return [int(s) for s in sizes]
    if align > 1 and n % align == 0:
        return _even(n, world, align)
    return _even(n, world)


def _source(config_or_dir, who: str) -> Tuple[Config, Optional[Dict[str, str]], Optional[str]]:
    """(config, the file's own weight formats or None, the checkpoint's 16-bit dtype name or None)."""
    if isinstance(config_or_dir, Config):
        return config_or_dir.validate(), None, None
    if isinstance(config_or_dir, dict):
        return Config.from_hf_dict(config_or_dir, "config").validate(), None, None
    if not isinstance(config_or_dir, (str, os.PathLike)):
        raise TypeError(f"{who}: config_or_dir must be a tpcore.Config, a Hugging Face config dict, a checkpoint "
                        f"directory or a .gguf file, got {shown(config_or_dir)}")
    path = os.fspath(config_or_dir)
    from tpcore.models.gguf import gguf_file
    g = gguf_file(path)
    if g is not None:
        from tpcore.models.gguf import GGUFModel
        m = GGUFModel(g, who)
        return m.config, m.model_dtypes(), None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{who}: {path!r} is neither a checkpoint directory nor a .gguf file")
    own = os.path.join(path, formats.OWN_CONFIG)
    if os.path.exists(own):
        cfg = formats.read_own_config(own, Config, {"norm": NORMS, "activation": ACTIVATIONS, "positions": POSITIONS})
        return cfg, None, None
    cfg = Config.from_hf(path)
    kinds = {info.dtype for _, info in formats.read_headers(path).values()} & {"F32", "F64", "BF16", "F16"}
    half = {"BF16": "bfloat16", "F16": "float16"}.get(kinds.pop()) if len(kinds) == 1 else None
    return cfg, None, half


def _heads(cfg: Config, world: int, part, out_fmt: str, who: str) -> List[Tuple[int, int, int, int]]:
    """(q0, nq, k0, nk) per rank, as the block computes them (csrc/layers/block.c)."""
    if part is None:
        part = _aligned_heads(cfg, world, out_fmt)
    sizes = _split(part, cfg.heads, world, "heads", who)
    group = cfg.heads // cfg.kv_heads
    out, q0 = [], 0
    for n in sizes:
        if n:
            kb, ke = q0 // group, (q0 + n - 1) // group + 1
            out.append((q0, n, kb, ke - kb))
        else:
            out.append((q0, 0, 0, 0))
        q0 += n
    return out


def _kv_replicated(heads) -> bool:
    prev = -1
    for _, n, k0, nk in heads:
        if n:
            if k0 < prev:
                return True
            prev = k0 + nk
    return False


def estimate_memory(config_or_dir: Any, world: int, dtype: Any = None, batch: int = 1, max_len: Optional[int] = None,
                    training: bool = False, optimizer: Optional[str] = "adamw", prefill: Optional[int] = None,
                    partition: Any = None,
                    ffn_partition: Any = None, vocab_partition: Any = None, device: str = "cpu",
                    threads: Optional[int] = None, kv_blocks: Any = None) -> List[Dict[str, Any]]:
    """The bytes each rank will hold, before anything is loaded.

    Parameters
    ----------
    config_or_dir : Config, dict, str or os.PathLike
        A `tpcore.Config`, a Hugging Face config.json dict, a checkpoint directory
        (Hugging Face's or `save_pretrained`'s: only the config and the tensors' headers
        are read) or a .gguf file (its metadata).
    world : int
        Ranks, >= 1.
    dtype : str or dict, optional
        The weights' storage, as `TransformerLM`'s dtype (a dict per part, quantized
        formats included).  Default None: what `from_pretrained` picks for the source
        (a GGUF file's own formats; a 16-bit checkpoint's dtype on a GPU; float32).
    batch : int, default 1
        Sequences per step.
    max_len : int, optional
        Tokens per sequence (the KV cache's length; a training step's tokens).  Default:
        config.max_positions.
    prefill : int, optional
        Tokens per sequence of the largest inference forward (the prompt, or a chunk of
        it), at most max_len: the workspaces grow to it.  Default: max_len.
    training : bool, default False
        Gradients, optimizer state and a training step's workspaces instead of a KV cache.
    optimizer : {"adamw", "sgd", "sgd_momentum", None}, default "adamw"
        The optimizer whose state training counts (None: none).
    partition, ffn_partition, vocab_partition : optional
        As TransformerLM's (default None: the same even / block-aligned splits).
    device : str, default "cpu"
        "cpu" or "cuda[:N]": where the layers live (the attention keeps its log-sum-exp
        instead of the probabilities on a GPU).
    threads : int, optional
        Each rank's CPU kernel threads (their per-thread scratch); default what a rank of
        `world` ranks on this host gets (`TPCORE_NUM_THREADS`, else the cores / world).
    kv_blocks : tuple of (int, int), optional
        (num_blocks, block_size): a paged KV cache (`TransformerLM.cache_paged`) instead of
        batch x max_len rows per layer (no sliding-window ring); "kv_cache_used" then
        counts batch x max_len positions, at most the pool.  Default None: not paged.

    Returns
    -------
    list of dict
        One per rank, the keys of `TransformerLM.memory()`: "device", "params", "grads",
        "optimizer", "kv_cache", "kv_cache_used", "workspace", "comm", "total" (bytes).

    Raises
    ------
    TypeError, ValueError
        A bad argument (a partition that does not add up, an unknown dtype).
    FileNotFoundError, CheckpointError
        A path that is not a checkpoint, or a corrupt one.

    Notes
    -----
    No collective; nothing is allocated.
    """
    who = "estimate_memory"
    from tpcore.utils.arrays import resolve_device
    world = int_arg(world, who, "world", lo=1, hi=1 << 20)
    batch = int_arg(batch, who, "batch", lo=1, hi=2 ** 31 - 1)
    if not isinstance(training, bool):
        raise TypeError(f"{who}: training must be a bool, got {shown(training)}")
    if optimizer not in ("adamw", "sgd", "sgd_momentum", None):
        raise ValueError(f"{who}: optimizer must be 'adamw', 'sgd', 'sgd_momentum' or None, got {optimizer!r}")
    dev = resolve_device(device, who)
    gpu = dev[0] != "cpu"
    cfg, file_fmts, half = _source(config_or_dir, who)
    T = cfg.max_positions if max_len is None else int_arg(max_len, who, "max_len", lo=1, hi=2 ** 31 - 1)
    P = T if prefill is None else int_arg(prefill, who, "prefill", lo=1, hi=T)   # checked either way
    P = T if training else P                          # a training step's workspaces follow max_len
    if dtype is None:
        dtype = file_fmts if file_fmts is not None else (half if gpu and half else "float32")
    elif isinstance(dtype, str) and dtype == "gguf" and file_fmts is not None:
        dtype = file_fmts
    dts = weight_formats(dtype, who, MODEL_PARTS)
    if threads is None:   # what each rank of a job of `world` ranks on this host gets by default
        from tpcore.utils.runtime import default_threads as _default_threads
        threads = _default_threads(world)
    threads = int_arg(threads, who, "threads", lo=1, hi=1 << 16)
    if kv_blocks is not None:
        if not isinstance(kv_blocks, (tuple, list)) or len(kv_blocks) != 2:
            raise TypeError(f"{who}: kv_blocks must be (num_blocks, block_size), got {shown(kv_blocks)}")
        kv_blocks = (int_arg(kv_blocks[0], who, "kv_blocks' num_blocks", lo=1, hi=2 ** 31 - 1),
                     int_arg(kv_blocks[1], who, "kv_blocks' block_size", lo=1, hi=2 ** 31 - 1))

    V, F = cfg.vocab_size, cfg.ffn_hidden
    heads = _heads(cfg, world, partition, dts["out"], who)
    kvrep = _kv_replicated(heads)
    blk = block_size(dts["fc2"]) if is_quantized(dts["fc2"]) else 1
    ffn = _split(ffn_partition, F, world, "ffn_hidden", who, align=blk)
    vocab = _split(vocab_partition, V, world, "vocab_size", who)
    devname = "cpu" if not gpu else f"cuda:{dev[1]}"
    out = []
    for r in range(world):
        p = _rank_memory(cfg, dts, heads[r], ffn[r], vocab[r], batch, P, T, kvrep, training, optimizer, gpu,
                         threads, world, r, kv_blocks)
        p["device"] = devname
        p["by_device"] = {devname: p["total"]}   # a GPU model keeps its own arrays there too
        out.append(p)
    return out


def _rank_memory(cfg, dts, head, f, Vr, B, P, T, kvrep, training, optimizer, gpu, threads, world, rank=0,
                 kv_blocks=None):
    """One rank's bytes by MEMORY_KEYS: its heads (q0, nq, k0, nk), f FFN columns and Vr vocabulary
    rows, B sequences, P tokens per inference forward, T tokens of cache (kv_blocks: a paged
    pool of (num_blocks, block_size) instead)."""
    C, D, L = cfg.hidden, cfg.head_dim, cfg.layers
    g = 2 if cfg.activation in GATED else 1
    ln = cfg.norm == "layernorm"
    # sliding layers whose cache is a ring (max_len > 2 window): 2 window rows, prefill in window + 1 pieces
    ring = not training and cfg.causal and cfg.sliding_window is not None and T > 2 * cfg.sliding_window \
        and kv_blocks is None
    Ls = sum(cfg.sliding(i) for i in range(L)) if cfg.sliding_window is not None else 0
    M_embed = B * P   # the embedding runs on the whole prompt; the blocks on pieces of it with a ring
    if ring:
        P = min(P, cfg.sliding_window + 1)
    M = B * P
    _, nq, _, nk = head
    W, A = (nq + 2 * nk) * D, nq * D
    p = dict.fromkeys(MEMORY_KEYS, 0)
    trainable = []                   # (elements, storage dtype, C layer, copies) of each weight with a gradient

    def weight(fmt, rows, cols, k=1):  # a C layer's weight (k copies: one per block): its own aligned slice
        p["params"] += k * _a(_wbytes(fmt, rows, cols))
        if not is_quantized(fmt):
            trainable.append((rows * cols, fmt, True, k))

    def f32(n, c_layer=True, k=1):     # a float32 parameter: a C layer's slice, or a model's NumPy array
        p["params"] += k * (_a(4 * n) if c_layer else 4 * n)
        trainable.append((n, "float32", c_layer, k))

    # the embeddings, and the norms outside the blocks
    weight(dts["embedding"], Vr, C)
    if cfg.positions == "learned":   # the model's own NumPy arrays: exact sizes
        f32(cfg.max_positions * C, False)
    if cfg.type_vocab_size:
        f32(cfg.type_vocab_size * C, False)
    for _ in range(int(cfg.embedding_norm) + int(cfg.final_norm and cfg.pre_norm)):
        for _ in range(2 if ln else 1):
            f32(C, False)
    if not cfg.tie_embeddings:
        weight(dts["head"], Vr, C)
    # the blocks: L of the same sizes (counted once, times L: no loop over a config's layers)
    weight(dts["qkv"], W, C, L)
    if cfg.qkv_bias:
        f32(W, k=L)
    moe = cfg.experts > 0
    for _ in range((2 + 2 * cfg.post_norms) * (2 if ln else 1)):  # norm1, norm2, the post norms (w, b)
        if moe:   # a MoE block's C attention keeps its (unused) norms: bytes and gradients, no optimizer state
            p["params"] += L * _a(4 * C)
            trainable.append((C, "float32", True, -L))
        else:
            f32(C, k=L)
    for _ in range(2 * cfg.qk_norm):                  # q_norm, k_norm
        f32(D, k=L)
    weight(dts["out"], C, A, L)
    if cfg.out_bias:
        f32(C, k=L)
    if moe:   # models/moe_block.py: the norms and the MoE (router, this rank's experts) as NumPy arrays
        E, F = cfg.experts, cfg.ffn_hidden
        tp_mode = E < world   # fewer experts than ranks: every expert split by columns
        n_local = E if tp_mode else E // world + (rank < E % world)
        fl = F // world + (rank < F % world) if tp_mode else F
        for _ in range(2 * (2 if ln else 1)):
            f32(C, False, k=L)
        f32(E * C, False, k=L)
        f32(n_local * 3 * fl * C, False, k=L)
        f = 0
    else:
        weight(dts["fc1"], g * f, C, L)
        if cfg.mlp_bias:
            f32(g * f, k=L)
        weight(dts["fc2"], C, f, L)
        if cfg.mlp_bias:
            f32(C, k=L)
    rows = 2 * cfg.sliding_window if ring else T      # a sliding layer's cache rows
    kinds = [(L - Ls, T), (Ls, rows)] if ring else [(L, T)]
    sh = (0, 0)
    for n, tk in kinds:
        ws_block, comm_block, shared = _block_workspace(cfg, B, P, tk if cfg.causal else P, nq, nk, W, A, f, g,
                                                        kvrep, training, gpu, threads, world)
        p["workspace"] += n * ws_block
        p["comm"] += n * comm_block
        if n:
            sh = (max(sh[0], shared[0]), max(sh[1], shared[1]))
    p["workspace"] += sh[0]
    p["comm"] += sh[1]
    if not training and cfg.causal:   # inference: a cache, no backward
        p["kv_cache"] = sum(n * _a(B * tk * nk * D * 4) * 2 for n, tk in kinds)
        p["kv_cache_used"] = sum(n * 2 * B * min(T, tk) * nk * D * 4 for n, tk in kinds)
        if kv_blocks is not None:   # a pool of num_blocks x block_size rows per layer
            rows = kv_blocks[0] * kv_blocks[1]
            p["kv_cache"] = L * 2 * _a(rows * nk * D * 4)
            p["kv_cache_used"] = L * 2 * min(B * T, rows) * nk * D * 4
    # the embedding's forward
    p["workspace"] += _a(M_embed * 8) + _a(2 * 8)
    if world > 1:
        p["comm"] += _reg(M_embed * C * 4)
    if training:
        # float32 gradients (a C layer's each in its aligned slice); the optimizer's NumPy state
        p["grads"] = sum(abs(k) * (_a(4 * n) if c else 4 * n) for n, _, c, k in trainable)
        trainable = [t for t in trainable if t[3] > 0]   # (k < 0: gradients the optimizer never sees)
        if optimizer == "adamw":
            p["optimizer"] = sum(k * (8 * n + (4 * n if fmt != "float32" else 0)) for n, fmt, _, k in trainable)
        elif optimizer == "sgd_momentum":
            p["optimizer"] = sum(k * (4 * n + (4 * n if fmt != "float32" else 0)) for n, fmt, _, k in trainable)
        elif optimizer == "sgd":
            p["optimizer"] = sum(k * 4 * n for n, fmt, _, k in trainable if fmt != "float32")
        # the logits shard (kept across steps)
        p["workspace"] += M * Vr * 4
        if not cfg.tie_embeddings:   # the head keeps its input for backward, all-reduces its gradient
            p["workspace"] += _a(M * C * 4) + _a(0)
            if world > 1:
                p["comm"] += _reg(M * C * 4)
    p["total"] = sum(p[k] for k in MEMORY_KEYS if k != "kv_cache_used")
    return p


def _block_workspace(cfg, B, T, Tk, nq, nk, W, A, f, g, kvrep, need_bw, gpu, threads,
                     world) -> Tuple[int, int, Tuple[int, int]]:
    """(workspace, communication, shared workspace) bytes of one block after a forward of B x T
    tokens attending to Tk keys (the cache's length), and its backward when need_bw:
    csrc/layers/block.c workspaces(), attention.c, mlp.c, linear.c.  An inference forward
    carves the model's one shared workspace (the third number, counted once), a training
    forward the block's own arenas."""
    C, D, M = cfg.hidden, cfg.head_dim, B * T
    f1 = g * f
    # the attention kernel's scratch (the CPU table: per thread, QBLOCK rows of scores)
    abytes = 0
    if nq and B and T and not gpu:
        Hk = nk if nk else 1
        t = _plan(B * Hk, T * Tk * D * (nq // Hk + 1), threads)
        fwd = 0 if need_bw else QBLOCK * Tk       # forward without kept probabilities: a block of scores
        # backward with the probabilities kept: dP (and the raw scores with a soft-cap)
        bwd = QBLOCK * Tk * (1 + bool(cfg.attn_softcap)) if need_bw else 0
        abytes = t * max(fwd, bwd) * 4
    fixed = _a(8 * M) + 3 * _a(8 * B) + _a(M) + _a(abytes)
    qh = nq + nk if cfg.qk_norm else 0
    pn = int(cfg.post_norms)
    # the families' buffers: Q/K before and after their norms, the norms' rstd, the weights' snapshot;
    # the post norms' input (kept for backward), outputs and statistics
    fam = [M * qh * D, M * qh * D, M * qh, 2 * D if qh and need_bw else 0, pn * M * C if need_bw else 0,
           pn * M * C, pn * M * C] + [pn * M] * 4
    if not need_bw:   # xs s1 h1 s2 n1 n2 mo, qkv, ao, 4 statistics, the MLP's h and a; the rest empty
        floats = [M * C] * 7 + [M * W, M * A] + [M] * 4 + [M * f1, M * f] + [0] * 7 + fam
        shared = sum(_a(4 * n) for n in floats) + fixed
        ws = (1 if cfg.experts else 3) * 2 * _a(0)  # fc1, fc2 (a MoE block has none), the output projection
        # the out projection's and fc2's sums: the shared workspace's one buffer
        return ws, 0, (shared, _reg(M * C * 4))
    kept = B * nq * T if gpu else B * nq * T * T
    floats = [M * C] * 10 + [M * W] * 2 + [M * A] * 2 + [M] * 4 + [kept] + \
        [2 * nk * D * (C + 1) if kvrep else 0] + [0, 0] + fam
    ws = sum(_a(4 * n) for n in floats) + fixed
    comm = _reg(M * C * 4) + _reg(M * C * 4)      # the QKV input gradient's and the out projection's sums
    if kvrep:
        comm += _reg(2 * cfg.kv_heads * D * (C + 1) * 4)
    if cfg.qk_norm and world > 1:
        comm += _reg(2 * D * 4)                   # the Q/K norm weights' gradient sums
    ws += 2 * _a(0)                               # the output projection borrows its input
    if cfg.experts:                               # a MoE block's C attention has no MLP
        return ws, comm, (0, 0)
    bws = _plan(M, f, threads) * f1 * 4 if cfg.mlp_bias else 0
    ws += 2 * _a(M * f1 * 4) + 2 * _a(M * f * 4) + _a(bws)   # h, dh, a, da, the bias backward's scratch
    ws += _a(M * C * 4) + _a(0)                   # fc1 keeps its input
    ws += 2 * _a(0)                               # fc2 borrows its input
    if world > 1:
        comm += 2 * _reg(M * C * 4)               # fc2's all-reduce, fc1's input gradient
    return ws, comm, (0, 0)


def memory_and_estimate(model, batch: int, max_len: int, prefill: int) -> Dict[str, int]:
    """A model's memory() (the largest figures a benchmark prints) and estimate_memory's total for
    the same model, split and run (batch, a cache of max_len, a prompt of prefill tokens),
    computed from its config alone: what the decode benchmark and the report print."""
    got = model.memory()
    est = estimate_memory(model.config, model.comm.size, dtype=model.dtypes, batch=batch, max_len=max_len,
                          prefill=prefill, partition=model.blocks[0].head_partition,
                          ffn_partition=model.blocks[0].ffn_partition, vocab_partition=model.vocab_partition,
                          device=got["device"])[model.comm.rank]
    keys = ("params", "grads", "kv_cache", "kv_cache_used", "workspace", "comm", "total")
    return {**{k: got[k] for k in keys}, "estimate": est["total"]}


def model_memory(model, optimizer: Any = None) -> Dict[str, Any]:
    """`TransformerLM.memory`: the bytes a loaded model holds now, by kind and by device."""
    if optimizer is not None and not callable(getattr(optimizer, "state_bytes", None)):
        raise TypeError(f"TransformerLM.memory: optimizer must have state_bytes() (a tpcore.optim optimizer), "
                        f"got {type(optimizer).__name__}")
    out: Dict[str, Any] = {"device": "cpu" if model.device[0] == "cpu" else device_string(model.device)}
    out.update({k: 0 for k in MEMORY_KEYS})
    by: Dict[str, int] = {}

    def put(dev: str, key: str, nbytes: int) -> None:
        out[key] += int(nbytes)
        if key != "kv_cache_used":
            by[dev] = by.get(dev, 0) + int(nbytes)

    layers = ([model.wte] if model.wte is not None else []) + list(model.blocks) + \
        ([model.lm_head] if model.lm_head is not None else [])
    ctx = model._ctx or {}
    if ctx.get("xent") is not None:  # the last loss's cross-entropy, alive until backward
        layers.append(ctx["xent"])
    for layer in layers:
        m = layer.memory()
        for k in MEMORY_KEYS:
            put(m["device"], k, m[k])
    if model.blocks:  # the blocks' shared inference workspace, once (csrc: tp_block_set_workspace)
        ws, cb = model.blocks[0]._c.shared_workspace_bytes
        put(model.blocks[0].memory()["device"], "workspace", ws)
        put(model.blocks[0].memory()["device"], "comm", cb)
    seen = set()

    def arrays(key: str, *arrs: Any) -> None:
        for a in arrs:
            if a is None or id(a) in seen:
                continue
            seen.add(id(a))
            put(_array_device(a), key, a.nbytes)

    arrays("params", model.wpe, model.tte)
    arrays("grads", model.wpe_grad, model.tte_grad)
    for norm in (model.emb_norm, model.final_norm):
        if norm is not None:
            arrays("params", norm.weight, norm.bias)
            arrays("grads", norm.grad_weight, norm.grad_bias)
    arrays("workspace", getattr(model, "_logits_buf", None), ctx.get("h2"), ctx.get("xent_logits"))
    if optimizer is not None:
        state = getattr(optimizer, "_state_arrays", None)
        if callable(state):  # tpcore's optimizers: each array where it lives
            arrays("optimizer", *state())
        else:
            put(out["device"], "optimizer", optimizer.state_bytes())
    out["total"] = sum(out[k] for k in MEMORY_KEYS if k != "kv_cache_used")
    out["by_device"] = by
    return out
