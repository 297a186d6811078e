"""Runtime properties: the GIL is released while a collective blocks, the
shared-memory segment is private (0600), named after the job, and unlinked as
soon as every rank has joined."""
import glob
import os
import stat
import threading
import time

import numpy as np

import tpcore
from conftest import JOB_PREFIX, run


def _gil(comm):
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    if comm.rank == 0:
        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.05)
        c0 = counter[0]
        comm.barrier()  # rank 1 arrives 0.5 s later; the GIL must be free meanwhile
        c1 = counter[0]
        stop.set()
        t.join()
        return c1 - c0
    time.sleep(0.5)
    comm.barrier()
    return None


def test_gil_released_while_waiting():
    progressed = run(_gil, 2)[0]
    assert progressed > 10_000, progressed


def test_segment_is_private_named_and_removed_by_the_last_rank():
    job = f"{JOB_PREFIX}modetest{os.getpid()}"
    made = {}

    def rank0():
        made["c0"] = tpcore._C.Comm(2, 0, job, 10.0)

    t = threading.Thread(target=rank0)
    t.start()
    deadline = time.monotonic() + 10
    paths = []
    while not paths and time.monotonic() < deadline:
        paths = glob.glob(f"/dev/shm/tpcore_{job}_*")
        time.sleep(0.001)
    assert len(paths) == 1
    assert stat.S_IMODE(os.stat(paths[0]).st_mode) == 0o600
    c1 = tpcore._C.Comm(2, 1, job, 10.0)  # rank 1 joins from this thread
    t.join()
    # The world name stays while the job lives: it is the job's claim on its id.
    assert glob.glob(f"/dev/shm/tpcore_{job}_*") == paths
    x = np.ones(3)
    res = []
    t = threading.Thread(target=lambda: res.append(made["c0"].all_reduce(x.copy(), np.empty(3), "sum")))
    t.start()
    y = c1.all_reduce(x.copy(), np.empty(3), "sum")
    t.join()
    assert list(y) == [2, 2, 2] and list(res[0]) == [2, 2, 2]
    # registered memory: same rule
    t = threading.Thread(target=lambda: res.append(made["c0"].alloc(4096)))
    t.start()
    b1 = c1.alloc(4096)
    t.join()
    assert glob.glob(f"/dev/shm/tpcore_{job}_*") == paths  # a registered buffer's name goes once all mapped it
    assert len(memoryview(b1)) == 4096 and len(memoryview(res[1])) == 4096
    made["c0"].close()
    assert glob.glob(f"/dev/shm/tpcore_{job}_*") == paths  # rank 1 still holds it
    c1.close()
    assert glob.glob(f"/dev/shm/tpcore_{job}_*") == []  # the last one out removes it
