"""Process grids: tensor x pipeline x data parallel groups over one communicator.

    grid = tpcore.ProcessGrid(comm, tp=2, pp=1, dp=2)
    model = tpcore.models.TransformerLM(cfg, grid.tp)          # split over the TP group
    ...; model.backward(); grid.average_gradients(model)        # DP: mean over the replicas
    opt.step()

Rank layout (Megatron's default order, tp-dp-pp): TP innermost, then DP, then PP:

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so the ranks of a TP group are consecutive (the ones that talk every layer share a host
when the launcher fills hosts in rank order), the replicas of a DP group are tp apart,
and the stages of a PP group tp x dp apart.  grid.tp, grid.pp and grid.dp are the
sub-communicators (tpcore.Comm, each made by one split); grid.coords(r) gives a rank's
(tp, pp, dp) coordinates, grid.rank_of(tp=, pp=, dp=) the inverse.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from tpcore.utils.args import int_arg, shown
from tpcore.utils.arrays import DeviceArray
from tpcore.distributed.comm import Comm

__all__ = ["ProcessGrid", "average_gradients"]


class ProcessGrid:
    """TP x PP x DP groups over comm (Megatron's layout: tp fastest, then dp, then pp).

    Parameters
    ----------
    comm : Comm
        The ranks to arrange; comm.size must be tp * pp * dp.
    tp : int, default 1
        Tensor-parallel group size.
    pp : int, default 1
        Pipeline stages.
    dp : int, optional
        Data-parallel replicas.  Default None: comm.size // (tp * pp).

    Attributes
    ----------
    tp, pp, dp : Comm
        This rank's tensor-, pipeline- and data-parallel communicators.
    tp_rank, pp_rank, dp_rank : int
        This rank's coordinates.
    sizes : dict
        {"tp": tp, "pp": pp, "dp": dp}.

    Raises
    ------
    TypeError
        comm not a Comm, a size not an int.
    ValueError
        A size < 1, sizes that do not multiply to comm.size, or ranks that asked for
        different grids.

    Notes
    -----
    Collective: every rank of comm makes it with the same sizes (an all-gather checks
    them), then three splits.
    """

    def __init__(self, comm: Comm, tp: int = 1, pp: int = 1, dp: Optional[int] = None) -> None:
        if not isinstance(comm, Comm):
            raise TypeError(f"ProcessGrid: comm must be a tpcore.Comm, got {shown(comm)}")
        tp = int_arg(tp, "ProcessGrid", "tp", lo=1)
        pp = int_arg(pp, "ProcessGrid", "pp", lo=1)
        if dp is None:
            if comm.size % (tp * pp):
                raise ValueError(f"ProcessGrid: tp x pp = {tp} x {pp} does not divide the world size {comm.size}")
            dp = comm.size // (tp * pp)
        dp = int_arg(dp, "ProcessGrid", "dp", lo=1)
        if tp * pp * dp != comm.size:
            raise ValueError(f"ProcessGrid: tp x pp x dp = {tp} x {pp} x {dp} = {tp * pp * dp}, but the communicator "
                             f"has {comm.size} ranks")
        # every rank must have asked for the same grid: a mismatch would pair the wrong ranks
        mine = np.array([tp, pp, dp], np.int64)
        every = comm.all_gather(mine.reshape(1, 3))
        if not (every == mine).all():
            raise ValueError(f"ProcessGrid: the ranks asked for different grids (tp, pp, dp per rank: "
                             f"{every.tolist()}); pass the same sizes everywhere")
        self.comm = comm
        self.sizes: Dict[str, int] = {"tp": tp, "pp": pp, "dp": dp}
        t, p, d = self.coords(comm.rank)
        self.tp_rank, self.pp_rank, self.dp_rank = t, p, d
        # one split per group: the color names the group (the other two coordinates), the key orders it
        self.tp: Comm = _member(comm.split(p * dp + d, t))
        self.dp: Comm = _member(comm.split(p * tp + t, d))
        self.pp: Comm = _member(comm.split(d * tp + t, p))

    def coords(self, rank: int) -> Tuple[int, int, int]:
        """(tp, pp, dp) coordinates of a rank of the grid's communicator.

        Parameters
        ----------
        rank : int
            0 <= rank < comm.size.

        Returns
        -------
        (int, int, int)
        """
        rank = int_arg(rank, "ProcessGrid.coords", "rank", lo=0, hi=self.comm.size - 1)
        tp, dp = self.sizes["tp"], self.sizes["dp"]
        return rank % tp, rank // (tp * dp), (rank // tp) % dp

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """The rank of the grid's communicator at (tp, pp, dp).

        Parameters
        ----------
        tp, pp, dp : int, default 0
            Coordinates within the sizes.

        Returns
        -------
        int
        """
        t = int_arg(tp, "ProcessGrid.rank_of", "tp", lo=0, hi=self.sizes["tp"] - 1)
        p = int_arg(pp, "ProcessGrid.rank_of", "pp", lo=0, hi=self.sizes["pp"] - 1)
        d = int_arg(dp, "ProcessGrid.rank_of", "dp", lo=0, hi=self.sizes["dp"] - 1)
        return t + self.sizes["tp"] * (d + self.sizes["dp"] * p)

    def average_gradients(self, params: Any, bucket_bytes: int = 1 << 22) -> int:
        """Every gradient of params averaged over the DP group (`tpcore.average_gradients`).

        Parameters
        ----------
        params : module, list of modules, or list of (param, grad) pairs
        bucket_bytes : int, default 4 MiB
            Bucket size of the host gradients.

        Returns
        -------
        int
            The number of all-reduces made.

        Notes
        -----
        Collective over the DP group.
        """
        return average_gradients(params, self.dp, bucket_bytes)

    def close(self) -> None:
        """Release the sub-communicators (the grid's comm stays open)."""
        for c in (self.tp, self.pp, self.dp):
            c.close()

    def __repr__(self) -> str:
        s = self.sizes
        return (f"ProcessGrid(tp={s['tp']}, pp={s['pp']}, dp={s['dp']}; rank {self.comm.rank} at tp {self.tp_rank}, "
                f"pp {self.pp_rank}, dp {self.dp_rank})")


def _member(c: Optional[Comm]) -> Comm:
    """A split's communicator (every rank passes a color, so there always is one)."""
    assert c is not None
    return c


def _grads(params):
    """The gradients of a module, a list of modules or (param, grad) pairs, in order."""
    if hasattr(params, "parameters"):
        params = [params]
    out = []
    for p in params:
        if hasattr(p, "parameters"):
            out.extend(_grads(p.parameters()))
        elif isinstance(p, (tuple, list)) and len(p) == 2:
            out.append(p[1])
        else:
            raise TypeError(f"average_gradients: params must be modules or (param, grad) pairs, got {shown(p)}")
    return out


def average_gradients(params: Any, comm: Comm, bucket_bytes: int = 1 << 22) -> int:
    """Each gradient of params replaced by its mean over comm's ranks (data parallelism).

    The replicas ran the same model on different micro-batches.  Host float32 gradients
    travel in buckets of up to bucket_bytes (consecutive gradients packed into one buffer:
    one all-reduce instead of one per small tensor, as PyTorch DDP and Megatron bucket);
    device gradients (DeviceArrays) are averaged one by one where they live.

    Parameters
    ----------
    params : module, list of modules, or list of (param, grad) pairs
        Anything with ``parameters()`` (a layer, a model), or the pairs themselves.
    comm : Comm
        The data-parallel group.
    bucket_bytes : int, default 4194304 (4 MiB)
        The largest bucket, >= 4.

    Returns
    -------
    int
        The number of all-reduces made (0 on one rank).

    Raises
    ------
    TypeError
        comm not a Comm, params not modules or pairs.
    CommError
        The ranks' gradients differ in shape or order (the all-reduce's error).

    Notes
    -----
    Collective over comm: all-reduces with op "avg".
    """
    if not isinstance(comm, Comm):
        raise TypeError(f"average_gradients: comm must be a tpcore.Comm, got {shown(comm)}")
    bucket_bytes = int_arg(bucket_bytes, "average_gradients", "bucket_bytes", lo=4)
    grads = _grads(params)
    if comm.size == 1:
        return 0
    calls = 0
    pending, size = [], 0

    def flush():
        nonlocal calls, pending, size
        if not pending:
            return
        if len(pending) == 1:
            comm.all_reduce(pending[0], op="avg")
        else:
            buf = np.concatenate([g.reshape(-1) for g in pending])
            comm.all_reduce(buf, op="avg")
            at = 0
            for g in pending:
                g.reshape(-1)[...] = buf[at:at + g.size]
                at += g.size
        calls += 1
        pending, size = [], 0

    for g in grads:
        if isinstance(g, DeviceArray):
            comm.all_reduce(g, op="avg")
            calls += 1
            continue
        if not isinstance(g, np.ndarray) or g.dtype != np.float32 or not g.flags.c_contiguous or \
                not g.flags.writeable:
            raise TypeError(f"average_gradients: a gradient must be a writable C-contiguous float32 array or a "
                            f"tpcore.DeviceArray, got {shown(g)}")
        if size and size + g.nbytes > bucket_bytes:
            flush()
        pending.append(g)
        size += g.nbytes
    flush()
    return calls

