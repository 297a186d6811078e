"""Serving: the continuous-batching engine.

- `engine`: `Engine`, `Request`: requests admitted and decoded together, SPMD on every rank.

Imports: tpcore.utils, tpcore.distributed, tpcore.nn, tpcore.models.
"""
from tpcore.serve.engine import Engine, Request

__all__ = ["Engine", "Request"]
