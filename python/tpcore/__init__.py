"""tpcore: tensor parallelism with a C core.

    import tpcore
    comm = tpcore.init()                       # the world communicator of this job
    comm.all_reduce(x)                         # in place, sum over ranks
    tpcore.spawn(fn, 4)                        # fn(comm) on 4 local ranks (scripts, pytest, Jupyter)

Launch a script on N ranks:  python -m tpcore.launch -n N script.py

Errors: CommError / CommTimeout (communication), RankExitedError (spawn), and
CheckpointError (a ValueError) for every corrupt or inconsistent checkpoint file
(safetensors, config.json, index, .npz), naming the file, the tensor or field,
what was expected and what was found.

This file is the package's face: it re-exports the public names of the subpackages
(utils, distributed, io, nn, models, parallel, serve, launch; see docs/architecture.md)
and keeps the module paths of earlier releases (tpcore.quant, tpcore.optim, tpcore.models.gguf)
importable as aliases of their new homes.
"""
import sys as _sys

# runtime first: it loads the C extension with the environment it needs
from tpcore.utils.runtime import build_info, convert, cuda_available, get_num_threads, set_num_threads
from tpcore.utils import cleanup as _cleanup
from tpcore.distributed import throttle as _throttle
from tpcore.utils.arrays import DeviceArray, from_dlpack
from tpcore.utils.arrays import asarray_device as asarray
from tpcore.distributed.throttle import get_throttle, set_throttle
from tpcore.distributed.comm import Comm, CommError, CommTimeout
from tpcore.distributed.init import init
from tpcore.distributed.grid import ProcessGrid, average_gradients
from tpcore.distributed.store import Store
from tpcore.nn import optim, quant
from tpcore.nn.linear import ColumnParallelLinear, RowParallelLinear
from tpcore.nn.mlp import ParallelMLP
from tpcore.nn.partition import partition
from tpcore.nn.vocab import VocabParallelCrossEntropy, VocabParallelEmbedding, vocab_parallel_cross_entropy
from tpcore.io.formats import CheckpointError
from tpcore.nn.checkpoint import load, save
from tpcore.nn.config import Config
from tpcore.nn.transformer import ParallelAttention, TransformerBlock
from tpcore.nn.quant import QuantTensor
from tpcore import models
from tpcore.parallel.pipeline import PipelineLM, stage_partition
from tpcore.parallel.planner import Plan, PlanError, plan_from_measurements, plan_partition
from tpcore.serve import Engine
from tpcore.launch.spawn import RankExitedError, spawn
from tpcore.launch.cluster import Cluster
from tpcore import _C

# the module paths of earlier releases, as aliases of the modules themselves
for _old, _mod in (("quant", quant), ("optim", optim)):
    _sys.modules[f"{__name__}.{_old}"] = _mod
del _old, _mod

_cleanup.forget_life_fd_in_children()
_throttle.apply_env_at_import()

__version__: str = _C.build_info()["version"]  # one source: TP_VERSION_* of tpcore.h, via setup.py

__all__ = [
    # runtime (tpcore.utils)
    "build_info", "cuda_available", "convert", "set_num_threads", "get_num_threads",
    "DeviceArray", "asarray", "from_dlpack", "set_throttle", "get_throttle",
    # communicators (tpcore.distributed)
    "init", "Comm", "CommError", "CommTimeout", "ProcessGrid", "average_gradients", "Store",
    # layers (tpcore.nn)
    "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "partition",
    "VocabParallelEmbedding", "VocabParallelCrossEntropy", "vocab_parallel_cross_entropy",
    "Config", "TransformerBlock", "ParallelAttention", "optim", "quant", "QuantTensor",
    "save", "load", "CheckpointError",
    # models, parallelism, serving, launching
    "models", "PipelineLM", "stage_partition", "Plan", "PlanError", "plan_from_measurements", "plan_partition",
    "Engine", "spawn", "RankExitedError", "Cluster",
    "__version__",
]
