"""Process grids: tensor x expert x data x pipeline parallel groups over one communicator.

    grid = tpcore.ProcessGrid(comm, tp=2, pp=1, dp=2)
    model = tpcore.models.TransformerLM(cfg, grid.tp)          # split over the TP group
    ...; model.backward(); grid.average_gradients(model)        # DP: mean over the replicas
    opt.step()

Rank layout (Megatron-Core's default order tp-ep-dp-pp, with ep carved out of the data
parallelism of the dense layers): TP innermost, then EP, then DP, then PP:

    rank = tp_rank + tp * (ep_rank + ep * (dp_rank + dp * pp_rank))

so the ranks of a TP group are consecutive (the ones that talk every layer share a host
when the launcher fills hosts in rank order), the ranks of an EP group tp apart, the
replicas of a DP group tp x ep apart and the stages of a PP group tp x ep x dp apart.
With ep = 1 (the default) this is the tp-dp-pp layout of before.

The expert-parallel ranks hold different experts and process different tokens: for the
dense layers (attention, embeddings, norms, routers) they are data-parallel replicas too,
so the dense parameters' data-parallel group is ep x dp (`grid.ep_dp`, Megatron's dp),
while an expert's replicas are the dp ranks of the same ep rank (`grid.dp`, Megatron's
expert-data-parallel group).  `average_gradients` averages each over its group.

grid.tp, grid.ep, grid.pp and grid.dp are the sub-communicators (tpcore.Comm, each made by
one split; grid.ep_dp too when ep > 1, else it is grid.dp); grid.coords(r) gives a rank's
(tp, pp, dp) coordinates, grid.coordinates(r) all four, grid.rank_of(tp=, pp=, dp=, ep=)
the inverse.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from tpcore.utils.args import int_arg, shown
from tpcore.utils.arrays import DeviceArray
from tpcore.distributed.comm import Comm

__all__ = ["ProcessGrid", "average_gradients"]


class ProcessGrid:
    """TP x EP x DP x PP groups over comm (Megatron's layout: tp fastest, then ep, dp, pp).

    Parameters
    ----------
    comm : Comm
        The ranks to arrange; comm.size must be tp * ep * pp * dp.
    tp : int, default 1
        Tensor-parallel group size.
    pp : int, default 1
        Pipeline stages.
    dp : int, optional
        Data-parallel replicas (of the experts; the dense layers have ep x dp).  Default
        None: comm.size // (tp * ep * pp).
    ep : int, default 1
        Expert-parallel group size (`tpcore.nn.MoE` over grid.ep).

    Attributes
    ----------
    tp, ep, pp, dp : Comm
        This rank's tensor-, expert-, pipeline- and data-parallel communicators.
    ep_dp : Comm
        The dense layers' data-parallel group: the ep x dp ranks of this rank's (tp, pp)
        (grid.dp itself when ep = 1).
    tp_rank, ep_rank, pp_rank, dp_rank : int
        This rank's coordinates.
    sizes : dict
        {"tp": tp, "pp": pp, "dp": dp, "ep": ep}.

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
    them), then four splits (five when ep > 1).
    """

    def __init__(self, comm: Comm, tp: int = 1, pp: int = 1, dp: Optional[int] = None, ep: int = 1) -> None:
        if not isinstance(comm, Comm):
            raise TypeError(f"ProcessGrid: comm must be a tpcore.Comm, got {shown(comm)}")
        tp = int_arg(tp, "ProcessGrid", "tp", lo=1)
        pp = int_arg(pp, "ProcessGrid", "pp", lo=1)
        ep = int_arg(ep, "ProcessGrid", "ep", lo=1)
        if dp is None:
            if comm.size % (tp * pp * ep):
                what = f"tp x pp = {tp} x {pp}" if ep == 1 else f"tp x pp x ep = {tp} x {pp} x {ep}"
                raise ValueError(f"ProcessGrid: {what} does not divide the world size {comm.size}")
            dp = comm.size // (tp * pp * ep)
        dp = int_arg(dp, "ProcessGrid", "dp", lo=1)
        if tp * pp * dp * ep != comm.size:
            what = f"tp x pp x dp = {tp} x {pp} x {dp}" if ep == 1 else \
                f"tp x pp x dp x ep = {tp} x {pp} x {dp} x {ep}"
            raise ValueError(f"ProcessGrid: {what} = {tp * pp * dp * ep}, but the communicator has {comm.size} ranks")
        # every rank must have asked for the same grid: a mismatch would pair the wrong ranks
        mine = np.array([tp, pp, dp, ep], np.int64)
        every = comm.all_gather(mine.reshape(1, 4))
        if not (every == mine).all():
            raise ValueError(f"ProcessGrid: the ranks asked for different grids (tp, pp, dp, ep per rank: "
                             f"{every.tolist()}); pass the same sizes everywhere")
        self.comm = comm
        self.sizes: Dict[str, int] = {"tp": tp, "pp": pp, "dp": dp, "ep": ep}
        c = self.coordinates(comm.rank)
        t, p, d, e = c["tp"], c["pp"], c["dp"], c["ep"]
        self.tp_rank, self.pp_rank, self.dp_rank, self.ep_rank = t, p, d, e
        # one split per group: the color names the group (its lowest rank), the key orders it
        self.tp: Comm = _member(comm.split(self.rank_of(0, p, d, e), t))
        self.dp: Comm = _member(comm.split(self.rank_of(t, p, 0, e), d))
        self.pp: Comm = _member(comm.split(self.rank_of(t, 0, d, e), p))
        self.ep: Comm = _member(comm.split(self.rank_of(t, p, d, 0), e))
        self.ep_dp: Comm = self.dp if ep == 1 else _member(comm.split(self.rank_of(t, p, 0, 0), d * ep + e))

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
        c = self.coordinates(rank)
        return c["tp"], c["pp"], c["dp"]

    def coordinates(self, rank: int) -> Dict[str, int]:
        """{"tp", "ep", "dp", "pp"} coordinates of a rank of the grid's communicator.

        Parameters
        ----------
        rank : int
            0 <= rank < comm.size.

        Returns
        -------
        dict of str to int
        """
        rank = int_arg(rank, "ProcessGrid.coords", "rank", lo=0, hi=self.comm.size - 1)
        tp, ep, dp = self.sizes["tp"], self.sizes["ep"], self.sizes["dp"]
        return {"tp": rank % tp, "ep": (rank // tp) % ep, "dp": (rank // (tp * ep)) % dp, "pp": rank // (tp * ep * dp)}

    def rank_of(self, tp: int = 0, pp: int = 0, dp: int = 0, ep: int = 0) -> int:
        """The rank of the grid's communicator at (tp, pp, dp, ep).

        Parameters
        ----------
        tp, pp, dp, ep : int, default 0
            Coordinates within the sizes.

        Returns
        -------
        int
        """
        t = int_arg(tp, "ProcessGrid.rank_of", "tp", lo=0, hi=self.sizes["tp"] - 1)
        p = int_arg(pp, "ProcessGrid.rank_of", "pp", lo=0, hi=self.sizes["pp"] - 1)
        d = int_arg(dp, "ProcessGrid.rank_of", "dp", lo=0, hi=self.sizes["dp"] - 1)
        e = int_arg(ep, "ProcessGrid.rank_of", "ep", lo=0, hi=self.sizes["ep"] - 1)
        return t + self.sizes["tp"] * (e + self.sizes["ep"] * (d + self.sizes["dp"] * p))

    def average_gradients(self, params: Any, bucket_bytes: int = 1 << 22) -> int:
        """Every gradient of params averaged over the DP group (`tpcore.average_gradients`).

        With ep > 1 the expert-parallel ranks ran different tokens: the dense gradients are
        averaged over grid.ep_dp, and each expert's (the pairs of ``expert_parameters()`` of
        the modules, their ``blocks`` and their blocks' ``moe``) over grid.dp and divided by
        ep (an expert's gradient already sums the tokens of its whole EP group).

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
        Collective over the DP group (ep > 1: over ep_dp, then over dp).
        """
        ep = self.sizes["ep"]
        if ep == 1:
            return average_gradients(params, self.dp, bucket_bytes)
        experts = {id(g) for _, g in _expert_pairs(params)}
        pairs = [(p, g) for p, g in _pairs(params)]
        calls = average_gradients([pg for pg in pairs if id(pg[1]) not in experts], self.ep_dp, bucket_bytes)
        mine = [pg for pg in pairs if id(pg[1]) in experts]
        calls += average_gradients(mine, self.dp, bucket_bytes)
        for _, g in mine:
            g *= 1.0 / ep
        return calls

    def close(self) -> None:
        """Release the sub-communicators (the grid's comm stays open)."""
        for c in (self.tp, self.pp, self.dp, self.ep) + ((self.ep_dp,) if self.ep_dp is not self.dp else ()):
            c.close()

    def __repr__(self) -> str:
        s = self.sizes
        ep = f", ep={s['ep']}" if s["ep"] > 1 else ""
        at = f", ep {self.ep_rank}" if s["ep"] > 1 else ""
        return (f"ProcessGrid(tp={s['tp']}, pp={s['pp']}, dp={s['dp']}{ep}; rank {self.comm.rank} at tp "
                f"{self.tp_rank}, pp {self.pp_rank}, dp {self.dp_rank}{at})")


def _member(c: Optional[Comm]) -> Comm:
    """A split's communicator (every rank passes a color, so there always is one)."""
    assert c is not None
    return c


def _pairs(params):
    """The (param, grad) pairs of a module, a list of modules or pairs, in order."""
    if hasattr(params, "parameters"):
        params = [params]
    out = []
    for p in params:
        if hasattr(p, "parameters"):
            out.extend(_pairs(p.parameters()))
        elif isinstance(p, (tuple, list)) and len(p) == 2:
            out.append((p[0], p[1]))
        else:
            raise TypeError(f"average_gradients: params must be modules or (param, grad) pairs, got {shown(p)}")
    return out


def _expert_pairs(params):
    """The pairs of the experts of a module (expert_parameters()), of its blocks and their .moe."""
    mods = [params] if hasattr(params, "parameters") else [p for p in params if hasattr(p, "parameters")]
    out = []
    for m in mods:
        for sub in [m] + list(getattr(m, "blocks", [])):
            sub = sub if hasattr(sub, "expert_parameters") else getattr(sub, "moe", None)
            if sub is not None and hasattr(sub, "expert_parameters"):
                out.extend(sub.expert_parameters())
    return out


def _grads(params):
    """The gradients of a module, a list of modules or (param, grad) pairs, in order."""
    return [g for _, g in _pairs(params)]


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

