"""State dicts of tpcore.torch modules: the full (unsharded, gathered) form that loads at any
world size, and the sharded form (this rank's shards plus a ``<prefix>_tp_shard`` record of the
layout) that loads only into the same layout."""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Mapping, Tuple

import numpy as np
import torch

from tpcore.torch.tensors import _full_tensor, _to_numpy

_SHARD_KEY = "_tp_shard"
_SHARD_FORMAT = 1


class _TPStateDict(torch.nn.Module):
    """The state-dict side of every module here (_TPModule's base): full state dicts through
    the C layer's gather_full / load_full, sharded ones of this rank's parameters.  A subclass
    says what its full tensors are (_tp_full, _tp_full_shapes, _tp_load_full) and its layout."""

    _who = ""

    # ---- state dicts
    def _tp_full(self) -> Dict[str, np.ndarray]:
        raise NotImplementedError

    def _tp_full_shapes(self) -> Dict[str, Tuple[int, ...]]:
        raise NotImplementedError

    def _tp_load_full(self, tensors: Dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def _tp_local(self) -> Dict[str, torch.nn.Parameter]:
        return dict(self.named_parameters())

    def _tp_layout(self) -> List[int]:
        """The partition as integers (a sharded state dict records it)."""
        raise NotImplementedError

    def _tp_meta(self) -> torch.Tensor:
        comm = self.layer.comm
        return torch.tensor([_SHARD_FORMAT, comm.size, comm.rank] + [int(v) for v in self._tp_layout()],
                            dtype=torch.int64)

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        if self._tp_sharded:
            for k, p in self._tp_local().items():
                destination[prefix + k] = p if keep_vars else p.detach()
            destination[prefix + _SHARD_KEY] = self._tp_meta()
            return
        for k, a in self._tp_full().items():  # a collective: every rank gets the full tensors
            destination[prefix + k] = _full_tensor(a)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata: Dict[str, Any],
                              strict: bool, missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if self._tp_sharded:
            self._load_sharded(mine, prefix, missing_keys, unexpected_keys, error_msgs)
        else:
            self._load_full_sd(mine, prefix, missing_keys, unexpected_keys, error_msgs)

    def _load_full_sd(self, mine: Dict[str, Any], prefix: str, missing_keys: List[str], unexpected_keys: List[str],
                      error_msgs: List[str]) -> None:
        shapes = self._tp_full_shapes()
        missing = [k for k in shapes if k not in mine]
        unexpected = [k for k in mine if k not in shapes]
        missing_keys.extend(prefix + k for k in missing)
        unexpected_keys.extend(prefix + k for k in unexpected)
        if _SHARD_KEY in mine:
            error_msgs.append(f"{prefix}{_SHARD_KEY}: this is a sharded state dict (tpcore.torch.sharded_state_dict); "
                              f"load it with tpcore.torch.load_sharded_state_dict")
            return
        tensors, bad = {}, False
        for k, shape in shapes.items():
            if k not in mine:
                continue
            v = mine[k]
            vshape = tuple(v.shape) if hasattr(v, "shape") else None
            if vshape != tuple(shape):
                error_msgs.append(f"size mismatch for {prefix}{k}: copying a param with shape {vshape} from "
                                  f"checkpoint, the full (unsharded) shape in {self._who} is {tuple(shape)}")
                bad = True
                continue
            try:
                tensors[k] = _to_numpy(v, prefix + k, f"{self._who}.load_state_dict")
            except TypeError as e:
                error_msgs.append(str(e))
                bad = True
        if bad or not tensors:
            return
        if missing:  # strict=False: keep the current values of what is missing (gathered: every rank does it)
            full = self._tp_full()
            tensors = {k: tensors.get(k, full[k]) for k in shapes}
        self._tp_load_full(tensors)
        # C wrote the parameters behind torch's back: bump their versions, so that a backward of
        # a forward from before the load is refused (as after nn.Linear's load_state_dict)
        for p in self._tp_local().values():
            torch.autograd.graph.increment_version(p)

    def _load_sharded(self, mine: Dict[str, Any], prefix: str, missing_keys: List[str], unexpected_keys: List[str],
                      error_msgs: List[str]) -> None:
        local = self._tp_local()
        want = list(local) + [_SHARD_KEY]
        missing_keys.extend(prefix + k for k in want if k not in mine)
        unexpected_keys.extend(prefix + k for k in mine if k not in want)
        meta = mine.get(_SHARD_KEY)
        if meta is None:
            if any(k in mine for k in local):
                error_msgs.append(f"{prefix}{_SHARD_KEY} is missing: a sharded state dict records each module's "
                                  f"world size, rank and partition (full state dicts load with load_state_dict)")
            return
        have = self._tp_meta()
        meta = torch.as_tensor(meta).to(torch.int64).reshape(-1).cpu()
        if meta.numel() < 3 or not torch.equal(meta, have):
            def show(m: torch.Tensor) -> str:
                v = m.tolist()
                return f"format {v[0]}, world size {v[1]}, rank {v[2]}, partition {v[3:]}" if len(v) >= 3 else str(v)
            error_msgs.append(f"{prefix}{_SHARD_KEY}: the shard was saved with {show(meta)} but {self._who} here has "
                              f"{show(have)}; a sharded state dict loads only into the same world size, rank and "
                              f"partition (use the full state_dict()/load_state_dict() to reshard)")
            return
        with torch.no_grad():
            for k, p in local.items():
                if k not in mine:
                    continue
                v = torch.as_tensor(mine[k])
                if tuple(v.shape) != tuple(p.shape):
                    error_msgs.append(f"size mismatch for {prefix}{k}: copying a shard with shape {tuple(v.shape)}, "
                                      f"this rank's shard in {self._who} has shape {tuple(p.shape)}")
                    continue
                p.copy_(v)


# ------------------------------------------------------------------ sharded state dicts
@contextlib.contextmanager
def _sharded(module: torch.nn.Module) -> Iterator[None]:
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"tpcore.torch: module must be a torch.nn.Module, got {type(module).__name__}")
    mods = [m for m in module.modules() if isinstance(m, _TPStateDict)]
    for m in mods:
        m._tp_sharded = True
    try:
        yield
    finally:
        for m in mods:
            m._tp_sharded = False


def sharded_state_dict(module: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """module.state_dict() with this rank's shards of every tpcore.torch module inside it
    (views of its parameters, no communication) and a ``<prefix>_tp_shard`` int64 tensor each
    recording [format, world size, rank, partition...].  Plain torch modules appear as usual."""
    with _sharded(module):
        return module.state_dict()


def load_sharded_state_dict(module: torch.nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """Load what sharded_state_dict gave, on the same rank of a module with the same world size
    and partitions (a RuntimeError naming both layouts otherwise).  Returns load_state_dict's
    (missing_keys, unexpected_keys)."""
    with _sharded(module):
        return module.load_state_dict(state_dict, strict=strict)
