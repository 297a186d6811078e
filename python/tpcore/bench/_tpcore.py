"""tpcore's side of the collectives benchmark: the Impl that `sweep` drives on
each rank of `tpcore.spawn`."""
from __future__ import annotations

import numpy as np

from tpcore.bench._sweep import Case, Impl, Plan, Progress, element_count, numpy_dtype, sweep


class TpcoreImpl(Impl):
    """Collectives of a tpcore communicator, in place as NCCL's in-place mode:

    all_reduce, broadcast   one buffer
    all_gather              the rank's input is its block of the output
    reduce_scatter          the rank's output is its block of the input
    all_to_all              out of place (it has no in-place form): an output
                            beside the input, count // n elements to each rank

    mode "private": ordinary NumPy arrays (allocated per size);
    mode "registered": views at offset 0 of one `comm.alloc` array, so every
    rank's arrays lie at the same offset of the same allocation and the
    zero-copy path can be taken."""

    name = "tpcore"

    def __init__(self, comm, plan: Plan):
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        dtype = numpy_dtype(plan.dtype)
        self._registered = None
        if "registered" in plan.modes:
            top = max(element_count(op, s, self.size, dtype.itemsize) * (2 if op == "all_to_all" else 1)
                      for op in plan.ops for s in plan.sizes)
            self._registered = comm.alloc(top, dtype)  # collective: every rank asks for the same

    def barrier(self) -> None:
        self.comm.barrier()

    def agree(self, value: int) -> int:
        a = np.array([value], dtype=np.int64)
        self.comm.broadcast(a, root=0)
        return int(a[0])

    def zero_copy_calls(self) -> int:
        return int(self.comm.stats()["zero_copy"])

    def case(self, op: str, mode: str, count: int, dtype: np.dtype) -> Case:
        comm, r, n = self.comm, self.rank, self.size
        if mode == "registered":
            buf = self._registered[:count]
        else:
            buf = np.zeros(count, dtype=dtype)
        if op == "all_to_all":
            out = self._registered[count:2 * count] if mode == "registered" else np.zeros(count, dtype=dtype)
            sizes = [count // n] * n
            return Case(buf, out, lambda: comm.all_to_all(buf, sizes, sizes, out=out))
        if op == "all_reduce":
            return Case(buf, buf, lambda: comm.all_reduce(buf))
        if op == "broadcast":
            return Case(buf, buf, lambda: comm.broadcast(buf, root=0))
        c = count // n
        block = buf[r * c:(r + 1) * c]
        if op == "all_gather":
            return Case(block, buf, lambda: comm.all_gather(block, out=buf))
        if op == "reduce_scatter":
            return Case(buf, block, lambda: comm.reduce_scatter(buf, out=block))
        raise ValueError(f"unknown op {op!r}")


def rank_main(comm, plan_json: dict, progress: bool) -> list:
    """The function tpcore.spawn runs on every rank."""
    plan = Plan.from_json(plan_json)
    return sweep(TpcoreImpl(comm, plan), plan, Progress(progress))
