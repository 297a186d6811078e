"""Benchmarks of tpcore.

    python -m tpcore.bench collectives [options]    collectives vs memcpy, gloo and MPI
    python -m tpcore.bench layers [options]         ParallelMLP vs NumPy GEMMs and torch/gloo
    python -m tpcore.bench decode [options]         a transformer's prefill/decode at 1, 2, 4 ranks vs torch
    python -m tpcore.bench families [options]       each model family's decode speed vs a Llama of its size
    python -m tpcore.bench gpu [options]            GEMMs vs torch.matmul, decode vs HF generate (GPU)
    python -m tpcore.bench parallelism [options]    one model trained as data, tensor and pipeline parallel
    python -m tpcore.bench hetero [options]         one rank throttled: equal vs speed-planned shards
    python -m tpcore.bench report [options]         the 1-vs-N report: speed, memory, collectives, serving
    python -m tpcore.bench serve [options]          continuous batching at concurrency 1, 4, 16 per world size
    python -m tpcore.bench sched [options]          chunked prefill, prefix caching, preemption, measured
    python -m tpcore.bench parity --checkpoint X    perplexity, KL vs 1 rank (and transformers), greedy agreement

`python -m tpcore.bench --help` lists the subcommands; each has its own
--help.  Optional extras: matplotlib for --plot (pip install 'tpcore[bench]'),
torch for the gloo peers, mpi4py + Open MPI for the MPI peer, threadpoolctl
(layers: NumPy's BLAS threads set to tpcore's).  Nothing here is imported by
`import tpcore`.
"""

# subcommand -> module in this package with add_arguments(parser), run(args) and a docstring
SUBCOMMANDS = {
    "collectives": "collectives",
    "layers": "layers",
    "decode": "decode",
    "families": "families",
    "gpu": "gpu",
    "parallelism": "parallelism",
    "hetero": "hetero",
    "report": "report",
    "serve": "serve",
    "sched": "sched",
    "parity": "parity",
}
