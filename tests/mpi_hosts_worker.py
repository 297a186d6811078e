"""One rank of a tensor-parallel model across simulated hosts (tests/launch/test_mpi_hosts.py), started
by mpirun inside network namespaces: tpcore.init(backend="mpi"), a TransformerLM split over every
rank of the job (its logits and greedy tokens), then the same model as a 2-stage pipeline with 2-way
TP stages (a training step's loss, greedy tokens), written to OUT/rank<r>.npz with this rank's
network namespace (to show that the ranks sat on different hosts)."""
import json
import os
import sys

import numpy as np

import tpcore


def main():
    cfg, tokens, prompts, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    comm = tpcore.init(backend="mpi", timeout=60)
    model = tpcore.models.TransformerLM(tpcore.Config(**cfg), comm, seed=7)
    logits = model.logits(np.array(tokens, np.int64))
    gen = model.generate(prompts, max_new_tokens=5)
    total = comm.all_reduce(np.array([comm.rank + 1.0]))[0]   # a plain collective across the hosts too
    # the same model as 2 pipeline stages (one per host: the TP pairs are consecutive ranks), each
    # 2-way tensor parallel inside its host; one training step's loss and the greedy tokens
    grid = tpcore.ProcessGrid(comm, tp=2, pp=2)
    pipe = tpcore.PipelineLM(tpcore.Config(**cfg), grid, seed=7)
    t = np.array(tokens, np.int64)
    loss = pipe.train_step(t, np.roll(t, -1, 1), micro_batches=2, schedule="1f1b")
    pgen = pipe.generate(prompts, max_new_tokens=5)
    pipe.close()
    grid.close()
    np.savez(os.path.join(out, f"rank{comm.rank}.npz"), logits=logits, gen=np.array(gen, np.int64),
             pp_loss=np.array(loss), pp_gen=np.array(pgen, np.int64),
             netns=np.array(os.readlink("/proc/self/ns/net")), world=np.array(comm.size),
             backend=np.array(comm.backend), total=np.array(total))
    comm.close()


if __name__ == "__main__":
    main()
