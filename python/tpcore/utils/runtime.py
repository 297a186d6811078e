"""The process's run time: the C extension loaded once, what the build holds, threads.

Holds `build_info`, `cuda_available`, `convert`, `set_num_threads`, `get_num_threads` and the
default thread count of a rank.  Imports only tpcore._C and the other utils modules.
"""
from __future__ import annotations

import os
from typing import Any

# Idle OpenBLAS worker threads spin for 2^28 cycles (~0.1 s) after each call before they
# sleep; meanwhile they take cores from tpcore's element-wise threads and from the other
# local ranks (measured: 30% of the samples of an attention forward, a training step 13%
# slower).  tpcore's own OpenBLAS reads this when it loads, with the extension, so unless
# the user set it, it gets 2^20 cycles (~0.4 ms); the environment is restored afterwards.
_blas_timeout = "OPENBLAS_THREAD_TIMEOUT" not in os.environ
if _blas_timeout:
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = "20"
try:
    from tpcore import _C
finally:
    if _blas_timeout:
        del os.environ["OPENBLAS_THREAD_TIMEOUT"]


def build_info() -> dict[str, Any]:
    """What this build of the C core contains.

    Returns
    -------
    dict
        "version", "backends", "devices" (those whose tensors tpcore takes; "cpu" always),
        sanitizers, BLAS, and "cuda": {"built", then "why_not_built" or "plugin" /
        "runtime" / "arch", "status" (why a GPU is usable or not: "no NVIDIA driver (...)",
        "driver too old: ...", "no device (...)"), and "cublas" / "nccl" (where found, or why
        not) once they were searched for}.

    Notes
    -----
    Loads the CUDA plugin (``import tpcore`` does not).  No collective.
    """
    from tpcore.utils import cuda as _cuda
    cuda = _cuda.info()  # first: loading the plugin may add "cuda" to the devices
    return {**_C.build_info(), "cuda": cuda}


def convert(x: Any, dtype: Any, out: Any = None) -> Any:
    """x converted to another float dtype, bit for bit as NumPy / ml_dtypes cast.

    Rounds to nearest even, overflows to infinity, keeps subnormals, NaN stays a quiet NaN
    of its sign: bit for bit NumPy's float16 and ml_dtypes' bfloat16 casts (``astype``),
    threaded for large arrays.

    Parameters
    ----------
    x : numpy.ndarray
        Any shape; dtype float32, bfloat16 (ml_dtypes) or float16.
    dtype : str or numpy.dtype
        "float32", "bfloat16" or "float16", or their NumPy dtypes.
    out : numpy.ndarray, optional
        An array of x's shape and `dtype` to write into (default None: a new array).

    Returns
    -------
    numpy.ndarray
        x as `dtype`: `out` when given, else a new array of x's shape.

    Raises
    ------
    TypeError
        x is not a NumPy array of a supported dtype, or dtype / out's dtype is not one.
    ValueError
        out's shape differs from x's, or out is read-only.
    """
    return _C.convert(x, dtype, out)


def cuda_available() -> bool:
    """Whether tensors can live on a CUDA GPU in this process.

    Returns
    -------
    bool
        True when the build has the CUDA plugin, it loads, the driver is new enough and a
        device is visible.  ``build_info()["cuda"]["status"]`` says why not.

    Notes
    -----
    Loads the plugin on the first call (``import tpcore`` does not).
    """
    from tpcore.utils import cuda as _cuda
    return _cuda.available()


def set_num_threads(n: int) -> None:
    """Set the BLAS / element-wise threads of this process.

    The default after `init` is cores / local ranks (or TPCORE_NUM_THREADS), so that N
    local ranks never oversubscribe the machine.

    Parameters
    ----------
    n : int
        Threads, >= 1.

    Raises
    ------
    TypeError
        n is not an int (bool and float included).
    ValueError
        n < 1.
    """
    from tpcore.utils.args import int_arg
    _C.set_num_threads(int_arg(n, "set_num_threads", "n", lo=1))


def get_num_threads() -> int:
    """The BLAS / element-wise threads of this process (see `set_num_threads`).

    Returns
    -------
    int
        The current thread count, >= 1.
    """
    return _C.get_num_threads()


def default_threads(local_ranks: int) -> int:
    env = os.environ.get("TPCORE_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"TPCORE_NUM_THREADS must be an integer, got {env!r}") from None
        if n < 1:
            raise ValueError(f"TPCORE_NUM_THREADS must be >= 1, got {n}")
        return n
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))
