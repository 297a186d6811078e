"""What every tpcore.torch module shares (_TPModule): parameters that are views of the C
layer's buffers, the forward counter, the choice between autograd and a direct call, and the
refusal of conversions, copies and scripting that would part the parameters from the C layer."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple, cast

import torch

from tpcore.distributed.comm import Comm
from tpcore.torch.functions import _Apply
from tpcore.torch.state import _TPStateDict
from tpcore.torch.tensors import _dev_text, _tracing, _wrap


class _Holder(torch.nn.Module):
    """A container of some of a parent module's parameters (fc1 and fc2 of an MLP, norm1 or
    attn.qkv of a block), so that named_parameters() reads as in torch.  The parent saves and
    loads them: the holder itself adds nothing to a state dict and has no forward."""

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        pass

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        pass


# ------------------------------------------------------------------ the base module
class _TPModule(_TPStateDict):
    """What every module here shares: parameters over C memory, the forward counter, the
    full and sharded state dicts, and the refusal of .to() conversions that would part the
    parameters from the C layer."""

    def _tp_init(self, layer: Any, device: Tuple[str, int]) -> None:
        self.layer = layer
        self.device_ = device
        self._tp_gen = 0
        self._tp_sharded = False
        self._tp_views: List[Tuple[torch.nn.Module, str, int]] = []  # (owner, name, C address): _check_views

    def _adopt_param(self, owner: torch.nn.Module, name: str, view: Any) -> torch.nn.Parameter:
        """An nn.Parameter over the C buffer `view` (no copy), registered as owner.name."""
        t = _wrap(view)
        p = torch.nn.Parameter(t, requires_grad=True)
        assert p.data_ptr() == t.data_ptr()
        owner.register_parameter(name, p)
        self._tp_views.append((owner, name, p.data_ptr()))
        return p

    def _check_views(self) -> None:
        """A RuntimeError unless every parameter still views its C buffer: one whose .data was
        replaced (param.data = ..., torch.nn.utils.vector_to_parameters) or a Parameter assigned
        in its place would be trained as a copy the C layer never sees."""
        for owner, name, ptr in self._tp_views:
            p = owner._parameters.get(name)
            if p is None or p.data_ptr() != ptr:
                where = next(k for k, mod in self.named_modules() if mod is owner)
                full = f"{where}.{name}" if where else name
                raise RuntimeError(f"{self._who}: parameter {full} no longer views the C layer's memory (its .data "
                                   f"was replaced, e.g. by torch.nn.utils.vector_to_parameters or `param.data = ...`, "
                                   f"or another Parameter was assigned), so the C layer would not see it; write "
                                   f"values in place instead (with torch.no_grad(): param.copy_(...)) or use "
                                   f"load_state_dict")

    # the order of the parameters handed to _Apply, and their C gradient buffers
    def _tp_params(self) -> List[torch.nn.Parameter]:
        raise NotImplementedError

    def _tp_grads(self) -> List[Any]:
        raise NotImplementedError

    def _c_forward(self, *args: Any, **kw: Any) -> torch.Tensor:
        """The C layer's forward of the inputs (counted: _tp_gen)."""
        raise NotImplementedError

    def _run(self, *inputs: torch.Tensor) -> torch.Tensor:
        """inputs through the C layer: with autograd when a gradient is wanted (or under
        torch.jit.trace, which records the Function as a call; a direct result would be recorded
        as a constant), else directly."""
        self._check_views()
        params = self._tp_params()
        if _tracing() or torch.is_grad_enabled() and (
                any(t.requires_grad for t in inputs if t.is_floating_point()) or any(p.requires_grad for p in params)):
            y = _Apply.apply(self, len(inputs), *inputs, *params)  # type: ignore[no-untyped-call]
            return cast(torch.Tensor, y)
        return self._c_forward(*inputs, need_backward=False)

    def _apply(self, fn: Any, recurse: bool = True) -> "_TPModule":
        """Refuse .to(dtype/device), .half(), .cuda(), share_memory() ... that would replace the
        parameters by copies or move their storage: they must stay views of the C layer's
        memory.  fn is tried on a one-element stand-in of each parameter, never on the
        parameter itself, because an in-place fn (share_memory_) would already have moved it."""
        for name, p in self.named_parameters():
            probe = torch.empty((1,), dtype=p.dtype, device=p.device)
            ptr = probe.data_ptr()
            q = fn(probe)
            if q.data_ptr() != ptr or probe.data_ptr() != ptr or q.dtype != p.dtype or q.device != p.device:
                raise TypeError(f"{self._who}: its parameters live in the C layer's memory ({p.dtype} on "
                                f"{_dev_text(p)}) and cannot be moved or converted ({name} would become {q.dtype} "
                                f"on {_dev_text(q)} in other memory); build the module with device=... and "
                                f"dtype=... instead")
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        """pickle, copy.copy and copy.deepcopy: refused by name (the C layer, its communicator
        and the parameters over its memory cannot travel or be duplicated)."""
        raise TypeError(f"{self._who} cannot be pickled or copied: its parameters are views of a C layer bound to "
                        f"this process's communicator; save model.state_dict() (full tensors, loads at any world "
                        f"size) or tpcore.torch.sharded_state_dict(model), and build a new module to load it into")

    def __prepare_scriptable__(self) -> Any:
        """torch.jit.script calls this first: refused by name (forward calls into C)."""
        raise TypeError(f"{self._who}: torch.jit.script cannot compile a forward that calls a C layer; use "
                        f"torch.compile or torch.jit.trace (which records the call), or run it eagerly")

    # ---- facts about the split
    @property
    def comm(self) -> Comm:
        return cast(Comm, self.layer.comm)

    def extra_repr(self) -> str:
        return repr(self.layer)


def _comm_arg(comm: Any, who: str) -> None:
    if not isinstance(comm, Comm):
        raise TypeError(f"{who}: comm must be a tpcore.Comm, got {type(comm).__name__}")
