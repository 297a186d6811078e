"""Cross-rank agreement: every rank of a communicator was given the same arguments.

Collectives over a `Comm` (one or two all-gathers) that raise on every rank alike, naming
what differs, so that a mismatch is an error and never corrupt data.
"""
import hashlib
from typing import Callable, Optional, Sequence, Tuple

import numpy as np

from tpcore.utils.args import is_int


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
