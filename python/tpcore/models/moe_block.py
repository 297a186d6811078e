"""The MoE decoder layer (Mixtral): `MoEBlock`, norm1 -> attention -> residual -> norm2 -> sparse
MoE MLP -> residual, forward and backward, with attention's KV cache for generation.

The attention is `TransformerBlock`'s C attention alone (heads split over the block's comm,
its KV cache, pos0 / key_mask / slots as TransformerBlock's); the two norms are replicated
(the C norm kernels); the MLP is a `tpcore.nn.moe.MoE`.  `TransformerLM` makes these blocks
when config.experts > 0 (`build_blocks` here: MoE blocks for a MoE config, else
tpcore.nn.transformer.build_blocks's).

Full-tensor names: TransformerBlock's norm1.*, attn.*, norm2.* and, for the MoE,
``moe.router.weight`` (experts, hidden), ``moe.experts.{e}.fc1.weight`` (2F, hidden)
[gate; up], ``moe.experts.{e}.fc2.weight`` (hidden, F), F = config.ffn_hidden.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from tpcore.distributed.comm import Comm
from tpcore.models.norm import _Norm
from tpcore.nn.common import as_float32, layer_memory
from tpcore.nn.config import Config
from tpcore.nn.moe import MoE
from tpcore.nn.transformer import HeadSplitWarning, TransformerBlock, warn_headless_ranks
from tpcore.nn.transformer import build_blocks as _dense_blocks
from tpcore.utils.args import shown
from tpcore.utils.dtypes import weight_formats

__all__ = ["MoEBlock", "build_blocks", "expert_bytes"]


class MoEBlock(TransformerBlock):
    """A Mixtral decoder layer: x + attn(norm1(x)), then + moe(norm2(.)) (module doc).

    Parameters
    ----------
    config : Config
        config.experts > 0, experts_per_token, norm_topk_prob; ffn_hidden is each
        expert's width; activation "swiglu"; pre-norm.
    comm : Comm
        The attention's ranks (heads split as TransformerBlock's).  Without ep, the MoE
        runs over comm too, on the same tokens (replicated): expert_mode "ep" (whole experts
        per rank; the default when experts >= comm.size) or "tp" (every expert split by
        columns; the default for fewer experts than ranks).
    seed : int, default 0
        The parameters' random stream.
    head_partition : optional
        As TransformerBlock's.
    ffn_partition : None
        (No dense MLP; must be None.)
    device : str, optional
        "cpu" only.
    dtype : str, dtype or dict, default "float32"
        The attention projections' storage ("qkv", "out"); the experts are float32.
    plan : optional
        As TransformerBlock's (heads only).
    layer : int, optional
        The model's layer it is (its sliding window and rotary base), as TransformerBlock's.
    ep : Comm, optional
        The expert-parallel group of a `ProcessGrid` (grid.ep): the MoE's experts spread over
        it in mode "ep", each of its ranks with its own tokens.
    expert_mode : {"ep", "tp"}, optional
        (Without ep) how the experts split over comm.
    expert_partition : list of int, optional
        Experts per rank of the MoE's group (mode "ep").

    Attributes
    ----------
    norm1, norm2 : the replicated norms
    moe : MoE

    Raises
    ------
    TypeError, ValueError
        As TransformerBlock's; a dense config (experts 0), another activation than swiglu,
        a post-norm config or post norms, MLP biases, a quantized expert dtype, a GPU device.
    """

    _attention_only = True

    def __init__(self, config: Config, comm: Comm, seed: int = 0, head_partition: Optional[Sequence[Any]] = None,
                 ffn_partition: Optional[Sequence[Any]] = None, device: Optional[str] = None, dtype: Any = "float32",
                 plan: Any = None, layer: Optional[int] = None, ep: Optional[Comm] = None,
                 expert_mode: Optional[str] = None, expert_partition: Optional[Sequence[int]] = None) -> None:
        who = "MoEBlock"
        if not isinstance(config, Config):
            raise TypeError(f"{who}: config must be a tpcore.Config, got {type(config).__name__}")
        cfg = config.validate()
        if not cfg.experts:
            raise ValueError(f"{who}: config.experts is 0 (a dense MLP): use TransformerBlock")
        if cfg.activation != "swiglu" or not cfg.pre_norm or cfg.post_norms:
            raise ValueError(f"{who}: experts are SwiGLU MLPs in a pre-norm block without post norms (Mixtral); got "
                             f"activation {cfg.activation!r}, pre_norm={cfg.pre_norm}, post_norms={cfg.post_norms}")
        if cfg.bias if cfg.mlp_bias is None else cfg.mlp_bias:
            raise ValueError(f"{who}: the experts have no biases; got a config with MLP biases (bias={cfg.bias}, "
                             f"mlp_bias={cfg.mlp_bias})")
        if ffn_partition is not None:
            raise ValueError(f"{who}: ffn_partition is for a dense MLP; the experts split by expert_partition")
        if device is not None and not str(device).startswith("cpu"):
            raise ValueError(f"{who}: device must be 'cpu' (the MoE layer runs on the host), got {shown(device)}")
        dts = weight_formats(dtype, who, ("qkv", "out", "fc1", "fc2"))
        for k in ("fc1", "fc2"):
            if dts[k] != "float32":
                raise ValueError(f"{who}: the experts are float32; got {dts[k]!r} for {k}")
        if ep is not None and not isinstance(ep, Comm):
            raise TypeError(f"{who}: ep must be a tpcore.Comm (grid.ep) or None, got {shown(ep)}")
        if ep is not None and expert_mode not in (None, "ep"):
            raise ValueError(f"{who}: with ep the experts split by expert (expert_mode 'ep'), got {expert_mode!r}")
        attn_dt = {"qkv": dts["qkv"], "out": dts["out"], "fc1": "float32", "fc2": "float32"}
        super().__init__(cfg, comm, seed=seed, head_partition=head_partition, device=None, dtype=attn_dt, plan=plan,
                         layer=layer)
        C = cfg.hidden
        self.norm1 = _Norm(cfg.norm, C, cfg.eps)
        self.norm2 = _Norm(cfg.norm, C, cfg.eps)
        group = comm if ep is None else ep
        mode = expert_mode or ("ep" if ep is not None or cfg.experts >= comm.size else "tp")
        self.moe = MoE(C, cfg.ffn_hidden or 0, cfg.experts, cfg.experts_per_token, group, mode=mode,
                       norm_topk_prob=cfg.norm_topk_prob, replicated=ep is None, expert_partition=expert_partition,
                       seed=(int(seed) + 17) % 2 ** 64)
        self._merge()

    # ------------------------------------------------------------- parameters
    def _merge(self) -> None:
        """_p: the attention's C tensors, the norms' and the MoE's, by local name -> (param,
        grad or None)."""
        p = dict(self._c.params())
        for name, n in (("norm1", self.norm1), ("norm2", self.norm2)):
            p[f"{name}.weight"] = (n.weight, n.grad_weight)
            if n.bias is not None:
                p[f"{name}.bias"] = (n.bias, n.grad_bias)
        m = self.moe
        p["moe.router.weight"] = (m.router, m.grad_router)
        for e in m.experts_local:
            p[f"moe.experts.{e}.fc1.weight"] = (m.fc1[e], m.grad_fc1.get(e))
            p[f"moe.experts.{e}.fc2.weight"] = (m.fc2[e], m.grad_fc2.get(e))
        self._p = p

    def _alloc_grads(self) -> None:
        if not self._grads:
            self._c.alloc_grads()
            self._grads = True
        self.norm1._alloc_grads()
        self.norm2._alloc_grads()
        self.moe._alloc_grads()
        self._merge()

    def expert_parameters(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """This rank's experts' (parameter, gradient) pairs (`ProcessGrid.average_gradients`)."""
        self._alloc_grads()
        return self.moe.expert_parameters()

    def full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """Every full tensor's shape by its full name (module doc)."""
        out = super().full_shapes()
        out.update({f"moe.{k}": v for k, v in self.moe.full_shapes().items()})
        return out

    def load_full(self, tensors: Dict[str, Any], strict: bool = True) -> None:
        """Keep this rank's part of the full tensors (attention heads, norms, its experts: the
        other experts' tensors are not read).  As TransformerBlock.load_full."""
        shapes = self.full_shapes()
        if strict:
            missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
            if missing or extra:
                raise KeyError(f"MoEBlock.load_full: missing {missing}, unexpected {extra}")
        super().load_full({k: v for k, v in tensors.items() if not k.startswith("moe.")}, strict=False)
        self.moe.load_full({k[4:]: v for k, v in tensors.items() if k.startswith("moe.")}, strict=False)

    def gather_full(self, grads: bool = False) -> Dict[str, np.ndarray]:
        """The full tensors (or gradients) rebuilt from every rank (collective)."""
        out = super().gather_full(grads)
        out = {k: v for k, v in out.items() if not k.startswith("moe.")}
        out.update({f"moe.{k}": v for k, v in self.moe.gather_full(grads).items()})
        return out

    def memory(self) -> Dict[str, Any]:
        """The attention's bytes (TransformerBlock.memory's keys) plus the norms' and the
        MoE's parameters and gradients."""
        c = self._c.memory()
        mine = [pg for k, pg in self._p.items() if not k.startswith("attn.")]
        return layer_memory(c, params=sum(p.nbytes for p, _ in mine),
                            grads=sum(g.nbytes for _, g in mine if g is not None))

    def expert_bytes_read(self) -> int:
        """The expert weight bytes this rank read in the last forward (only experts with tokens
        run their GEMMs: a decode step reads top-k experts' weights, not all)."""
        return int(self.moe.bytes_read["experts"])

    # ---------------------------------------------------------------- compute
    def forward(self, x: Any, pos0: Any = None, key_mask: Any = None, use_cache: bool = False,
                need_backward: bool = True, _agreed: bool = False, slots: Any = None,
                block_table: Any = None) -> Any:
        """The layer's output for x (B, T, hidden); the arguments as TransformerBlock.forward's.

        Notes
        -----
        Collectives: attention's all-reduce, then the MoE's (module doc of tpcore.nn.moe).
        """
        C = self.config.hidden
        x = as_float32(x, "x", "MoEBlock")
        if x.ndim != 3 or x.shape[-1] != C:
            raise ValueError(f"MoEBlock: x must have shape (B, T, {C}), got {tuple(x.shape)}")
        B, T, _ = x.shape
        x2 = x.reshape(B * T, C)
        h = self.norm1.forward(np.ascontiguousarray(x2))
        a = super().forward(h.reshape(B, T, C), pos0=pos0, key_mask=key_mask, use_cache=use_cache,
                            need_backward=need_backward, _agreed=_agreed, slots=slots, block_table=block_table)
        x1 = x2 + np.asarray(a).reshape(B * T, C)
        h2 = self.norm2.forward(np.ascontiguousarray(x1, np.float32))
        y = x1 + self.moe.forward(h2, need_backward=need_backward)
        return np.ascontiguousarray(y, np.float32).reshape(B, T, C)

    __call__ = forward

    def backward(self, dy: Any) -> Any:
        """The input gradient for the last forward; accumulates every gradient (and the
        load-balancing loss's, when `tpcore.nn.moe.load_balancing_loss` registered it).

        Notes
        -----
        Collectives: the MoE's, then attention's all-reduce.
        """
        C = self.config.hidden
        d = as_float32(dy, "dy", "MoEBlock.backward")
        if d.ndim != 3 or d.shape[-1] != C:
            raise ValueError(f"MoEBlock: dy must have shape (B, T, {C}), got {tuple(d.shape)}")
        want = getattr(self, "_out_shape", None)
        if want is not None and tuple(d.shape) != want:
            raise ValueError(f"MoEBlock.backward: dy has shape {tuple(d.shape)} but the last forward's output has "
                             f"shape {want}; dy must be the gradient of that output, of its shape")
        self._alloc_grads()
        B, T, _ = d.shape
        d2 = d.reshape(B * T, C)
        dx1 = d2 + self.norm2.backward(self.moe.backward(d2))
        da = super().backward(np.ascontiguousarray(dx1, np.float32).reshape(B, T, C))
        dx = dx1 + self.norm1.backward(np.ascontiguousarray(np.asarray(da).reshape(B * T, C)))
        return np.ascontiguousarray(dx, np.float32).reshape(B, T, C)

    def __repr__(self) -> str:
        return (f"MoEBlock(hidden={self.config.hidden}, heads {self.q0}:{self.q0 + self.nq}, experts "
                f"{self.moe.experts_local} ({self.moe.mode}) on rank {self.comm.rank})")


def build_blocks(cfg: Config, comm: Comm, seeds: Sequence[int], head_partition: Any, ffn_partition: Any,
                 device: Any, dtype: Any, who: str, layers: Optional[Sequence[int]] = None) -> List[TransformerBlock]:
    """TransformerLM's blocks: for a MoE config (experts > 0) one MoEBlock per seed (of the
    model's layers `layers`; the MoE
    over comm, replicated tokens; warns once for a head split that leaves ranks without
    heads), else tpcore.nn.transformer.build_blocks's TransformerBlocks."""
    if not cfg.experts:
        return _dense_blocks(cfg, comm, seeds, head_partition, ffn_partition, device, dtype, who, layers=layers)
    at: List[Optional[int]] = [None] * len(seeds) if layers is None else list(layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeadSplitWarning)
        blocks: List[TransformerBlock] = [MoEBlock(cfg, comm, seed=s, head_partition=head_partition,
                                                   ffn_partition=ffn_partition, device=device, dtype=dtype,
                                                   layer=i) for s, i in zip(seeds, at)]
    if blocks:
        warn_headless_ranks(blocks[0].head_partition, cfg.heads, comm, who, len(blocks))
    return blocks



def expert_bytes(model: Any) -> Dict[str, int]:
    """This rank's expert weight bytes of a model's MoE blocks (or a list of blocks): "read",
    those its last forward read (only the experts that had tokens run their GEMMs: a decode
    step reads at most top-k experts per layer, for the report's bytes per token), and
    "held", all it holds.  0 and 0 for a dense model."""
    blocks = getattr(model, "blocks", model)
    moes = [b.moe for b in blocks if isinstance(b, MoEBlock)]
    held = sum(sum(w.nbytes for w in m.fc1.values()) + sum(w.nbytes for w in m.fc2.values()) for m in moes)
    return {"read": int(sum(m.bytes_read["experts"] for m in moes)), "held": int(held)}
