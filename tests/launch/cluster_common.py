"""Helpers shared by the Cluster tests (test_cluster.py, test_cluster_lifecycle.py): the test
process's children, a process's liveness, functions defined as in a notebook, a rank function
returning its pid, and Interrupter, a stdout that sends this process SIGINT once
every rank started."""
import os
import signal

import numpy as np

import tpcore

# the folder holding the tpcore under test: python/ in a checkout with an in-place build, or
# site-packages after pip install (python/ of a fresh clone has no built extension)
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))
DEADLINE = 60


def children() -> set:
    """Process ids of this process's live children (/proc; psutil is not installed)."""
    kids = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                kids |= {int(p) for p in f.read().split()}
        except OSError:
            pass
    return kids


def alive(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def as_main(src):
    """The functions of src as if defined in a notebook (module __main__, not importable by
    name): cloudpickle sends them by value, as it does a notebook's."""
    ns = {"__name__": "__main__", "np": np, "tpcore": tpcore}
    exec(compile(src, "<cell>", "exec"), ns)
    return ns


def rank_pid(comm):
    return os.getpid()


class Interrupter:
    """sys.stdout that sends this process SIGINT (a kernel interrupt) once every rank started."""

    def __init__(self, world):
        self.text, self.world, self.sent = "", world, False

    def write(self, s):
        self.text += s
        if not self.sent and all(f"[rank{r}] started" in self.text for r in range(self.world)):
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return len(s)

    def flush(self):
        pass
