"""Starting ranks: the launcher, spawn and Cluster.

- `launcher`: ``python -m tpcore.launch`` / ``tpcore-launch`` (`main`, `run`).
- `spawn`: `spawn(fn, n)`, fn on n local ranks from a script, pytest or Jupyter.
- `cluster`: `Cluster`, ranks kept alive across notebook cells.
- `cluster_rank`: the loop a Cluster's rank runs, and the relay of its file descriptors 1 and 2.
- `multinode`: a job over several hosts (the store, the shared secret).
- `relay`: ranks' output, prefixed and relayed line by line.

Imports: tpcore.utils, tpcore.distributed.
"""
from tpcore.launch.launcher import main, run

__all__ = ["main", "run"]
