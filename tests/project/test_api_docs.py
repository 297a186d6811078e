"""The public face of the tpcore namespace: __all__ complete and exact, no stray names,
every public name documented in NumPy style (a summary line; a Parameters section naming
every parameter where it takes any), and the behaviours the docs promise: op="mean" as
avg's alias on every reduction, TPCORE_TIMEOUT checked, init's spin_us bounds."""
import inspect
import re
import types

import numpy as np
import pytest

import tpcore
from conftest import WORLDS, run

LEFTOVERS = {"os", "sys", "time", "np", "numpy", "Optional", "Any", "annotations", "Callable", "Sequence",
             "List", "Dict", "Tuple", "Union"}


def _public_modules():
    return {n for n, v in vars(tpcore).items() if isinstance(v, types.ModuleType) and not n.startswith("_")}


def test_all_is_complete_and_exact():
    names = tpcore.__all__
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    missing = [n for n in names if not hasattr(tpcore, n)]
    assert not missing, f"__all__ names that tpcore lacks: {missing}"
    mods = _public_modules()
    # every public (non-underscore) name is in __all__, or a submodule of tpcore (import
    # tpcore.x binds x on the package: that is Python's rule, not a leftover)
    stray = sorted(n for n in vars(tpcore) if not n.startswith("_") and n not in names and n not in mods)
    assert not stray, f"public names of tpcore outside __all__: {stray}"
    for n in mods:  # a submodule, or an alias of a moved module (tpcore.quant is tpcore.nn.quant)
        assert vars(tpcore)[n].__name__.startswith("tpcore."), f"tpcore.{n} is a foreign module"
    assert not LEFTOVERS & set(dir(tpcore)), LEFTOVERS & set(dir(tpcore))
    assert not LEFTOVERS & set(vars(tpcore)), LEFTOVERS & set(vars(tpcore))
    # what a star import gives is exactly __all__
    ns: dict = {}
    exec("from tpcore import *", ns)
    assert set(ns) - {"__builtins__"} == set(names)


def _params(fn):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and not p.name.startswith("_")
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _section(doc, title):
    """The text of a NumPy-style section (title underlined with dashes), or None."""
    m = re.search(rf"^\s*{title}\n\s*-{{{len(title)}}}\n(.*?)(?=^\s*\w[\w ]*\n\s*-{{3,}}\n|\Z)", doc, re.S | re.M)
    return m.group(1) if m else None


def _check_documented(obj, what, doc=None, fn=None):
    doc = inspect.cleandoc(doc if doc is not None else (obj.__doc__ or ""))
    assert doc.strip(), f"{what} has no docstring"
    assert doc.splitlines()[0].strip(), f"{what}: the docstring has no summary line"
    params = _params(fn if fn is not None else obj)
    if params:
        sec = _section(doc, "Parameters")
        assert sec is not None, f"{what} takes {params} but its docstring has no Parameters section"
        missing = [p for p in params if not re.search(rf"(^|[\s,]){p}\b", sec)]
        assert not missing, f"{what}: Parameters does not describe {missing}"
    return doc


def _public_members(cls):
    for name, v in vars(cls).items():
        if name.startswith("_") or name == "__call__":
            continue
        if isinstance(v, (property, types.FunctionType, classmethod, staticmethod)):
            yield name, v
    for base in cls.__mro__[1:]:  # the private base's public methods are the class's API too
        if base.__name__.startswith("_") and base.__module__.startswith("tpcore"):
            for name, v in vars(base).items():
                if not name.startswith("_") and name not in vars(cls) and \
                        isinstance(v, (property, types.FunctionType, classmethod, staticmethod)):
                    yield name, v


def _check_class(cls, what):
    init = cls.__dict__.get("__init__")
    _check_documented(cls, what, fn=init if isinstance(init, types.FunctionType) else cls)
    for name, v in _public_members(cls):
        if isinstance(v, property):
            assert (v.fget.__doc__ or "").strip(), f"{what}.{name} (a property) has no docstring"
            continue
        fn = v.__func__ if isinstance(v, (classmethod, staticmethod)) else v
        _check_documented(fn, f"{what}.{name}")


def _api_objects():
    for n in tpcore.__all__:
        v = getattr(tpcore, n)
        if n.startswith("__") or isinstance(v, types.ModuleType):
            continue
        yield f"tpcore.{n}", v
    for mod in (tpcore.models, tpcore.optim, tpcore.quant):
        for n in getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]:
            v = getattr(mod, n)
            if getattr(v, "__module__", None) == mod.__name__ and (inspect.isclass(v) or inspect.isfunction(v)):
                yield f"{mod.__name__}.{n}", v


@pytest.mark.parametrize("what,obj", list(_api_objects()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_name_documented(what, obj):
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            assert (obj.__doc__ or "").strip(), f"{what} has no docstring"
            return
        _check_class(obj, what)
    else:
        _check_documented(obj, what)


def test_layer_help_explains_its_arguments():
    col = inspect.getdoc(tpcore.ColumnParallelLinear)
    for word in ("gather_output", "partition", "seed", "dtype", "gated", "all-gather", "all-reduce"):
        assert word in col, word
    row = inspect.getdoc(tpcore.RowParallelLinear)
    assert "input_is_parallel" in row and "all-reduce" in row
    init = inspect.getdoc(tpcore.init)
    assert "spin_us" in _section(init, "Parameters") and "300 seconds" in init and "TPCORE_TIMEOUT" in init
    ar = inspect.getdoc(tpcore.Comm.all_reduce)
    assert '"mean"' in ar and "alias" in ar


def _mean_ops(comm, seed):
    """all_reduce / reduce_scatter / reduce with op="mean" against a float64 NumPy mean of
    every rank's regenerated input, and bit-identical to op="avg"."""
    n, r = comm.size, comm.rank
    rows = 3 * n + 0  # reduce_scatter splits evenly
    ins = [np.random.default_rng([seed, k]).standard_normal((rows, 5)).astype(np.float32) for k in range(n)]
    ref = np.mean(np.stack(ins).astype(np.float64), axis=0)
    x = ins[r].copy()
    got = comm.all_reduce(x, op="mean")
    avg = comm.all_reduce(ins[r].copy(), op="avg")
    sc = comm.reduce_scatter(ins[r].copy(), op="mean")
    red = comm.reduce(ins[r].copy(), root=n - 1, op="mean")
    odd = comm.reduce_scatter(ins[r].copy(), op="mean", axis=1, sizes=[5 - (n - 1)] + [1] * (n - 1))
    errs = [np.abs(got - ref).max(), np.abs(sc - ref[3 * r:3 * r + 3]).max()]
    if r == n - 1:
        errs.append(np.abs(red - ref).max())
    lo = sum(([5 - (n - 1)] + [1] * (n - 1))[:r])
    errs.append(np.abs(odd - ref[:, lo:lo + odd.shape[1]]).max())
    ints = comm.all_reduce(np.array([7 * (r + 1), -7 * (r + 1)], np.int32), op="mean")
    ref_i = [int(7 * sum(range(1, n + 1)) / n), -int(7 * sum(range(1, n + 1)) / n)]  # truncation toward zero
    return max(errs), np.array_equal(got.view(np.uint32), avg.view(np.uint32)), ints.tolist() == ref_i


@pytest.mark.parametrize("world", WORLDS)
def test_op_mean_is_avg(world):
    seed = int(np.random.default_rng().integers(2**31))
    for err, same_as_avg, ints_ok in run(_mean_ops, world, seed):
        assert err < 1e-5 and same_as_avg and ints_ok, (err, same_as_avg, ints_ok)


def _bad_ops(comm):
    x = np.ones(4, np.float32)
    out = []
    for call in (lambda: comm.all_reduce(x, op="median"), lambda: comm.reduce_scatter(x, op="median", axis=0),
                 lambda: comm.reduce(x, op="median"), lambda: comm.all_reduce(x.reshape(2, 2), op=3, out=None),
                 lambda: comm.reduce_scatter(np.ones((2, 2), np.float32), op=3, axis=1)):
        try:
            call()
            out.append(None)
        except Exception as e:  # noqa: BLE001 - the type and message are what is checked
            out.append((type(e).__name__, str(e)))
    return out


def test_bad_op_names_every_accepted_op():
    for res in run(_bad_ops, 2):
        assert all(r is not None for r in res), res
        for kind, msg in res[:3]:
            assert kind == "ValueError" and "'median'" in msg and "'mean'" in msg and "'avg'" in msg, msg
        for kind, msg in res[3:]:
            assert kind == "TypeError" and "op must be a string" in msg and "'mean'" in msg, msg


@pytest.mark.parametrize("text", ["abc", "0", "-5", "nan"])
def test_bad_tpcore_timeout_is_refused(monkeypatch, text):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS",
                "TPCORE_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TPCORE_TIMEOUT", text)
    with pytest.raises(ValueError, match=r"init: TPCORE_TIMEOUT must be a number of seconds > 0, got"):
        tpcore.init(backend="shm")


def test_tpcore_timeout_and_spin_us_are_taken(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS",
                "TPCORE_JOB_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TPCORE_TIMEOUT", "12.5")
    with tpcore.init(backend="shm", spin_us=0) as comm:
        assert comm.timeout == 12.5
    monkeypatch.delenv("TPCORE_TIMEOUT")
    with tpcore.init(backend="shm") as comm:
        assert comm.timeout == 300.0  # the documented default
    with tpcore.init(backend="shm", timeout=7, spin_us=10**6) as comm:
        assert comm.timeout == 7.0
    with pytest.raises(ValueError, match="init: spin_us"):
        tpcore.init(spin_us=10**6 + 1)
    with pytest.raises(TypeError, match="init: spin_us"):
        tpcore.init(spin_us=1.5)
