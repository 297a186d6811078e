"""How a dimension is split over the ranks: `partition` (the C core's tp_partition), a
layer's partition argument as sizes (`partition_sizes`, or a `tpcore.Plan`'s split), and the
check that every rank was given the same split (`check_partition`, a small all-gather)."""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from tpcore import _C
from tpcore.utils.args import int_arg, is_int, shown
from tpcore.distributed.comm import Comm


def partition(n: int, world: int, weights: Optional[Sequence[float]] = None, align: int = 1) -> List[Tuple[int, int]]:
    """(offset, size) of each rank's slice of a dimension of length n.

    Parameters
    ----------
    n : int
        The dimension's length, >= 0; a multiple of align.
    world : int
        The number of ranks, >= 1.
    weights : sequence of float, optional
        One finite non-negative number per rank with a positive sum (e.g. measured device
        speeds or memory): slices proportional to them, for mismatched devices.  Default
        None: even (the first n % world ranks get one more unit).
    align : int, default 1
        Every slice is a whole number of align units (heads, GEMM-friendly multiples).

    Returns
    -------
    list of (int, int)
        (offset, size) per rank, in rank order; the sizes add up to n.  Pass it (or the
        sizes) as a layer's partition.

    Raises
    ------
    TypeError
        n, world or align not an int; weights not a sequence of numbers.
    ValueError
        n not a multiple of align, a bound out of range, or weights of the wrong length,
        negative, not finite or summing to 0.

    Notes
    -----
    No collective: a pure function (the C core's tp_partition), the same on every rank.
    """
    n = int_arg(n, "partition", "n", lo=0, hi=2**63 - 1)
    world = int_arg(world, "partition", "world", lo=1, hi=2**20)
    align = int_arg(align, "partition", "align", lo=1, hi=2**63 - 1)
    if n % align:
        raise ValueError(f"partition: n={n} is not a multiple of align={align}")
    if weights is not None:
        if isinstance(weights, (str, bytes)) or not hasattr(weights, "__iter__") or \
                not all(isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))
                        for x in weights):
            raise TypeError(f"partition: weights must be a sequence of {world} numbers, got {shown(weights)}")
        w = [float(x) for x in weights]
        if len(w) != world or any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"partition: weights must be {world} finite non-negative numbers with a positive sum, "
                             f"got {list(weights)}")
    # the split itself is the C core's (tp_partition, include/tpcore/partition.h): one
    # implementation for the layers in C and for this function
    sizes = _C.partition(n, world, None if weights is None else w, align)
    out, off = [], 0
    for s in sizes:
        out.append((off, s))
        off += s
    return out


def check_partition(comm: Comm, offset: int, local: int, dim: int, who: str):
    """Every rank's (offset, size), gathered; raises on every rank (they all see the
    same data) unless the slices tile [0, dim) in rank order: ranks that were given
    different partitions would otherwise compute wrong results without an error."""
    part = comm.all_gather(np.array([[offset, local]], dtype=np.int64)).tolist()
    expect = 0
    for r, (o, s) in enumerate(part):
        if o != expect or s < 0:
            raise ValueError(f"{who}: the ranks disagree on the partition: rank {r} holds [{o}, {o + s}) but the "
                             f"slices before it end at {expect} (gathered: {part}); pass the same partition everywhere")
        expect = o + s
    if expect != dim:
        raise ValueError(f"{who}: the ranks' slices cover {expect} of {dim} (gathered: {part})")
    return part


def _even_blocks(n: int, world: int, blk: int) -> List[Tuple[int, int]]:
    """The even split of n in whole blocks of blk (a quantized row-parallel weight's default)."""
    return partition(n, world, align=blk)


def partition_sizes(part, dim, world, what, who="partition"):
    """Each rank's size from a partition given as sizes or as tpcore.partition()'s (offset, size)
    pairs (whose offsets must then be the running sums of the sizes)."""
    if part is None:
        return None
    want = f"{who} must be a list of {world} sizes (one per rank) or tpcore.partition()'s (offset, size) pairs"
    if isinstance(part, (str, bytes, dict)) or not hasattr(part, "__iter__"):
        raise TypeError(f"{want}, got {shown(part)}")
    part = list(part)
    pairs = bool(part) and all(isinstance(p, (tuple, list)) for p in part)
    if pairs and not all(len(p) == 2 for p in part) or not pairs and any(isinstance(p, (tuple, list)) for p in part):
        raise TypeError(f"{want}, got {shown(part)}")
    flat = [x for p in part for x in p] if pairs else part
    if not all(is_int(x) for x in flat):
        raise TypeError(f"{want}, got {shown(part)}")
    sizes = [int(p[1]) for p in part] if pairs else [int(p) for p in part]
    if len(sizes) != world:
        raise ValueError(f"{who} has {len(sizes)} entries, expected one per rank ({world})")
    if any(s < 0 for s in sizes) or sum(sizes) != dim:
        raise ValueError(f"{who} {sizes} must be non-negative and sum to {what}={dim} (sums to {sum(sizes)})")
    if pairs:
        offsets = [int(p[0]) for p in part]
        expect = [sum(sizes[:r]) for r in range(world)]
        if offsets != expect:
            raise ValueError(f"{who}: the (offset, size) pairs {[tuple(p) for p in part]} do not tile [0, {dim}) in "
                             f"rank order (offsets {offsets}, expected {expect})")
    return sizes


def _plan_sizes(plan, comm: Comm, n: int, who: str, partition, prefer: str = "ffn"):
    """partition, or the split of the dimension of length n in plan (a tpcore.Plan; not both)."""
    if plan is None:
        return partition
    from tpcore.nn.plan import plan_arg
    return plan_arg(plan, comm, who, partition=partition).sizes_for(n, who, prefer)
