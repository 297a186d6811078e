"""Parallelism across layers and devices, above the layers and models.

- `pipeline`: `PipelineLM`, pipeline stages of a model over a `ProcessGrid`: the schedules
  (GPipe, 1F1B) drive each stage through `TransformerLM`'s stage interface.
- `planner`: `plan_partition`: every rank measures its speed, and all share one `tpcore.nn.plan.Plan`.

Imports: tpcore.utils, tpcore.distributed, tpcore.io, tpcore.nn, tpcore.models.
"""
