"""Parallelism across layers and devices, above the layers and models.

- `pipeline`: `PipelineLM`, pipeline stages of a model over a `ProcessGrid`.
- `planner`: `plan_partition`: every rank measures its speed, and all share one `tpcore.nn.plan.Plan`.

Imports: tpcore.utils, tpcore.distributed, tpcore.io, tpcore.nn, tpcore.models.
"""
