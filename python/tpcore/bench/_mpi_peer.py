"""MPI peer of the collectives benchmark, run under mpirun:

    mpirun -n N python -m tpcore.bench._mpi_peer PLAN.json OUT.json [--no-progress]

Every rank runs the shared `sweep` with mpi4py on NumPy buffers
(Allreduce / Allgather / Reduce_scatter_block with MPI_IN_PLACE, Bcast);
rank 0 gathers all ranks' rows and writes them, with the MPI library version,
to OUT.json.

    mpirun -n N python -m tpcore.bench._mpi_peer PLAN.json OUT.json --tpcore

runs tpcore's own sweep (TpcoreImpl, private arrays) on tpcore.init(backend="mpi")
instead; every rank writes its rows to OUT.json.<rank> and rank 0 joins them into
OUT.json once a barrier says all are written.
"""
from __future__ import annotations

import json
import sys
import traceback

import numpy as np

from tpcore.bench._sweep import Case, Impl, Plan, Progress, sweep


class MpiImpl(Impl):
    name = "mpi"

    def __init__(self, comm, MPI):
        self.comm, self.MPI = comm, MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def agree(self, value: int) -> int:
        return int(self.comm.bcast(value, root=0))

    def unsupported(self, op: str, mode: str):
        return None if mode == "private" else "no registered memory in this MPI peer"

    def case(self, op: str, mode: str, count: int, dtype: np.dtype) -> Case:
        comm, IN_PLACE, r, n = self.comm, self.MPI.IN_PLACE, self.rank, self.size
        buf = np.zeros(count, dtype=dtype)
        if op == "all_reduce":
            return Case(buf, buf, lambda: comm.Allreduce(IN_PLACE, buf))
        if op == "broadcast":
            return Case(buf, buf, lambda: comm.Bcast(buf, root=0))
        if op == "all_to_all":  # out of place, as tpcore's
            out = np.zeros(count, dtype=dtype)
            return Case(buf, out, lambda: comm.Alltoall(buf, out))
        c = count // n
        if op == "all_gather":  # in place: the input is the rank's block of the output
            return Case(buf[r * c:(r + 1) * c], buf, lambda: comm.Allgather(IN_PLACE, buf))
        if op == "reduce_scatter":  # in place: the result lands in the first block
            return Case(buf, buf[:c], lambda: comm.Reduce_scatter_block(IN_PLACE, buf))
        raise ValueError(f"unknown op {op!r}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    plan_file, out_file = argv[0], argv[1]
    progress = "--no-progress" not in argv[2:]
    if "--tpcore" in argv[2:]:
        return _tpcore_main(plan_file, out_file, progress)
    import mpi4py
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        with open(plan_file) as f:
            plan = Plan.from_json(json.load(f))
        rows = sweep(MpiImpl(comm, MPI), plan, Progress(progress))
        gathered = comm.gather(rows, root=0)
    except BaseException:  # noqa: BLE001 - one rank's failure must end the job
        sys.stderr.write(f"[mpi rank {comm.Get_rank()}] {traceback.format_exc()}")
        sys.stderr.flush()
        comm.Abort(1)
        return 1
    if comm.Get_rank() == 0:
        out = {"ranks": gathered, "library": MPI.Get_library_version().strip(),
               "vendor": "{} {}".format(MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
               "mpi4py": mpi4py.__version__, "nranks": comm.Get_size()}
        with open(out_file, "w") as f:
            json.dump(out, f)
    return 0


def _tpcore_main(plan_file: str, out_file: str, progress: bool) -> int:
    import os

    import tpcore
    from tpcore.bench._tpcore import TpcoreImpl

    comm = tpcore.init(backend="mpi")
    with open(plan_file) as f:
        plan = Plan.from_json(json.load(f))
    rows = sweep(TpcoreImpl(comm, plan), plan, Progress(progress))
    with open(f"{out_file}.{comm.rank}", "w") as f:
        json.dump(rows, f)
    comm.barrier()
    if comm.rank == 0:
        ranks = []
        for r in range(comm.size):
            with open(f"{out_file}.{r}") as f:
                ranks.append(json.load(f))
            os.remove(f"{out_file}.{r}")
        with open(out_file, "w") as f:
            json.dump({"ranks": ranks, "nranks": comm.size, "backend": comm.backend}, f)
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
