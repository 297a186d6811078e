"""PyTorch modules over tpcore's C layers: ``import tpcore.torch``.

``ColumnParallelLinear``, ``RowParallelLinear``, ``ParallelMLP``, ``VocabParallelEmbedding``,
``VocabParallelCrossEntropy`` (and the function ``vocab_parallel_cross_entropy``),
``TransformerBlock`` and ``ParallelAttention`` are ``torch.nn.Module``s.  Each wraps the tpcore
layer of the same name (``module.layer``); its forward and backward are one call each into the C layer (GIL released)
through a ``torch.autograd.Function``.  PyTorch is optional: ``import tpcore`` never imports it,
and this module raises ImportError saying how to install it when it is missing.

Memory.  Parameters are ``nn.Parameter``s viewing the C layer's weight and bias buffers (this
rank's shard): a torch optimizer updating them in place (SGD, Adam, AdamW ...) updates the C
layer; replacing one's ``.data`` or assigning another Parameter (weight tying) would part it from
the C layer, and the next forward raises RuntimeError.  Activations cross without copies: a
float32 C-contiguous CPU tensor is handed to C as a NumPy view of its memory, and the C result
comes back as a tensor over the NumPy array (``torch.from_numpy``).  A float16 / bfloat16
input is converted to float32 (the C layers compute in float32) and the output given back in
the input's dtype; a non-contiguous one is made contiguous (a copy).  Gradients reach
``param.grad`` with torch's semantics (a second backward adds; ``requires_grad=False``
parameters get none); the C layer's own gradient buffers are scratch (zeroed before each
backward, copied out after).

State.  A C layer keeps what its backward needs from its last forward.  Each module counts its
forwards; the autograd node of a forward saves its inputs (``save_for_backward``) and, when the
layer has run another forward since (a module called twice before backward, activation
recomputation, ``retain_graph``), replays its own forward before the backward.  Every rank makes
the same decision in the same program order, so the collectives stay matched.  Inputs modified in
place before backward are detected by torch (saved-tensor version check), as for nn.Linear.

Collectives.  Forward and backward run the layer's collectives: call the modules on every rank of
the communicator, in the same order (torch's autograd engine runs the backward in a deterministic
order for the same graph).

State dicts.  ``module.state_dict()`` returns the FULL, unsharded tensors (a collective: call it on
every rank; every rank gets them), with the names of the equivalent single-process torch module
(``weight``/``bias`` as nn.Linear and nn.Embedding; ``fc1.*``/``fc2.*`` for the MLP; the block's
names are TransformerBlock.load_full's, e.g. ``attn.q.weight``).  ``load_state_dict`` takes full
tensors and keeps this rank's slice of them, so a state dict saved at one world size or partition
loads at another.  Both work nested in any model.  ``sharded_state_dict(model)`` and
``load_sharded_state_dict(model, sd)`` give and take only this rank's shards (no communication),
plus a ``<prefix>_tp_shard`` int64 tensor per module recording the world size, rank and partition:
a shard loads only into a module of the same layout (else a clear error; use the full form to
reshard).

Devices.  ``device=None``/``"cpu"`` (default) or ``"cuda"``/``"cuda:N"`` (a tpcore build with CUDA):
the parameters are then torch CUDA tensors viewing the C layer's device memory (through DLPack),
and inputs must be CUDA tensors on that device.  A tensor on another device than the module is a
TypeError naming the module, the argument and both devices.

The subpackage: tensors (how a tensor crosses to the C layer and back), functions (the
autograd Functions: one C call forward, one backward), state (full and sharded state dicts),
base (what every module shares: parameters over C memory, the forward counter, the refusals),
modules (the public nn.Modules).  It imports torch, numpy and tpcore's utils, distributed and
nn; ``import tpcore`` never imports it.
"""
from __future__ import annotations

try:
    import torch
except ImportError as _e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("tpcore.torch needs PyTorch, an optional dependency of tpcore that is not installed here: "
                      "pip install 'torch>=2.1' (or pip install 'tpcore[test]'); the rest of tpcore works without "
                      "it") from _e
if not hasattr(torch, "autograd"):  # python/tpcore itself on sys.path: "import torch" found this file
    raise ImportError(f"tpcore.torch: 'import torch' found {getattr(torch, '__file__', '?')}, not PyTorch; the folder "
                      f"python/tpcore must not be on sys.path (run from another directory, or use python -m)")

from tpcore.torch.modules import (ColumnParallelLinear, ParallelAttention, ParallelMLP, RowParallelLinear,
                                  TransformerBlock, VocabParallelCrossEntropy, VocabParallelEmbedding,
                                  vocab_parallel_cross_entropy)
from tpcore.torch.state import load_sharded_state_dict, sharded_state_dict

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "VocabParallelEmbedding",
           "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy", "TransformerBlock", "ParallelAttention",
           "sharded_state_dict", "load_sharded_state_dict"]
