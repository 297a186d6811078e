"""tpcore.Cluster: ranks that stay alive between calls (notebook cells).

Results at world 1..4 against float64 NumPy references, state kept between runs (the
`state` namespace and module-level globals of functions sent by value), output streamed
while a function runs, a rank's exception raised with its traceback and the cluster
reused after it (with and without an abort of the communicator), a dead rank, bad
arguments; spawn's clear error for a function a spawned process cannot import; and
examples/cluster.ipynb executed in a real kernel (nbclient).  Closing, interrupts and dying
ranks: test_cluster_lifecycle.py."""
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest

import tpcore
from conftest import WORLDS, leftover_segments, rng_for

import paths
from cluster_common import DEADLINE, PKG_PARENT, alive, as_main, children, rank_pid

ROOT = paths.ROOT


# -- results ------------------------------------------------------------------------
def _build(comm, state, W1, b1, W2, b2):
    state.mlp = tpcore.ParallelMLP(W1.shape[1], W1.shape[0], comm, activation="relu")
    state.mlp.fc1.load_full(W1, b1)
    state.mlp.fc2.load_full(W2, b2)
    return state.mlp.fc1.partition[comm.rank]


def _forward(comm, x, state):
    return state.mlp(x)


def _reduce_gather(comm, seed):
    g = rng_for(seed, comm.rank)
    x = g.standard_normal((3, 5)).astype(np.float32)
    s = comm.all_reduce(x.copy())
    part = g.standard_normal((comm.rank + 1, 2)).astype(np.float32)  # uneven along axis 0
    gathered = comm.all_gather(part, sizes=[r + 1 for r in range(comm.size)])
    return s, gathered


@pytest.mark.parametrize("world", WORLDS)
def test_results_match_numpy_at_every_world(world):
    g = np.random.default_rng(1000 + world)
    hidden, ffn = 7, 13  # odd: uneven shards
    W1 = g.standard_normal((ffn, hidden)).astype(np.float32)
    b1 = g.standard_normal(ffn).astype(np.float32)
    W2 = g.standard_normal((hidden, ffn)).astype(np.float32)
    b2 = g.standard_normal(hidden).astype(np.float32)
    with tpcore.Cluster(world, deadline=DEADLINE) as cluster:
        assert cluster.size == world and len(cluster.pids) == world
        parts = cluster.run(_build, W1, b1, W2, b2)
        assert sum(p[1] for p in parts) == ffn
        for _step in range(2):  # the model of the first run is used by the later ones
            x = g.standard_normal((3, hidden)).astype(np.float32)
            ref = np.maximum(x.astype(np.float64) @ W1.T.astype(np.float64) + b1, 0) @ W2.T.astype(np.float64) + b2
            ys = cluster.run(_forward, x)
            assert len(ys) == world
            for y in ys:
                np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
        seed = int(g.integers(1 << 30))
        out = cluster.run(_reduce_gather, seed)
        xs = [rng_for(seed, r).standard_normal((3, 5)).astype(np.float32) for r in range(world)]
        parts = []
        for r in range(world):
            gr = rng_for(seed, r)
            gr.standard_normal((3, 5))
            parts.append(gr.standard_normal((r + 1, 2)).astype(np.float32))
        want_sum = np.sum([a.astype(np.float64) for a in xs], axis=0)
        for s, gathered in out:
            np.testing.assert_allclose(s, want_sum, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(gathered, np.concatenate(parts))


# -- state ----------------------------------------------------------------------------
CELLS = '''
import numpy as np
def set_model(comm):
    global W
    W = np.arange(3.0) + comm.rank
    globals().setdefault("counter", 100 * comm.rank)

def bump(comm):
    global counter
    counter += 1
    return counter

def use_model(comm):
    return float(W.sum()), helper(comm.rank)

def helper(r):
    return "v1", r

def keyword_state(comm, x, *, state):
    state.seen = getattr(state, "seen", []) + [x]
    return list(state.seen)
'''


def test_state_and_globals_persist_between_runs():
    ns = as_main(CELLS)
    with tpcore.Cluster(3, deadline=DEADLINE) as cluster:
        cluster.run(ns["set_model"])
        assert cluster.run(ns["bump"]) == [1, 101, 201]
        assert cluster.run(ns["bump"]) == [2, 102, 202]
        assert cluster.run(ns["use_model"]) == [(3.0, ("v1", 0)), (6.0, ("v1", 1)), (9.0, ("v1", 2))]
        # defined after the cluster started: a new helper replaces the old one; the notebook's own W
        # does not replace the one the ranks set (the rank's value wins)
        ns2 = as_main(CELLS.replace('"v1"', '"v2"') + "\nW = np.zeros(3)\n")
        assert cluster.run(ns2["use_model"]) == [(3.0, ("v2", 0)), (6.0, ("v2", 1)), (9.0, ("v2", 2))]
        assert cluster.run(ns["keyword_state"], 1) == [[1]] * 3
        assert cluster.run(ns["keyword_state"], x=2) == [[1, 2]] * 3
        # the caller's own state= is passed as is
        assert cluster.run(ns["keyword_state"], 3, state=types_ns()) == [[3]] * 3
        assert cluster.run(lambda comm, state: state.seen[-1]) == [2] * 3
        # a function of an importable module keeps its module's globals (none are injected)
        assert cluster.run(_module_globals) == [False] * 3


def types_ns():
    return types.SimpleNamespace()


def _module_globals(comm):
    return "counter" in globals() or "W" in globals()


# -- output -----------------------------------------------------------------------------
class _Watch:
    """A stream (not a terminal) that records what is written, and creates `flag` once every
    rank's "waiting" line has arrived, which the ranks wait for: they only go on if their
    output reached the parent while they ran."""

    def __init__(self, world, flag):
        self.text, self.world, self.flag = "", world, flag

    def write(self, s):
        self.text += s
        if all(f"[rank{r}] waiting\n" in self.text for r in range(self.world)):
            self.flag.touch()
        return len(s)

    def flush(self):
        pass

    def isatty(self):
        return False


def _wait_for_flag(comm, flag):
    import sys
    print("waiting", flush=True)
    for i in range(3):
        sys.stderr.write(f"\rstep {i + 1}/3")
        sys.stderr.flush()
    sys.stderr.write("\n")
    t_end = time.monotonic() + 20
    while not os.path.exists(flag):
        if time.monotonic() > t_end:
            return False
        time.sleep(0.01)
    print(f"saw it\nline two of rank {comm.rank}", end="")  # no final newline: written at the end
    return True


def test_output_streams_while_the_function_runs(tmp_path, monkeypatch):
    world = 3
    out = _Watch(world, tmp_path / "flag")
    err = _Watch(0, tmp_path / "unused")
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with tpcore.Cluster(world, deadline=DEADLINE) as cluster:
        assert cluster.run(_wait_for_flag, str(tmp_path / "flag")) == [True] * world
    monkeypatch.undo()
    for r in range(world):
        mine = [ln[len(f"[rank{r}] "):] for ln in out.text.split("\n") if ln.startswith(f"[rank{r}] ")]
        assert mine == ["waiting", "saw it", f"line two of rank {r}"], out.text
        mine = [ln[len(f"[rank{r}] "):] for ln in err.text.split("\n") if ln.startswith(f"[rank{r}] ")]
        assert mine == ["step 1/3", "step 2/3", "step 3/3"], err.text  # one line per \r update
    for text in (out.text, err.text):
        assert "\r" not in text
        assert all(ln.startswith("[rank") and "] [rank" not in ln for ln in text.split("\n") if ln), text


# -- errors -----------------------------------------------------------------------------
ERRORS = '''
class ShardError(Exception):
    pass

def fail_alone(comm):
    if comm.rank == 1:
        raise ShardError("bad shard")
    comm.barrier()  # the others wait for rank 1 in a collective

def fail_all(comm, state):
    raise KeyError(f"missing {comm.rank}")

def keep(comm, state):
    state.x = np.full(4, comm.rank + 1.0)

def reduce_kept(comm, state):
    return comm.all_reduce(state.x.copy())
'''


def test_exception_raises_with_traceback_and_the_cluster_stays_usable():
    ns = as_main(ERRORS)
    world = 3
    with tpcore.Cluster(world, timeout=60, deadline=DEADLINE) as cluster:
        cluster.run(ns["keep"])
        # every rank raises and none waits: the communicator is kept (no note)
        with pytest.raises(KeyError) as ei:
            cluster.run(ns["fail_all"])
        text = str(ei.value)
        assert text.startswith("rank ") and "raised KeyError: 'missing" in text, text
        assert "--- traceback on rank" in text and "\n  File " in text and "in fail_all" in text, text
        assert not getattr(ei.value, "__notes__", None)
        want = np.full(4, world * (world + 1) / 2)
        for y in cluster.run(ns["reduce_kept"]):
            np.testing.assert_array_equal(y, want)
        # rank 1 alone raises while the others wait in a barrier: not for the 60 s timeout
        t0 = time.monotonic()
        with pytest.raises(ns["ShardError"]) as ei:  # the notebook's own class, by value and back
            cluster.run(ns["fail_alone"])
        assert time.monotonic() - t0 < 15
        text = str(ei.value)
        assert text.startswith("rank 1 raised ShardError: bad shard"), text
        assert "--- traceback on rank 1 ---" in text and 'File "<cell>", line 7, in fail_alone' in text, text
        assert ei.value.rank == 1
        notes = "\n".join(getattr(ei.value, "__notes__", []))
        assert "communicator was aborted and a new one was built" in notes, notes
        # the communicator was rebuilt under the same comm; the namespaces are kept
        for y in cluster.run(ns["reduce_kept"]):
            np.testing.assert_array_equal(y, want)
        assert cluster.run(lambda comm: comm.size) == [world] * world


def _exit_rank(comm, how):
    if comm.rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.barrier()


@pytest.mark.parametrize("how,said", [("exit", "exited with code 3"), ("kill", "killed by signal SIGKILL")])
def test_a_dead_rank_is_named_and_the_cluster_closed(how, said):
    before = children()
    cluster = tpcore.Cluster(3, timeout=60, deadline=DEADLINE)
    pids = cluster.pids
    t0 = time.monotonic()
    with pytest.raises(tpcore.RankExitedError) as ei:
        cluster.run(_exit_rank, how)
    assert time.monotonic() - t0 < 20
    assert ei.value.rank == 1 and "rank 1" in str(ei.value) and said in str(ei.value), str(ei.value)
    assert "create a new tpcore.Cluster" in str(ei.value)
    assert cluster.closed
    with pytest.raises(RuntimeError, match=r"Cluster.run: this cluster is closed \(rank 1 died\)"):
        cluster.run(_exit_rank, how)
    assert not any(alive(p) for p in pids)
    assert children() <= before


# -- bad arguments -------------------------------------------------------------------------
@pytest.mark.parametrize("kw,exc,match", [
    ({"n": 0}, ValueError, "Cluster: n must be an int >= 1"),
    ({"n": 2.0}, ValueError, "Cluster: n must be an int >= 1"),
    ({"n": True}, ValueError, "Cluster: n must be an int >= 1"),
    ({"n": 2, "backend": "mpi"}, ValueError, "Cluster: backend must be one of"),
    ({"n": 2, "backend": 3}, ValueError, "Cluster: backend must be one of"),
    ({"n": 2, "timeout": -1}, ValueError, "Cluster.*timeout"),
    ({"n": 2, "deadline": 0}, ValueError, "Cluster.*deadline"),
    ({"n": 2, "grace": "x"}, TypeError, "Cluster.*grace"),
    ({"n": 2, "start_method": "thread"}, ValueError, "Cluster: start_method must be one of"),
])
def test_bad_constructor_arguments(kw, exc, match):
    before = children()
    with pytest.raises(exc, match=match):
        tpcore.Cluster(**kw)
    assert children() <= before


def test_bad_run_arguments():
    with tpcore.Cluster(1, deadline=DEADLINE) as cluster:
        with pytest.raises(TypeError, match="Cluster.run: fn must be callable, got int"):
            cluster.run(3)
        with pytest.raises(TypeError, match="Cluster.run: fn and its arguments must be picklable"):
            cluster.run(rank_pid, threading.Lock())
        with pytest.raises(TypeError, match="return value of rank 0 cannot be pickled"):
            cluster.run(lambda comm: threading.Lock())
        assert cluster.run(lambda comm, a, b=1: a + b, 2, b=5) == [7]


# -- spawn: a function a spawned process cannot import ----------------------------------------
def test_spawn_says_when_fn_cannot_be_imported():
    ns = as_main("def work(comm):\n    return comm.rank\n")

    def nested(comm):
        return comm.rank

    for fn, why in [(ns["work"], "cannot be pickled by reference"), (nested, "nested"),
                    (lambda comm: 0, "a lambda")]:
        before = children()
        with pytest.raises(TypeError) as ei:
            tpcore.spawn(fn, 2, start_method="spawn", deadline=DEADLINE)
        text = str(ei.value)
        assert text.startswith("spawn: fn ") and why in text, text
        assert "start_method='spawn' cannot import it" in text and "define fn at the top level of a module" in text
        assert "tpcore.Cluster" in text
        assert children() <= before
    # the default start method (fork) runs them
    assert tpcore.spawn(ns["work"], 2, deadline=DEADLINE) == [0, 1]


def test_spawn_says_when_a_notebook_name_is_used(monkeypatch):
    import functools
    fake = types.ModuleType("__main__")  # an interactive __main__ (no __file__) that has them
    exec("class Thing:\n    pass\ndef work(comm, *a):\n    return comm.rank\n", fake.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", fake)
    cases = [(fake.work, (), "fn work is defined in a notebook or an interactive session"),
             (functools.partial(fake.work, 1), (), "fn partial uses work, defined in a notebook"),
             (rank_pid, (fake.Thing(),), "an argument of fn rank_pid uses Thing, defined in a notebook")]
    for fn, args, said in cases:
        with pytest.raises(TypeError, match="start_method='spawn' cannot import it") as ei:
            tpcore.spawn(fn, 2, args=args, start_method="spawn", deadline=DEADLINE)
        assert str(ei.value).startswith("spawn: " + said), str(ei.value)
    with pytest.raises(TypeError, match="an argument of fn rank_pid cannot be pickled"):
        tpcore.spawn(rank_pid, 2, args=(threading.Lock(),), start_method="spawn", deadline=DEADLINE)


# -- the example notebook, in a real kernel ----------------------------------------------------
EXTRA_CELLS = [
    # rough edge 3 in a notebook
    """
def in_cell(comm):
    return comm.rank
try:
    tpcore.spawn(in_cell, 2, start_method="spawn")
except TypeError as e:
    print("SPAWN-ERROR", e)
""",
    # rough edge 1 under spawn in a notebook: one prefix, a line per \\r update, no \\r
    r"""
def bar(comm):
    import sys
    for i in range(3):
        sys.stderr.write(f"\rload {i + 1}/3")
        sys.stderr.flush()
    sys.stderr.write("\n")
_ = tpcore.spawn(bar, 2)
""",
    # rough edge 1 under the launcher started from a notebook (its output reaches the cell through the
    # kernel's captured file descriptors)
    r"""
import subprocess, sys, tempfile, os
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "job.py")
    with open(path, "w") as f:
        f.write("import sys\nfor i in range(3):\n    sys.stderr.write(f'\\rlaunched {i + 1}/3')\n"
                "    sys.stderr.flush()\nsys.stderr.write('\\n')\n")
    print("LAUNCHER rc", subprocess.run([sys.executable, "-m", "tpcore.launch", "-n", "2", path]).returncode)
""",
]


INTERRUPTED = """
def forever(comm):
    import time
    print("running", flush=True)
    while True:
        time.sleep(0.05)
c2.run(forever)
"""
AFTER_INTERRUPT = """
import os
print("INTERRUPTED", c2.closed, [os.path.exists(f"/proc/{p}") for p in pids])
with tpcore.Cluster(2) as c3:
    print("AFTER", c3.run(lambda comm: comm.rank))
"""


@pytest.mark.slow  # a Jupyter kernel; test_spawn_in_a_notebook is the quick one
def test_example_notebook_runs_headless():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    before_shm = set(leftover_segments())
    nb = nbformat.read(ROOT / "examples" / "cluster.ipynb", as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(src) for src in EXTRA_CELLS]
    # a kernel interrupt (what the stop button sends) while the ranks run: nbclient interrupts the
    # cell tagged "interrupt" after its 2 s timeout
    nb.cells += [nbformat.v4.new_code_cell("c2 = tpcore.Cluster(2)\npids = c2.pids"),
                 nbformat.v4.new_code_cell(INTERRUPTED, metadata={"tags": ["interrupt", "raises-exception"]}),
                 nbformat.v4.new_code_cell(AFTER_INTERRUPT)]
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_PARENT, env_path) if p)
    # ipykernel does not relay its file descriptors' output to the cells under pytest (it looks for
    # this variable); the launcher's output reaches a real notebook that way
    current = os.environ.pop("PYTEST_CURRENT_TEST", None)
    try:
        nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", interrupt_on_timeout=True,
                                timeout_func=lambda cell: 2 if "interrupt" in cell.metadata.get("tags", ()) else 120,
                                ).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
        if current is not None:
            os.environ["PYTEST_CURRENT_TEST"] = current
    outs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    stdout = "".join(o.get("text", "") for o in outs if o.get("name") == "stdout")
    stderr = "".join(o.get("text", "") for o in outs if o.get("name") == "stderr")
    results = [o["data"]["text/plain"] for o in outs if o.get("output_type") == "execute_result"]
    errors = [o for o in outs if o.get("output_type") == "error"]
    assert "[rank0] holds ffn columns 0..6\n" in stdout and "[rank1] holds ffn columns 7..12\n" in stdout, stdout
    assert results[1] == "[7, 6]" and results[2] == "[2, 2]", results
    err = float(stdout.split("max error vs NumPy: ")[1].split()[0])
    assert err < 1e-4, stdout
    assert errors[0]["ename"] == "ValueError", errors
    assert "x must have shape (..., 8), got (2, 9)" in errors[0]["evalue"]
    assert "--- traceback on rank" in errors[0]["evalue"] and "\n  File " in errors[0]["evalue"]
    # the rank's traceback names the cell and shows its line (cloudpickle sends no file name)
    assert "state.mlp(np.ones((2, hidden + 1), np.float32))" in errors[0]["evalue"].split("--- traceback")[1]
    assert "still works: True" in stdout
    for r in range(2):
        assert [ln for ln in stdout.split("\n") if ln.startswith(f"[rank{r}] step")] == \
            [f"[rank{r}] step {i}/3" for i in (1, 2, 3)], stdout
        assert [ln for ln in stderr.split("\n") if ln.startswith(f"[rank{r}] load")] == \
            [f"[rank{r}] load {i}/3" for i in (1, 2, 3)], stderr
    assert "LAUNCHER rc 0" in stdout, stdout
    for r in range(2):
        got = [ln for ln in stderr.split("\n") if "launched" in ln and ln.startswith(f"[rank{r}]")]
        assert [re.sub(r"^\[rank\d\]:? ", "", ln) for ln in got] == [f"launched {i}/3" for i in (1, 2, 3)], stderr
    assert "\r" not in stdout and "\r" not in stderr
    assert results[-1] == "<tpcore.Cluster of 2 ranks, closed>"
    assert [e["ename"] for e in errors] == ["ValueError", "KeyboardInterrupt"], errors
    assert "every rank was stopped" in errors[1]["evalue"], errors[1]
    assert "[rank0] running" in stdout and "[rank1] running" in stdout
    assert "INTERRUPTED True [False, False]" in stdout and "AFTER [0, 1]" in stdout, stdout
    assert "SPAWN-ERROR spawn: fn in_cell is defined in a notebook" in stdout, stdout
    assert "define fn at the top level of a module" in stdout
    assert set(leftover_segments()) <= before_shm


def test_one_run_at_a_time(tmp_path):
    flag = tmp_path / "go"

    def hold(comm, flag):
        while not os.path.exists(flag):
            time.sleep(0.01)
        return comm.rank

    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        out = []
        t = threading.Thread(target=lambda: out.append(cluster.run(hold, str(flag))))
        t.start()
        t_end = time.monotonic() + 20
        while not cluster._busy.locked() and time.monotonic() < t_end:  # the thread's run() began
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="another run\\(\\) of this cluster is in progress"):
            cluster.run(hold, str(flag))
        flag.touch()
        t.join(30)
        assert out == [[0, 1]]
        assert cluster.run(hold, str(flag)) == [0, 1]


def _mismatch(comm):
    comm.all_reduce(np.ones(3 + comm.rank, np.float32))  # different counts: the communicator fails


def _mismatch_caught(comm):
    try:
        _mismatch(comm)
    except tpcore.CommError:
        return "caught"


def _sum_ranks(comm):
    return float(comm.all_reduce(np.array([comm.rank + 1.0]))[0])


def test_a_failed_communicator_is_rebuilt():
    with tpcore.Cluster(2, timeout=60, deadline=DEADLINE) as cluster:
        with pytest.raises(tpcore.CommError, match="collective mismatch") as ei:
            cluster.run(_mismatch)
        notes = "\n".join(getattr(ei.value, "__notes__", []))
        assert "the communicator failed (collective mismatch) and a new one was built" in notes, notes
        assert cluster.run(_sum_ranks) == [3.0, 3.0]
        with pytest.warns(RuntimeWarning, match="the communicator failed .* a new one was built"):
            assert cluster.run(_mismatch_caught) == ["caught", "caught"]
        assert cluster.run(_sum_ranks) == [3.0, 3.0]


def test_spawn_start_method_sends_functions_by_value():
    ns = as_main("def f(comm, state, k):\n    state.k = k * (comm.rank + 1)\n"
                  "    return comm.all_reduce(np.ones(2)).tolist()\n")
    with tpcore.Cluster(2, start_method="spawn", deadline=DEADLINE) as cluster:
        assert cluster.run(ns["f"], 5) == [[2.0, 2.0]] * 2
        assert cluster.run(lambda comm, state: (state.k, os.environ["RANK"])) == [(5, "0"), (10, "1")]


def _fd_level(comm):
    os.write(1, f"os.write of rank {comm.rank}\n".encode())
    subprocess.run(["sh", "-c", f"echo from a subprocess of rank {comm.rank} >&2"], check=True)
    return comm.rank


def test_output_below_python_gets_the_prefix_too(capfd):
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        assert cluster.run(_fd_level) == [0, 1]
        cap = capfd.readouterr()  # all of it arrived before run() returned
    for r in range(2):
        assert f"[rank{r}] os.write of rank {r}\n" in cap.out, cap.out
        assert f"[rank{r}] from a subprocess of rank {r}\n" in cap.err, cap.err
    assert all(ln.startswith("[rank") for ln in (cap.out + cap.err).split("\n") if ln), cap


def test_a_communicator_closed_by_fn_is_rebuilt():
    with tpcore.Cluster(2, deadline=DEADLINE) as cluster:
        with pytest.warns(RuntimeWarning, match=r"the communicator failed \(closed\)"):
            cluster.run(lambda comm: comm.close())
        assert cluster.run(_sum_ranks) == [3.0, 3.0]


def test_a_communicator_that_cannot_be_set_up_raises_and_leaves_nothing():
    if tpcore._C.Comm.probe("nccl") is None:
        pytest.skip("NCCL is usable here")
    before = children()
    # both ranks fail the same way; whichever answers first is reported
    with pytest.raises(tpcore.CommError, match=r"rank [01] raised CommError: init: backend nccl"):
        tpcore.Cluster(2, backend="nccl")
    assert children() <= before


def test_deadline_closes_the_cluster():
    before = children()
    cluster = tpcore.Cluster(2, deadline=1.0)
    pids = cluster.pids
    t0 = time.monotonic()
    with pytest.raises(tpcore.CommTimeout, match=r"deadline of 1.0 s passed; ranks \[1\] were still running"):
        cluster.run(lambda comm: time.sleep(30) if comm.rank == 1 else None)
    assert time.monotonic() - t0 < 10
    assert cluster.closed and not any(alive(p) for p in pids)
    assert children() <= before


def test_progress_bar_is_one_line_drawn_in_place_on_a_terminal():
    script = ("import sys, tpcore\n"
              "def bar(comm):\n"
              "    for i in range(3):\n"
              "        sys.stdout.write(f'\\rstep {i + 1}/3')\n"
              "        sys.stdout.flush()\n"
              "    sys.stdout.write('\\n')\n"
              "with tpcore.Cluster(1) as c:\n"
              "    c.run(bar)\n")
    master, slave = os.openpty()
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=slave, stderr=slave, env=env)
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            out += data
    finally:
        os.close(master)
        assert p.wait(60) == 0, out
    # one prefix, each update redrawn over the last (cleared to the end of the line), then the line ends
    assert out == (b"\r[rank0] step 1/3\x1b[K\r[rank0] step 2/3\x1b[K\r[rank0] step 3/3\x1b[K\r\n"), out
