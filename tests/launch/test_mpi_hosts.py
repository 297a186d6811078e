"""A tensor-parallel model across two simulated hosts: Linux network namespaces joined by a veth
pair (tests/netns.py), Open MPI started inside the first one with an rsh agent that enters the
other (`ip netns exec`), tcp as the only transport between ranks, on the namespaces' own addresses.
Four ranks, two per host, one TransformerLM split over all four on the mpi backend: its logits and
greedy tokens equal world 1's; then the same model as two pipeline stages, one per host, each 2-way
tensor parallel: its training loss and greedy tokens equal world 1's.  And one or two ranks
SIGSTOPped: every other rank's timeout names them and their last call, over tcp.  (shm cannot span hosts;
the whole job runs on mpi: no hierarchical shm-within-a-host collectives in this version.)
Skips with the reason where namespaces cannot be made (no root, no iproute2) or the mpi
backend is not built."""
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import tpcore
from tpcore import _C
from conftest import rng_for, run
import netns
import paths

HERE = str(paths.TESTS)  # the worker scripts
PKG_PARENT = os.path.dirname(os.path.dirname(tpcore.__file__))
MPIRUN = shutil.which("mpirun")
WHY_NOT = _C.Comm.probe("mpi")

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.multihost,
    pytest.mark.skipif(MPIRUN is None, reason="mpirun is not on PATH (apt-get install openmpi-bin libopenmpi-dev)"),
    pytest.mark.skipif(WHY_NOT is not None, reason=f"mpi backend not usable here: {WHY_NOT}"),
]

CFG = dict(vocab_size=53, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, ffn_hidden=56, norm="rmsnorm",
           activation="swiglu", positions="rope", bias=False, max_positions=32, model_type="llama",
           tie_embeddings=False)


def _agent(path, hosts):
    """An rsh agent for mpirun: `agent [options] ADDR command...` runs the command in the namespace
    of the simulated host with that address."""
    cases = "\n".join(f"  {a}) ns={n} ;;" for a, n in zip(hosts.addr, hosts.names))
    with open(path, "w") as f:
        f.write("#!/bin/sh\nwhile [ \"${1#-}\" != \"$1\" ]; do shift; done\nhost=$1; shift\n"
                f"case $host in\n{cases}\n  *) echo \"no simulated host $host\" >&2; exit 255 ;;\nesac\n"
                "exec ip netns exec \"$ns\" sh -c \"$*\"\n")
    os.chmod(path, 0o755)


def _mpirun_across(hosts, tmp_path, argv, **worker_env):
    """mpirun of four ranks, two on each simulated host, tcp only; (returncode, output).  Every
    process of the job is killed at the end: none outlives the namespaces."""
    agent = str(tmp_path / "agent.sh")
    _agent(agent, hosts)
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               **{k: str(v) for k, v in worker_env.items()})
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TPCORE_JOB_ID", "TPCORE_BACKEND",
              "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    net = "10.231.0.0/24"
    passed = ["PYTHONPATH", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", *worker_env]
    cmd = hosts.cmd(0, [MPIRUN, "--host", f"{hosts.addr[0]}:2,{hosts.addr[1]}:2", "-n", "4",
                        "--mca", "plm_rsh_agent", agent, "--mca", "btl", "tcp,self",
                        "--mca", "btl_tcp_if_include", net, "--mca", "oob_tcp_if_include", net,
                        *[a for k in passed for a in ("-x", k)], sys.executable, *argv])
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        text, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        text = "(timed out)"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # mpirun, its daemons and ranks
        except ProcessLookupError:
            pass
        p.wait()
    return p.returncode, text


def _world1(comm, tokens, prompts):
    model = tpcore.models.TransformerLM(tpcore.Config(**CFG), comm, seed=7)
    t = np.array(tokens, np.int64)
    logits, gen = model.logits(t), np.array(model.generate(prompts, max_new_tokens=5))
    return logits, gen, model.loss(t, np.roll(t, -1, 1))


def test_tp_and_pp_model_across_two_hosts_equals_world_1(tmp_path):
    g = rng_for(31, 0)
    tokens = g.integers(0, CFG["vocab_size"], (2, 9)).tolist()
    prompts = g.integers(0, CFG["vocab_size"], (2, 4)).tolist()
    want_logits, want_gen, want_loss = run(_world1, 1, tokens, prompts)[0]
    out = tmp_path / "out"
    out.mkdir()
    with netns.hosts_or_skip(2) as hosts:
        rc, text = _mpirun_across(hosts, tmp_path, [os.path.join(HERE, "mpi_hosts_worker.py"), json.dumps(CFG),
                                                    json.dumps(tokens), json.dumps(prompts), str(out)])
        assert rc == 0, text[-4000:]
    ranks = [np.load(out / f"rank{r}.npz") for r in range(4)]
    spaces = [str(r["netns"]) for r in ranks]
    assert spaces[0] == spaces[1] != spaces[2] == spaces[3], spaces   # two ranks on each simulated host
    for r in ranks:
        assert int(r["world"]) == 4 and str(r["backend"]) == "mpi" and float(r["total"]) == 10.0
        assert np.allclose(r["logits"], want_logits, rtol=1e-4, atol=1e-5), \
            float(np.abs(r["logits"] - want_logits).max())
        assert r["gen"].tolist() == want_gen.tolist()
        assert r["pp_gen"].tolist() == want_gen.tolist()            # TP x PP = 2 x 2, a stage per host
        assert np.isclose(float(r["pp_loss"]), want_loss, rtol=1e-5)


def test_stopped_ranks_are_named_across_hosts(tmp_path):
    """One or two ranks SIGSTOPped, their peers waiting on both simulated hosts: every waiting
    rank's timeout names them and their last call, over tcp (tests/launch/test_mpi.py has the
    one-host case)."""
    g = random.Random()
    stop = sorted(g.sample(range(4), g.randint(1, 2)))
    out = tmp_path / "out"
    out.mkdir()
    with netns.hosts_or_skip(2) as hosts:
        try:
            rc, text = _mpirun_across(hosts, tmp_path, [os.path.join(HERE, "mpi_worker.py"), "stop"],
                                      MPI_TEST_OUT=out, MPI_TEST_TIMEOUT=5, MPI_TEST_STOP=",".join(map(str, stop)),
                                      MPI_TEST_CALLS="barrier,all_reduce", MPI_TEST_SEED=g.randrange(10**6))
        finally:  # the stopped ranks, should the job have left one
            for f in out.iterdir():
                for pid in re.findall(r"READY rank \d+ pid (\d+)", f.read_text()):
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
    lines = "".join(f.read_text() for f in sorted(out.iterdir()))
    assert rc != 0 and lines.count("READY rank") == 4, (stop, lines + text[-4000:])
    who = f"rank {stop[0]} did not arrive (its" if len(stop) == 1 else \
        f"ranks {stop[0]}, {stop[1]} did not arrive (their"
    for r in set(range(4)) - set(stop):
        assert (f"ERROR rank {r} after" in lines and f"all_reduce #3 on rank {r} of 4: timed out after 5.0 s: "
                f"{who} last call: all_reduce #2 at mpi_worker.py:") in lines, (stop, lines)
