"""Argument checks shared by the Python face: each failure names the argument, what
was expected and what came (TypeError for a wrong kind, ValueError for a bad value).
Imports nothing of tpcore.

bool is never an integer here (axis=True, root=True, sizes=[True, ...] are refused),
NumPy integers are (np.int64(3) is 3: shapes and sizes often come from NumPy), and
floats are never silently truncated to integers."""
from __future__ import annotations

import math
import numbers
from typing import Optional, Tuple

import numpy as np


SEED_RULE = "an integer in [0, 2**64)"


def shown(v) -> str:
    """v for a message: its repr (cut short) and, unless it is an int, its type."""
    r = repr(v)
    if len(r) > 60:
        r = r[:57] + "..."
    if type(v) is int:
        return r
    return f"{r} ({type(v).__name__})"


def is_int(v) -> bool:
    """Whether v is an integer: a Python int or a NumPy integer, not a bool (nor np.bool_)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _range_text(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"an integer in [{lo}, {hi}]"
    if lo is not None:
        return f"an integer >= {lo}"
    if hi is not None:
        return f"an integer <= {hi}"
    return "an integer"


def int_arg(v, who: str, name: str, lo: Optional[int] = None, hi: Optional[int] = None,
            expected: Optional[str] = None) -> int:
    """v as a Python int in [lo, hi]; TypeError for a non-integer (bool and float included)."""
    want = expected or _range_text(lo, hi)
    if not is_int(v):
        raise TypeError(f"{who}: {name} must be {want}, got {shown(v)}")
    v = int(v)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{who}: {name} must be {want}, got {v}")
    return v


def seed_arg(v, who: str, name: str = "seed") -> int:
    """The rule every seed follows: an integer in [0, 2**64)."""
    if not is_int(v):
        raise TypeError(f"{who}: {name} must be {SEED_RULE}, got {shown(v)}")
    v = int(v)
    if not 0 <= v < 2 ** 64:
        raise ValueError(f"{who}: {name} must be {SEED_RULE}, got {v}")
    return v


def bool_arg(v, who: str, name: str) -> bool:
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{who}: {name} must be True or False, got {shown(v)}")
    return bool(v)


def real_arg(v, who: str, name: str, lo: Optional[float] = None, lo_open: bool = False,
             hi: Optional[float] = None, hi_open: bool = False, finite: bool = True) -> float:
    """v as a float: a real number (not bool, not a string), not NaN, finite unless finite=False,
    within the bounds given."""
    parts = []
    if lo is not None:
        parts.append(f"{'>' if lo_open else '>='} {lo:g}")
    if hi is not None:
        parts.append(f"{'<' if hi_open else '<='} {hi:g}")
    want = ("a finite number" if finite else "a number") + (" " + " and ".join(parts) if parts else "")
    if isinstance(v, (bool, np.bool_, str, bytes)) or not (isinstance(v, (numbers.Real, np.integer, np.floating))
                                                         or hasattr(v, "__float__")):
        raise TypeError(f"{who}: {name} must be {want}, got {shown(v)}")
    try:
        f = float(v)  # a number, or a one-element array or tensor
    except (TypeError, ValueError):
        raise TypeError(f"{who}: {name} must be {want}, got {shown(v)}") from None
    bad = math.isnan(f) or (finite and math.isinf(f))
    if lo is not None:
        bad |= f <= lo if lo_open else f < lo
    if hi is not None:
        bad |= f >= hi if hi_open else f > hi
    if bad:
        raise ValueError(f"{who}: {name} must be {want}, got {v!r}")
    return f


def minmax(a: np.ndarray) -> Tuple[int, int]:
    """(min, max) of a non-empty integer array; small arrays (a decode step's) through Python
    lists, a few times faster than NumPy's reductions at that size."""
    if a.size <= 64:
        v = a.ravel().tolist()
        return min(v), max(v)
    return int(a.min()), int(a.max())
