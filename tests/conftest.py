"""Shared helpers for the tests.

Every multi-rank test runs through tpcore.spawn with a deadline, so a hang
fails that test instead of the CI job.  After every test, no tpcore segment of
this test session's jobs may remain in /dev/shm and no child process may remain
alive.  Other jobs of this user may run beside the tests (another test session,
a benchmark): their names are not judged.  This session's are told apart by
TPCORE_JOB_PREFIX, set here for this process and everything it starts, which
every job id tpcore makes up begins with; a test that sets TPCORE_JOB_ID by hand
starts it with JOB_PREFIX too."""
import glob
import multiprocessing
import os
import secrets
import signal
import time

import numpy as np
import pytest

import tpcore

# this session's jobs: "tpcore_<JOB_PREFIX>..." in /dev/shm (an outer harness's prefix is replaced)
JOB_PREFIX = os.environ["TPCORE_JOB_PREFIX"] = f"pt{secrets.token_hex(4)}-"

WORLD_SIZES = [1, 2, 3, 4]
# the world sizes of a parametrized test: 3 and 4 are `slow` (the quick subset, -m "not slow", runs
# 1 and 2; the test command runs all four)
WORLDS = [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)]
DEADLINE = float(os.environ.get("TPCORE_TEST_DEADLINE", "120"))


def run(fn, n, *args, deadline=DEADLINE, **kw):
    """fn(comm, *args) on n ranks; the list of results in rank order."""
    return tpcore.spawn(fn, n, args=args, deadline=deadline, **kw)


def run_fresh(module: str, fn: str, n: int, args: tuple = (), timeout: float = 300):
    """module.fn(comm, *args) on n ranks spawned from a fresh interpreter (args and results
    through JSON): the results.
    For measurements of resident memory: a rank forked from pytest inherits its heap, whose
    free (already resident) chunks a new allocation may reuse without the RSS growing."""
    import json
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    found = glob.glob(os.path.join(here, "*", f"{module}.py")) + glob.glob(os.path.join(here, f"{module}.py"))
    assert len(found) == 1, (module, found)
    dirs = [here, os.path.dirname(found[0])]
    code = (f"import json, sys, tpcore; sys.path[:0] = {dirs!r}; import {module} as m; "
            f"print(json.dumps(tpcore.spawn(m.{fn}, {int(n)}, args=tuple(json.loads({json.dumps(list(args))!r})))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p)))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def c_builds(tmp_path_factory):
    """Where this session's make builds of the C test binaries go (c_binaries.build): one
    build directory per configuration, shared by the tests of test_c_core, test_kernels and
    test_api_hostile, so that the core is compiled once per configuration per run.  Under
    pytest-xdist the workers share it too (the run's base temporary directory is their common
    parent; c_binaries.build holds a file lock around each make)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    d = base / "c-builds"
    d.mkdir(exist_ok=True)
    return d


def leftover_segments():
    """This session's tpcore names in /dev/shm (its world, memory and nccl segments)."""
    return sorted(glob.glob(f"/dev/shm/tpcore_{JOB_PREFIX}*") + glob.glob(f"/dev/shm/tpcore_nccl_{JOB_PREFIX}*"))


def _mapped_by_live_process(path):
    """Whether some running process maps the segment (another tpcore job on this machine:
    its world communicator's name lives as long as the job)."""
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                if path in f.read():
                    return True
        except OSError:
            pass
    return False


@pytest.fixture(autouse=True)
def no_leaks():
    before = set(leftover_segments())
    yield
    after = set(leftover_segments()) - before
    if after:  # a segment lives a moment after its job: look again, and ignore ones in use
        time.sleep(1.0)
        after = {p for p in set(leftover_segments()) - before if not _mapped_by_live_process(p)}
    assert not after, f"shared-memory segments left behind: {sorted(after)}"
    kids = multiprocessing.active_children()
    assert not kids, f"child processes left running: {kids}"


class DLPackOnly:
    """A foreign CPU tensor that speaks only DLPack (what torch.Tensor and jax.Array offer)."""

    def __init__(self, a):
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def rng_for(seed, rank):
    return np.random.default_rng([seed, rank])


try:
    import ml_dtypes  # noqa: F401 (registers bfloat16 with NumPy)

    BF16 = np.dtype("bfloat16")
except ImportError:  # the test extra brings it; without it bfloat16 cases are skipped
    BF16 = None

DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "uint8", "int32", "int64"]


def np_dtype(name):
    if name == "bfloat16":
        if BF16 is None:
            pytest.skip("ml_dtypes is not installed (pip install '.[test]')")
        return BF16
    return np.dtype(name)


def make_input(name, op, seed, rank, shape):
    """Fresh random, non-zero values of the dtype, drawn from (seed, rank), so
    that every rank can regenerate every other rank's input."""
    g = rng_for(seed, rank)
    if name in ("float32", "float64", "float16", "bfloat16"):
        if op == "prod":
            v = g.uniform(0.5, 1.5, shape)
        else:
            v = g.standard_normal(shape) * 3
            v[v == 0] = 1.0
        return v.astype(np_dtype(name))
    lo, hi = {"int8": (-100, 100), "uint8": (0, 256), "int32": (-10**6, 10**6),
              "int64": (-10**12, 10**12)}[name]
    if op == "prod":
        lo, hi = (-9, 10) if name != "uint8" else (1, 10)
    v = g.integers(lo, hi, shape)
    if name != "uint8":
        v[v == 0] = 1
    return v.astype(np_dtype(name))


def reference(name, op, arrays):
    """The reduction over ranks in float64 (floats) or exact integers, with
    NumPy's wrap-around for the dtype."""
    n = len(arrays)
    if name in ("float32", "float64", "float16", "bfloat16"):
        xs = [a.astype(np.float64) for a in arrays]
        if op in ("sum", "avg"):
            r = np.sum(xs, axis=0)
            return r / n if op == "avg" else r
        if op == "prod":
            return np.prod(xs, axis=0)
        return (np.min if op == "min" else np.max)(xs, axis=0)
    xs = [a.astype(np.int64) for a in arrays]
    if op == "avg":
        s = np.sum([x.astype(object) for x in xs], axis=0) if name == "int64" else np.sum(xs, axis=0)
        q = np.array([int(abs(v)) // n * (1 if v >= 0 else -1) for v in np.ravel(s)], dtype=np.int64)
        return q.reshape(np.shape(s)).astype(np_dtype(name))
    if op == "sum":
        r = np.zeros_like(xs[0], dtype=np.uint64)
        for x in xs:
            r = r + x.astype(np.uint64)
        return r.astype(np.int64).astype(np_dtype(name))
    if op == "prod":
        r = np.ones_like(xs[0], dtype=np.uint64)
        for x in xs:
            r = r * x.astype(np.uint64)
        return r.astype(np.int64).astype(np_dtype(name))
    return (np.min if op == "min" else np.max)(xs, axis=0).astype(np_dtype(name))


TOL = {"float64": 1e-12, "float32": 2e-6, "float16": 2e-3, "bfloat16": 1.6e-2}


def mismatches(name, got, ref, scale=1.0):
    """Number of elements outside abs + rel * |ref| (exact for integers)."""
    got = np.asarray(got)
    if name in TOL:
        g = got.astype(np.float64)
        tol = TOL[name] * (scale + np.abs(ref))
        return int(np.count_nonzero(~(np.abs(g - ref) <= tol)))
    return int(np.count_nonzero(got != ref))


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this process during the test, as in a terminal or a
    notebook kernel.  A process started in the background by a non-interactive shell
    (``nohup pytest &``, many CI steps) inherits SIGINT ignored, and Python then leaves it
    ignored: the interrupt these tests send would do nothing (see
    test_an_ignored_sigint_leaves_run_alone for that case)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if old is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(signal.SIGINT, old)


# The files whose C builds and sanitized runs take the longest, run first: the two workers of the
# test command (-n 2 --dist loadfile) take whole files in collection order, and a long file taken
# last leaves the other worker idle at the end (about 2 of 8 minutes before this order).
RUN_FIRST = ["csrc/test_kernels.py", "csrc/test_sanitized.py", "devices/test_cuda_build.py", "csrc/test_c_core.py",
             "csrc/test_api_hostile.py", "devices/test_nccl.py"]


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))

    def rank(item):
        rel = os.path.relpath(str(item.path), here).replace(os.sep, "/")
        return RUN_FIRST.index(rel) if rel in RUN_FIRST else len(RUN_FIRST)
    items.sort(key=rank)  # stable: each file's tests keep their order


def _torch_one_thread():
    import sys
    t = sys.modules.get("torch")
    if t is not None and t.get_num_threads() != 1:
        t.set_num_threads(1)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """(after a test that imported torch here: see pytest_runtest_setup)"""
    _torch_one_thread()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """torch in this process on one thread.  Ranks are forked from here (tpcore.spawn's default):
    a child forked after torch ran a parallel region on its OpenMP pool deadlocks the first
    time it runs torch on several threads (the pool's threads do not survive the fork), which
    the tests that compute transformers' reference in this process would otherwise set up for
    whichever test file the same worker runs next (one thread: torch runs inline, never on the
    pool)."""
    _torch_one_thread()
