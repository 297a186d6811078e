"""The tensor-parallel MLP (Megatron): `ParallelMLP`, a column-parallel fc1, the activation
on this rank's columns and a row-parallel fc2, one C call each way (csrc/layers/mlp.c)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, overload

import numpy as np

from tpcore import _C
from tpcore.utils.args import bool_arg, int_arg, seed_arg, shown
from tpcore.utils.arrays import device_string, resolve_device
from tpcore.utils.dtypes import weight_format
from tpcore.distributed.comm import Comm
from tpcore.nn.common import _back, check_grad, dev_back, dev_f32, kept_output, layer_memory
from tpcore.nn.config import ACTIVATIONS, GATED
from tpcore.nn.linear import ColumnParallelLinear, RowParallelLinear
from tpcore.nn.partition import _plan_sizes, partition_sizes


class ParallelMLP:
    """Transformer MLP y = fc2(act(fc1(x))) split over ranks (Megatron).

    fc1 is column-parallel (without gather), the activation runs on this rank's columns,
    fc2 is row-parallel with input_is_parallel.  activation="swiglu" (or "geglu") makes fc1
    gated: [gate; up] of shape (2 ffn_hidden, hidden), both projections of a rank in one
    GEMM, and y = fc2(silu(gate) * up) (geglu: gelu_tanh(gate) * up, Gemma).  The whole step is one C call each way
    (csrc/layers/mlp.c), with its workspaces reused across steps; `fc1` and `fc2` are
    views of its layers (weights, grads, load_full, gather_full).

    Parameters
    ----------
    hidden : int
        The model width (x's and y's last dimension), >= 1.
    ffn_hidden : int
        The inner width, split over the ranks, >= 1.
    comm : Comm
        The ranks that share the MLP.
    activation : {"gelu", "gelu_tanh", "silu", "relu", "swiglu", "geglu"}, default "gelu"
        "gelu" is the exact (erf) GELU, "gelu_tanh" its tanh approximation (GPT-2);
        "swiglu" and "geglu" are gated (silu / gelu_tanh of the gate, times up).
    bias : bool, default True
        Biases on fc1 and fc2.
    partition : list of int or list of (int, int), optional
        How ffn_hidden is split (one size per rank or `tpcore.partition`'s pairs).
        Default None: even.
    dtype : str or dtype, default "float32"
        Weight storage: "float32", "bfloat16" or "float16" (float32 arithmetic).
    seed : int, default 0
        As `ColumnParallelLinear`'s: the same logical weights at every world size.
    device : str, optional
        "cpu" (default) or "cuda[:N]".
    plan : Plan, optional
        A `tpcore.plan_partition` plan whose MLP columns split ffn_hidden (instead of
        partition).

    Attributes
    ----------
    fc1 : ColumnParallelLinear
        (hidden -> ffn_hidden; gated for swiglu and geglu).
    fc2 : RowParallelLinear
        (ffn_hidden -> hidden, input_is_parallel).

    Raises
    ------
    TypeError
        comm not a Comm, activation not a string, an argument of the wrong type.
    ValueError
        An unknown activation or dtype, a size < 1, a partition that does not add up.

    Notes
    -----
    Collectives: exactly one all-reduce in forward (after fc2) and one in backward (fc1's
    input gradient).
    """

    def __init__(self, hidden: int, ffn_hidden: int, comm: Comm, activation: str = "gelu", bias: bool = True,
                 partition: Any = None, dtype: Any = "float32", seed: int = 0, device: Optional[str] = None,
                 plan: Any = None) -> None:
        self.device = resolve_device(device, "ParallelMLP")
        if not isinstance(activation, str) or activation not in ACTIVATIONS:
            raise (ValueError if isinstance(activation, str) else TypeError)(
                f"ParallelMLP: activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {shown(activation)}")
        if not isinstance(comm, Comm):
            raise TypeError(f"ParallelMLP: comm must be a tpcore.Comm, got {type(comm).__name__}")
        self.dtype = weight_format(dtype, "ParallelMLP")
        bool_arg(bias, "ParallelMLP", "bias")
        seed = seed_arg(seed, "ParallelMLP")
        hidden = int_arg(hidden, "ParallelMLP", "hidden", lo=1)
        ffn_hidden = int_arg(ffn_hidden, "ParallelMLP", "ffn_hidden", lo=1)
        partition = _plan_sizes(plan, comm, ffn_hidden, "ParallelMLP", partition)
        sizes = partition_sizes(partition, ffn_hidden, comm.size, "ffn_hidden", "ParallelMLP: partition")
        self.activation, self.comm, self.hidden = activation, comm, int(hidden)
        kw = {} if self.device[0] == "cpu" else {"device": device_string(self.device)}
        self._c = _C.ParallelMLP(comm._c, int(hidden), int(ffn_hidden), activation, bool(bias), sizes, seed,
                                 weight_dtype=self.dtype, **kw)
        self.fc1: ColumnParallelLinear = ColumnParallelLinear._adopt(self._c.fc1, comm, int(hidden), int(ffn_hidden),
                                                                     activation in GATED, self.device)
        self.fc2: RowParallelLinear = RowParallelLinear._adopt(self._c.fc2, comm, int(ffn_hidden), int(hidden), False,
                                                               self.device)

    def parameters(self) -> List[Tuple[np.ndarray, np.ndarray]]:
        """This rank's (parameter, gradient) pairs: fc1's, then fc2's (see
        `ColumnParallelLinear.parameters`)."""
        return self.fc1.parameters() + self.fc2.parameters()

    def zero_grad(self) -> None:
        """Set every gradient of fc1 and fc2 to zero."""
        self.fc1.zero_grad()
        self.fc2.zero_grad()

    def memory(self) -> Dict[str, Any]:
        """The bytes this rank's part holds now: fc1's and fc2's (see
        `ColumnParallelLinear.memory`) plus the activation workspace (fc1's output, the
        activation and their gradients for the largest batch seen).

        Returns
        -------
        dict
            The keys of `ColumnParallelLinear.memory`.
        """
        return layer_memory(self._c.memory())

    @overload
    def forward(self, x: np.ndarray) -> np.ndarray: ...
    @overload
    def forward(self, x: Any) -> Any: ...
    def forward(self, x: Any) -> Any:
        """y = fc2(act(fc1(x))) (also ``mlp(x)``).

        Parameters
        ----------
        x : array_like, shape (..., hidden)
            The full input on every rank; float32, bfloat16 or float16 (output in x's
            dtype).  On a GPU MLP: any DLPack tensor on its device.

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., hidden)
            The full output, the same on every rank.

        Raises
        ------
        TypeError, ValueError
            x of a wrong dtype, device or last dimension.
        CommError, CommTimeout
            The all-reduce failed.

        Notes
        -----
        Collective: one all-reduce over comm.
        """
        if self.device[0] != "cpu":
            x2, lead = self.fc1._device_rows(x, "x", self.hidden, "ParallelMLP")
            x2, dt = dev_f32(x2)
            kept_output(self, None)
            y = self._c.forward(x2)
            kept_output(self, lead + (self.hidden,))
            return dev_back(y, dt).reshape(lead + (self.hidden,))
        x2, lead, dt = self.fc1._rows(x, "x", self.hidden)
        kept_output(self, None)
        y = self._c.forward(x2)
        kept_output(self, lead + (self.hidden,))
        return _back(y.reshape(lead + (self.hidden,)), dt)

    __call__ = forward

    @overload
    def backward(self, dy: np.ndarray) -> np.ndarray: ...
    @overload
    def backward(self, dy: Any) -> Any: ...
    def backward(self, dy: Any) -> Any:
        """The input gradient for the last forward; accumulates every weight's gradient.

        Parameters
        ----------
        dy : array_like, shape (..., hidden)
            The gradient of forward's output: exactly its shape (the same on every rank).

        Returns
        -------
        numpy.ndarray or DeviceArray, shape (..., hidden)
            The gradient of x, the same on every rank.

        Raises
        ------
        TypeError, ValueError
            dy of a wrong dtype or layout; a ValueError naming both shapes when dy's shape
            is not the last forward's output's.
        RuntimeError
            No forward ran before.

        Notes
        -----
        Collective: one all-reduce over comm (fc1's input gradient).
        """
        if self.device[0] != "cpu":
            dy2, lead = self.fc2._device_rows(dy, "dy", self.hidden, "ParallelMLP")
            check_grad(self, lead + (self.hidden,))
            dy2, dt = dev_f32(dy2)
            return dev_back(self._c.backward(dy2), dt).reshape(lead + (self.hidden,))
        dy2, lead, dt = self.fc2._rows(dy, "dy", self.hidden)
        check_grad(self, lead + (self.hidden,))
        return _back(self._c.backward(dy2).reshape(lead + (self.hidden,)), dt)
