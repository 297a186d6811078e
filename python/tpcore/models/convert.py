"""`quantize`: a copy of a model with its large weights in another storage format.

The copy is a new `TransformerLM` of the same config, seed and split, filled block by
block from the original's full tensors (each rank keeps its slices of each).
"""
from __future__ import annotations

from typing import Optional

from tpcore.models.lm import TransformerLM
from tpcore.models.state import _hostcopy
from tpcore.utils.dtypes import block_size, weight_format
from tpcore.utils.arrays import device_string

__all__ = ["quantize"]


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
    d = weight_format(fmt, "quantize")
    dtypes = {"qkv": d, "out": d, "fc1": d, "fc2": d, "embedding": weight_format(embedding or d, "quantize"),
              "head": weight_format(head or d, "quantize")}
    cfg, comm = model.config, model.comm
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

