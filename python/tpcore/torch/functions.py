"""The autograd Functions of tpcore.torch: a module's forward is one C call, its backward
another (the layer's collectives), replayed when the layer ran another forward since."""
from __future__ import annotations

from typing import Any, Optional, Tuple, cast

import torch

from tpcore.torch.tensors import _host, _wrap


# ------------------------------------------------------------------ the autograd node
def _first_order(mod: Any) -> None:
    """Refuse a backward with create_graph=True: the C backward is not differentiable, so its
    results would silently carry no second-order terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{mod._who}: double backward (create_graph=True, e.g. a gradient penalty) is not "
                           f"supported: the C layer's backward is not itself differentiable")


class _Apply(torch.autograd.Function):
    """y = mod's C forward of inputs; backward: the C backward (its collectives), the input
    gradient and a copy of each parameter's gradient.  The parameters are inputs so torch
    routes their gradients and checks that they were not changed in place before backward."""

    @staticmethod
    def forward(ctx: Any, mod: Any, n_in: int, *args: Any) -> torch.Tensor:
        inputs, params = args[:n_in], args[n_in:]
        y = mod._c_forward(*inputs)
        ctx.mod, ctx.n_in, ctx.gen = mod, n_in, mod._tp_gen
        ctx.save_for_backward(*inputs, *params)
        return cast(torch.Tensor, y)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        mod = ctx.mod
        _first_order(mod)
        saved = ctx.saved_tensors  # torch raises here if one was modified in place since forward
        inputs, params = saved[:ctx.n_in], saved[ctx.n_in:]
        if mod._tp_gen != ctx.gen:  # another forward (or a backward) ran since: replay this one
            mod._c_forward(*inputs)
        mod.layer.zero_grad()
        dx = mod._c_backward(dy)
        mod._tp_gen += 1  # a backward may reuse the kept activations: the next one replays
        grads = []
        for i, (p, g) in enumerate(zip(params, mod._tp_grads())):
            grads.append(_wrap(g).clone().to(p.dtype) if ctx.needs_input_grad[2 + ctx.n_in + i] else None)
        in_grads = [None] * ctx.n_in
        if dx is not None and ctx.needs_input_grad[2]:
            in_grads[0] = dx
        return (None, None, *in_grads, *grads)


class _XentApply(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, mod: Any, logits: torch.Tensor, targets: torch.Tensor,
                vocab_offset: Optional[int]) -> torch.Tensor:
        loss = mod._c_forward(logits, targets, vocab_offset)
        ctx.mod, ctx.gen, ctx.vocab_offset = mod, mod._tp_gen, vocab_offset
        ctx.save_for_backward(logits, targets)
        return cast(torch.Tensor, loss)

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        mod = ctx.mod
        _first_order(mod)
        logits, targets = ctx.saved_tensors
        if mod._tp_gen != ctx.gen:
            mod._c_forward(logits, targets, ctx.vocab_offset)
        if mod.reduction == "none":
            d = _host(dloss.to(torch.float32).contiguous())
        else:
            d = float(dloss.item())
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        g = mod.layer.backward(d, out=_host(out)) if logits.device.type == "cpu" else mod.layer.backward(d)
        mod._tp_gen += 1
        return None, (out if logits.device.type == "cpu" else _wrap(g)), None, None
