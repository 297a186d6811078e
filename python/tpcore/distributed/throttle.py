"""The compute throttle (csrc/core/throttle.c): make this process's compute kernels
slower on purpose, so that one rank of a job on one host acts as a slower device
(tests and demos of tpcore.plan_partition; `python -m tpcore.bench hetero`).

After each compute kernel a layer runs (GEMMs, attention, norms, element-wise) and
after tpcore's direct GEMMs (the tied LM head, the planner's measurements), the
calling thread sleeps (factor - 1) x the kernel's time: factor 2.0 halves this rank's
compute speed while its collectives stay real.  Process-wide.

TPCORE_THROTTLE sets it from the environment: a number (every rank), or
"rank:factor" pairs separated by commas ("1:2.0" makes rank 1 twice as slow, the
other ranks unthrottled).  It is read when tpcore is imported (a plain number, or
pairs when the rank is known from the environment) and again by tpcore.init(), so
`TPCORE_THROTTLE=1:2 python -m tpcore.launch -n 3 ...` and spawn's ranks pick it up.
"""
from __future__ import annotations

import math
import os
from typing import Dict, Optional

from tpcore import _C
from tpcore.utils.args import shown

ENV = "TPCORE_THROTTLE"
MAX_FACTOR = 1000.0


def set_throttle(factor: float) -> None:
    """Slow this process's compute kernels by factor, to act as a slower device.

    After each compute kernel the calling thread sleeps (factor - 1) x the kernel's time;
    collectives stay real.  For tests and demos of `plan_partition` (see the module doc;
    TPCORE_THROTTLE sets it per rank from the environment).

    Parameters
    ----------
    factor : float
        In [1, 1000]; 1.0 turns the throttle off.

    Raises
    ------
    TypeError
        factor is not a number.
    ValueError
        factor is not finite or out of range.
    """
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) and not hasattr(factor, "__float__"):
        raise TypeError(f"set_throttle: factor must be a number >= 1, got {shown(factor)}")
    f = float(factor)
    if not math.isfinite(f) or not 1.0 <= f <= MAX_FACTOR:
        raise ValueError(f"set_throttle: factor must be a finite number in [1, {MAX_FACTOR:g}] (1: off), "
                         f"got {factor!r}")
    _C.set_throttle(f)


def get_throttle() -> float:
    """The compute throttle's factor of this process (see `set_throttle`).

    Returns
    -------
    float
        1.0 when off.
    """
    return _C.get_throttle()


def _factor(text: str, where: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = float("nan")
    if not math.isfinite(f) or not 1.0 <= f <= MAX_FACTOR:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r}: {where} must be a number in [1, {MAX_FACTOR:g}], "
                         f"got {text!r}")
    return f


def parse(text: str) -> Dict[Optional[int], float]:
    """{None: factor} for a plain number, {rank: factor, ...} for "rank:factor" pairs."""
    text = text.strip()
    if ":" not in text:
        return {None: _factor(text, "the factor")}
    out: Dict[Optional[int], float] = {}
    for item in text.split(","):
        rank_text, sep, f_text = item.strip().partition(":")
        if not sep or not rank_text.strip().isdigit():
            raise ValueError(f"{ENV}={text!r}: expected a number or rank:factor pairs separated by commas "
                             f"(\"1:2.0\"), got the item {item.strip()!r}")
        rank = int(rank_text)
        if rank in out:
            raise ValueError(f"{ENV}={text!r}: rank {rank} is given twice")
        out[rank] = _factor(f_text.strip(), f"the factor of rank {rank}")
    return out


def apply_env(rank: Optional[int]) -> None:
    """Set the throttle from TPCORE_THROTTLE for this rank (None: not known yet; pairs then
    wait for init).  Unset or empty: the throttle is left as it is."""
    text = os.environ.get(ENV, "")
    if not text.strip():
        return
    table = parse(text)
    if None in table:
        _C.set_throttle(table[None])
    elif rank is not None:
        _C.set_throttle(table.get(rank, 1.0))


def apply_env_at_import() -> None:
    rank = None
    if os.environ.get(ENV, "").strip():
        from tpcore.distributed import env as _env
        try:
            rank = _env.detect().rank
        except Exception:  # noqa: BLE001 - an unusable job environment is init()'s error to report
            rank = None
    apply_env(rank)
