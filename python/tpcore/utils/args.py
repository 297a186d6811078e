"""Argument checks shared by the Python face: each failure names the argument, what
was expected and what came (TypeError for a wrong kind, ValueError for a bad value),
and `agree` checks that every rank passed the same arguments (a collective).

bool is never an integer here (axis=True, root=True, sizes=[True, ...] are refused),
and floats are never silently truncated to integers."""
from __future__ import annotations

import hashlib
import math
import numbers
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from ._array import asarray

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


def int_array(a, who: str, name: str) -> np.ndarray:
    """An integer NumPy array (not bool, not float, not strings), as int64 (C-contiguous)."""
    if isinstance(a, (str, bytes)):
        raise TypeError(f"{who}: {name} must be integers, got {shown(a)}")
    if not isinstance(a, np.ndarray) and hasattr(a, "__dlpack__"):
        a = asarray(a, name, who)  # its device checked; a DLPack-only tensor imported without a copy
    try:
        t = np.asarray(a)
    except (ValueError, TypeError) as e:  # ragged nesting
        raise ValueError(f"{who}: {name} could not be read as an array of integers: {e}") from None
    if t.size == 0 and not isinstance(a, np.ndarray) and t.dtype == np.float64:
        t = t.astype(np.int64)  # [] or [[]]: NumPy's default dtype for an empty list is float64
    if t.dtype.kind == "f" and isinstance(a, (list, tuple)):
        o = np.array(a, dtype=object)  # e.g. [2**63, -1]: ints NumPy could only hold as floats
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in o.flat):
            t = o
    if t.dtype == object:  # Python ints (past int64 too), or anything else
        bad = [v for v in t.flat if isinstance(v, bool) or not isinstance(v, (int, np.integer))]
        if bad:
            raise TypeError(f"{who}: {name} must be integers, got {shown(bad[0])}")
        out = [int(v) for v in t.flat if not -2 ** 63 <= int(v) < 2 ** 63]
        if out:
            raise ValueError(f"{who}: {name} must be in the int64 range [-2**63, 2**63), got {out[0]}")
        return np.require(t, np.int64, "C")  # (ascontiguousarray would make a 0-d array 1-d)
    if t.dtype.kind not in "iu" or t.dtype == np.bool_:
        raise TypeError(f"{who}: {name} must be integers, got dtype {t.dtype}")
    if t.dtype == np.uint64 and t.size and int(t.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{who}: {name} holds {int(t.max())}, past the int64 range")
    return np.require(t, np.int64, "C")  # (ascontiguousarray would make a 0-d array 1-d)


def minmax(a: np.ndarray) -> Tuple[int, int]:
    """(min, max) of a non-empty integer array; small arrays (a decode step's) through Python
    lists, a few times faster than NumPy's reductions at that size."""
    if a.size <= 64:
        v = a.ravel().tolist()
        return min(v), max(v)
    return int(a.min()), int(a.max())


# ----------------------------------------------------------------- across ranks

def agreed(comm, who: str, enabled: bool, convert: Callable[[], tuple],
           checks: Callable[[tuple], Sequence[Tuple[str, tuple]]]) -> tuple:
    """convert()'s values, which every rank agreed on when `enabled` (and world > 1):
    checks(values) gives the (what, parts) pairs to compare (see agree).  A rank whose
    convert() raised TypeError/ValueError raises it; the others say that it refused."""
    if not enabled or comm.size == 1:
        return convert()
    try:
        values, err = convert(), None
    except (TypeError, ValueError) as e:
        values, err = None, e
    agree(comm, who, [] if err is not None else [(what, parts, None) for what, parts in checks(values)], err)
    return values


def fingerprint(*parts) -> int:
    """A 64-bit fingerprint (signed, to fit an int64) of arrays, ints, floats and None: the same
    value in every process (not Python's hash(), which is salted per process)."""
    out = []
    for p in parts:
        if isinstance(p, np.ndarray):
            out.append(f"a{p.shape}{p.dtype.str}".encode())
            out.append(p.tobytes())
        elif isinstance(p, float):
            out.append(b"f" + p.hex().encode())
        elif p is None:
            out.append(b"n")
        else:
            out.append(b"i%d" % int(p))
    return int.from_bytes(hashlib.blake2b(b"|".join(out), digest_size=8).digest(), "little", signed=True)


def agree(comm, who: str, checks: Sequence[Tuple[str, object, Optional[object]]],
          error: Optional[BaseException] = None):
    """Collective: every rank passes the same number of checks, each (what, value, shown):
    `what` reads "<what> across ranks" ("the prompts differ", "pos0 differs"); `value` a tuple
    of parts to fingerprint (arrays, ints, floats, None), or, with `shown` (a function giving
    it for the message), one int64 value compared as is.  `error`: this rank's own refusal of
    its arguments (its checks are then ignored).  One all-gather of two int64 (a refusal flag
    and one fingerprint of everything); only when they differ, a second one of the per-check
    values, to name what differs.  Every rank decides from the same gathered numbers, so all
    raise (ValueError, or this rank's own error) or none does, and the communicator stays in
    step."""
    n = comm.size
    if n == 1:
        if error is not None:
            raise error
        return
    if error is None:
        parts = []
        for _, v, _ in checks:
            parts.extend(v if isinstance(v, tuple) else (v,))
            parts.append(-1 - len(parts))  # a separator: where one check's parts end
        fp = fingerprint(*parts)
    else:
        fp = 0
    g = comm.all_gather(np.array([error is not None, fp], np.int64)).tolist()
    if error is not None:
        raise error
    refused = [r for r in range(n) if g[2 * r]]
    if refused:
        raise ValueError(f"{who}: rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))} refused "
                         f"{'their' if len(refused) > 1 else 'its'} arguments (see the error there); every rank "
                         f"must pass the same valid arguments")
    if all(g[2 * r + 1] == fp for r in range(n)):
        return
    # every rank saw the same difference, so all take this path: which check differs?
    # (a plain value outside int64 is fingerprinted too: this step must not fail on one rank only)
    values = np.array([v if is_int(v) and -2 ** 63 <= v < 2 ** 63 else
                       fingerprint(*v) if isinstance(v, tuple) else fingerprint(v) for _, v, _ in checks], np.int64)
    every = comm.all_gather(values).reshape(n, len(checks))
    for j, (what, _, show) in enumerate(checks):
        col = every[:, j]
        diff = np.nonzero(col != col[0])[0]
        if diff.size:
            r = int(diff[0])
            detail = f"rank 0 and rank {r} differ"
            if show is not None:
                detail = f"rank 0 passed {show(int(col[0]))}, rank {r} passed {show(int(col[r]))}"
            raise ValueError(f"{who}: {what} across ranks ({detail}); every rank must pass the same arguments "
                             f"(tensor parallelism: the ranks compute one model together)")
    raise ValueError(f"{who}: the arguments differ across ranks; every rank must pass the same arguments")
