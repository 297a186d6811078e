"""Communicators and the job's ranks.

- `comm`: `Comm`, the NumPy face of the C communicator (collectives, send/recv, split, alloc).
- `init`: `init()`, the world communicator from the launcher's, torchrun's, MPI's or Slurm's variables.
- `env`: reading those variables into a `JobInfo`.
- `store`: the TCP rendezvous store (`Store`).
- `grid`: `ProcessGrid` (TP x DP x PP subgroups) and `average_gradients`.
- `agree`: checks that every rank of a communicator was given the same arguments.
- `throttle`: slowing one rank on purpose (a stand-in for a slower device), per rank from TPCORE_THROTTLE.
- `excepthook`: aborting a job's communicators when a rank dies of an uncaught exception.

Imports: tpcore.utils.
"""
