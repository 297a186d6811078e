"""Serving: the continuous-batching engine and the OpenAI-compatible server over it.

- `engine`: `Engine`, `Request`: requests admitted and decoded together, SPMD on every rank.
- `driver`: the serving loop (rank 0 broadcasts each step's submissions and cancellations).
- `openai_protocol`, `openai_api`: the OpenAI API's requests checked, the Starlette app.
- `cli`: ``python -m tpcore.serve MODEL [-n N]`` (``tpcore-serve``).  Not imported here, so that
  ``python -m tpcore.serve`` runs without a warning and the HTTP stack loads only when serving.

Imports: tpcore.utils, tpcore.distributed, tpcore.nn, tpcore.models.
"""
from tpcore.serve.engine import Engine, Request

__all__ = ["Engine", "Request"]
