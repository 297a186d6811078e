"""The speed-weighted shard planner (tpcore.plan_partition / plan_from_measurements / Plan)
and the compute throttle (tpcore.set_throttle, TPCORE_THROTTLE).

Plans are valid for every layer (sizes sum to the dimension, aligned MLP columns, whole
heads or whole GQA groups), deterministic, proportional to the speeds given (within one
unit), within memory limits (and a clear error when the model cannot fit); the byte
estimate equals the parameter bytes the model really allocates; models and layers on
planned uneven shards give world 1's logits and greedy tokens (and a float64 NumPy
reference); saved plans load back and corrupt or edited files are refused.  The throttle
roughly doubles a kernel's time at factor 2 and refuses bad factors."""
import json
import math
import os
import time

import numpy as np
import pytest

import tpcore
from conftest import rng_for, run
from tpcore.parallel.planner import Dims, PlanError, dims_of, plan_from_measurements

LLAMA = dict(vocab_size=101, hidden=24, layers=2, heads=6, kv_heads=2, ffn_hidden=36, norm="rmsnorm", eps=1e-6,
             activation="swiglu", positions="rope", rope_theta=1000.0, max_positions=64, bias=False,
             tie_embeddings=False, model_type="llama")
GPT2 = dict(vocab_size=97, hidden=24, layers=2, heads=6, ffn_hidden=40, activation="gelu_tanh", positions="learned",
            max_positions=32, bias=True, tie_embeddings=True)
GQA8 = dict(vocab_size=211, hidden=64, layers=1, heads=8, kv_heads=4, ffn_hidden=160, norm="rmsnorm",
            activation="swiglu", positions="rope", bias=False, tie_embeddings=False)
ODD = dict(vocab_size=37, hidden=15, layers=1, heads=5, head_dim=3, ffn_hidden=31, activation="relu",
           max_positions=8)
TINY = dict(vocab_size=5, hidden=8, layers=1, heads=2, ffn_hidden=3, max_positions=16)  # fewer heads than ranks
CFGS = {"llama": LLAMA, "gpt2": GPT2, "gqa8": GQA8, "odd": ODD, "tiny": TINY}


def _units_ok(plan, d: Dims, world: int):
    """Every structural rule a layer needs, checked from scratch."""
    assert len(plan.ffn) == world and sum(plan.ffn) == d.ffn
    assert all(f >= 0 and f % plan.align["ffn"] == 0 for f in plan.ffn)
    assert d.ffn % plan.align["ffn"] == 0
    if d.is_mlp:
        assert plan.heads == [] and plan.vocab == []
        return
    assert len(plan.heads) == world and sum(plan.heads) == d.heads and all(h >= 0 for h in plan.heads)
    assert len(plan.vocab) == world and sum(plan.vocab) == d.vocab
    assert all(v % plan.align["vocab"] == 0 for v in plan.vocab)
    if plan.head_unit == "group":
        assert all(h % d.group == 0 for h in plan.heads)
    for key, n, sizes in (("heads", d.heads, plan.heads), ("ffn", d.ffn // plan.align["ffn"], plan.ffn)):
        if n >= world:  # every rank gets at least one unit when there are enough
            assert all(s > 0 for s in sizes), (key, sizes)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gqa8", "odd", "tiny", "mlp"])
def test_partitions_valid_for_every_world_and_speed(name):
    d = dims_of((40, 200)) if name == "mlp" else dims_of(tpcore.Config(**CFGS[name]))
    g = rng_for(7, 0)
    for world in (1, 2, 3, 4):
        for _trial in range(6):
            speeds = list(g.uniform(0.2, 3.0, world))
            plan = plan_from_measurements(d, speeds)
            _units_ok(plan, d, world)
            assert len(plan.speeds) == world and max(plan.speeds) == 1.0
            assert math.isclose(sum(plan.shares), 1.0)
            # never worse than equal shards, up to whole-unit rounding of tiny dims (5 heads: 20% a head)
            assert plan.predicted <= (1.0 + 1e-9 if name not in ("odd", "tiny") else 1.05)
            assert plan.predicted_ideal <= plan.predicted + 1e-12


def test_deterministic_and_only_ratios_matter():
    cfg = tpcore.Config(**LLAMA)
    a = plan_from_measurements(cfg, [1.0, 2.5, 1.3], memory=[10**7] * 3)
    b = plan_from_measurements(cfg, [1.0, 2.5, 1.3], memory=[10**7] * 3)
    c = plan_from_measurements(cfg, [2.0, 5.0, 2.6], memory={0: 10**7, 1: 10**7, 2: 10**7})
    assert a.to_json() == b.to_json()
    assert (a.heads, a.ffn, a.vocab, a.bytes_per_rank) == (c.heads, c.ffn, c.vocab, c.bytes_per_rank)


@pytest.mark.parametrize("name", ["gpt2", "gqa8", "mlp"])
def test_proportional_to_speeds_within_one_unit(name):
    d = dims_of((48, 480)) if name == "mlp" else dims_of(tpcore.Config(**CFGS[name]))
    g = rng_for(11, 0)
    for world in (2, 3, 4):
        for _ in range(5):
            speeds = list(g.uniform(0.5, 1.0, world))
            plan = plan_from_measurements(d, speeds, head_unit="head")
            share = [s / sum(speeds) for s in speeds]
            dims = [("ffn", d.ffn, plan.ffn, plan.align["ffn"])]
            if not d.is_mlp:
                dims += [("heads", d.heads, plan.heads, 1), ("vocab", d.vocab, plan.vocab, plan.align["vocab"])]
            for key, n, sizes, unit in dims:
                for r in range(world):
                    assert abs(sizes[r] / unit - n / unit * share[r]) < 1.0 + 1e-9, (key, speeds, sizes)


def test_gqa_groups_when_they_fit_whole_heads_otherwise():
    cfg = tpcore.Config(**GQA8)  # 8 query heads in 4 groups of 2
    p = plan_from_measurements(cfg, [1.0, 1.0])
    assert p.head_unit == "group" and p.heads == [4, 4]
    p = plan_from_measurements(cfg, [1.0, 1.0, 1.0, 1.0])
    assert p.head_unit == "group" and p.heads == [2, 2, 2, 2]
    # 1 : 2.2 in 4 groups is [1, 3] groups = [2, 6] heads, as good as heads can do: groups
    p = plan_from_measurements(cfg, [1.0, 2.2])
    assert p.head_unit == "group" and p.heads == [2, 6]
    # 1 : 1.6 is [2, 2] groups (rank 1 at 4 / 0.625 = 6.4) against [3, 5] heads (5.0): whole heads
    p = plan_from_measurements(cfg, [1.0, 1.6])
    assert p.head_unit == "head" and p.heads == [3, 5]
    p = plan_from_measurements(tpcore.Config(**LLAMA), [1, 1, 1])  # 2 KV heads for 3 ranks: whole heads
    assert p.head_unit == "head" and p.heads == [2, 2, 2]
    with pytest.raises(ValueError, match="head_unit='group' needs at least one KV group per rank"):
        plan_from_measurements(tpcore.Config(**LLAMA), [1, 1, 1], head_unit="group")
    p = plan_from_measurements(cfg, [1.0, 1.6], head_unit="group")
    assert p.heads == [4, 4]


def test_memory_limits_cap_a_rank_and_the_rest_goes_by_speed():
    cfg = tpcore.Config(**GPT2)
    free = plan_from_measurements(cfg, [1.0, 4.0, 2.0])
    total = plan_from_measurements(cfg, [1.0]).bytes_per_rank[0]
    # rank 1 is fastest but may hold only a quarter of the model's bytes
    lim = [total, total // 4, total]
    p = plan_from_measurements(cfg, [1.0, 4.0, 2.0], memory=lim)
    assert all(b <= m for b, m in zip(p.bytes_per_rank, lim)), (p.bytes_per_rank, lim)
    assert p.ffn[1] < free.ffn[1] and p.vocab[1] < free.vocab[1]
    # the rest follows speed: rank 2 (speed 2) gets about twice rank 0's (speed 1)
    assert abs(p.ffn[2] / p.ffn[0] - 2.0) < 0.35, p.ffn
    _units_ok(p, dims_of(cfg), 3)
    assert "limit MB" in str(p)
    with pytest.raises(PlanError, match="does not fit in the memory limits"):
        plan_from_measurements(cfg, [1.0, 1.0], memory=[total // 3, total // 3])
    with pytest.raises(PlanError, match="rank 1's memory limit .* replicated"):
        plan_from_measurements(cfg, [1.0, 1.0], memory=[total, 1000])
    # with the KV cache counted the same limits are tighter
    kv = plan_from_measurements(cfg, [1.0, 4.0, 2.0], memory=lim, cache=(1, 8))
    assert all(b <= m for b, m in zip(kv.bytes_per_rank, lim))
    assert kv.ffn[1] <= p.ffn[1] and kv.heads[1] <= p.heads[1]


@pytest.mark.parametrize("bad, exc, msg", [
    (dict(speeds=[1.0, -1.0]), ValueError, "speeds must be finite and > 0"),
    (dict(speeds=[1.0, float("nan")]), ValueError, "speeds must be finite"),
    (dict(speeds=[]), ValueError, "speeds has 0 entries"),
    (dict(speeds="12"), TypeError, "speeds must be a list"),
    (dict(speeds=[1.0, True]), TypeError, "speeds must be positive numbers"),
    (dict(memory=[10**6]), ValueError, "memory_limits has 1 entries"),
    (dict(memory=[10**6, -5]), ValueError, "memory_limits entry"),
    (dict(memory={0: 10**6, 5: 10**6}), ValueError, "keys must be ranks"),
    (dict(memory={0: 10**6}), ValueError, "missing ranks"),
    (dict(align=7), ValueError, "does not divide ffn=40"),
    (dict(align={"heads": 2}), TypeError, "align must be"),
    (dict(align=0), ValueError, "align"),
    (dict(head_unit="half"), ValueError, "head_unit must be one of"),
    (dict(dtype="int4"), ValueError, "dtype must be one of"),
    (dict(cache=(0, 4)), ValueError, "cache batch"),
])
def test_bad_arguments_are_refused(bad, exc, msg):
    kw = dict(speeds=[1.0, 2.0], memory=None)
    kw.update(bad)
    with pytest.raises(exc, match=msg):
        plan_from_measurements(tpcore.Config(**GPT2), kw.pop("speeds"), **kw)


def test_bad_dims_are_refused():
    with pytest.raises(TypeError, match="config_or_layer_dims must be"):
        plan_from_measurements("gpt2", [1.0])
    with pytest.raises(ValueError, match="ffn_hidden must be"):
        plan_from_measurements((8, 0), [1.0])
    with pytest.raises(ValueError, match="unknown dims field"):
        plan_from_measurements({"hidden": 8, "ffn": 8, "experts": 2}, [1.0])
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        plan_from_measurements({"hidden": 8, "ffn": 8, "heads": 4, "kv_heads": 3, "head_dim": 2, "vocab": 5}, [1.0])


def test_save_load_round_trip_and_corrupt_files(tmp_path):
    cfg = tpcore.Config(**LLAMA)
    p = plan_from_measurements(cfg, [1.0, 2.5, 1.3], memory=[10**7, 2 * 10**7, 10**7], cache=(2, 16))
    p.measurements = {"objective": "both", "ranks": [{"gemm_gflops": 1.0}] * 3}
    path = str(tmp_path / "plan.json")
    p.save(path)
    q = tpcore.Plan.load(path)
    assert q.to_json() == p.to_json() and str(q) == str(p)
    doc = json.load(open(path))

    def bad(mutate, msg):
        d = json.loads(json.dumps(doc))
        mutate(d)
        f = tmp_path / "bad.json"
        f.write_text(json.dumps(d))
        with pytest.raises(PlanError, match=msg):
            tpcore.Plan.load(str(f))

    bad(lambda d: d["heads"].__setitem__(0, d["heads"][0] + 1), "field 'heads'")
    bad(lambda d: d.update(heads=[1, 2, 2]), "field 'heads' is \\[1, 2, 2\\] but the plan's speeds")
    bad(lambda d: d["bytes_per_rank"].__setitem__(1, 5), "field 'bytes_per_rank'")
    bad(lambda d: d.update(predicted=0.01), "field 'predicted'")
    bad(lambda d: d.update(speeds=[1.0, -2.0, 1.0]), "field 'speeds'")
    bad(lambda d: d.update(speeds=[1.0, 2.0]), "field 'memory' must be null or a list of 2")
    bad(lambda d: d.update(memory=[1, 1, 1]), "give no plan")
    bad(lambda d: d.update(align={"ffn": 5, "vocab": 1}), "give no plan")
    bad(lambda d: d.update(head_unit="x"), "field 'head_unit'")
    bad(lambda d: d.pop("ffn"), "missing field")
    bad(lambda d: d.update(version=99), "format/version")
    bad(lambda d: d["dims"].update(heads=5), "dims heads")
    bad(lambda d: d.update(cache=[2]), "field 'cache'")
    for text, msg in ((b"{", "not a JSON plan"), (b"\xff\xfe", "not a JSON plan"), (b"[1, 2]", "JSON object")):
        f = tmp_path / "raw.json"
        f.write_bytes(text)
        with pytest.raises(PlanError, match=msg):
            tpcore.Plan.load(str(f))
    with pytest.raises(PlanError, match="cannot read"):
        tpcore.Plan.load(str(tmp_path / "missing.json"))


# ------------------------------------------------------------- models on planned shards

def _model_on_plan(comm, name, speeds, dtype):
    cfg = tpcore.Config(**CFGS[name])
    plan = tpcore.plan_partition(comm, cfg, speeds=speeds[:comm.size], dtype=dtype)
    model = tpcore.models.TransformerLM(cfg, comm, seed=9, plan=plan, dtype=dtype)
    g = rng_for(5, 0)
    toks = g.integers(0, cfg.vocab_size, (2, 6))
    logits = model.logits(toks)
    out = model.generate(toks.tolist(), max_new_tokens=5)
    sd = model.state_dict_full() if comm.size == 1 else None
    return (logits, [list(map(int, o)) for o in out], plan.heads, plan.ffn, plan.vocab, model.param_bytes(),
            plan.bytes_per_rank[comm.rank], sd)


def _reference(cfg, sd, toks):
    import reference_transformer as ref
    P = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    h = P["wte.weight"][toks]
    if cfg.positions == "learned":
        h = h + P["wpe.weight"][np.arange(toks.shape[1])][None]
    for i in range(cfg.layers):
        blk = {k[len(f"blocks.{i}."):]: v for k, v in P.items() if k.startswith(f"blocks.{i}.")}
        h = ref.block(cfg, blk, h)
    h = ref.norm(cfg, h, P["final_norm.weight"], P.get("final_norm.bias"))
    return h @ (P["wte.weight"] if cfg.tie_embeddings else P["lm_head.weight"]).T


@pytest.mark.parametrize("name, dtype", [("llama", "float32"), ("gpt2", "float32"), ("llama", "bfloat16"),
                                         ("tiny", "float32")])
def test_model_on_planned_uneven_shards_equals_world_1(name, dtype):
    speeds = [1.0, 2.5, 1.3, 0.7]
    want = run(_model_on_plan, 1, name, speeds, dtype)[0]
    cfg = tpcore.Config(**CFGS[name])
    ref = _reference(cfg, want[7], rng_for(5, 0).integers(0, cfg.vocab_size, (2, 6)))
    assert np.abs(want[0] - ref).max() / (1 + np.abs(ref).max()) < (1e-5 if dtype == "float32" else 1e-4)
    for world in (3, 4):
        got = run(_model_on_plan, world, name, speeds, dtype)
        heads, ffn = got[0][2], got[0][3]
        assert len(set(heads)) > 1 or len(set(ffn)) > 1, "the plan should be uneven"
        for r, g in enumerate(got):
            err = np.abs(g[0] - want[0]).max() / (1 + np.abs(want[0]).max())
            assert err < 1e-5, f"world {world} rank {r}: {err}"
            assert g[1] == want[1], f"world {world} rank {r}: greedy tokens differ"
            assert g[5] == g[6], f"rank {r}: the plan estimates {g[6]} bytes, the model holds {g[5]}"


def _layers_on_plan(comm, speeds):
    plan = tpcore.plan_partition(comm, (24, 72), speeds=speeds[:comm.size], align=4)
    mlp = tpcore.ParallelMLP(24, 72, comm, activation="gelu", plan=plan, seed=4)
    col = tpcore.ColumnParallelLinear(24, 72, comm, plan=plan, seed=5, gather_output=True)
    x = rng_for(8, 0).standard_normal((5, 24)).astype(np.float32)
    W1, b1 = mlp.fc1.gather_full()
    W2, b2 = mlp.fc2.gather_full()
    return mlp.forward(x), col.forward(x), [s for _, s in mlp.fc1.partition], [s for _, s in col.partition], \
        W1, b1, W2, b2, plan.ffn, col.gather_full()


def test_mlp_and_linear_on_planned_shards_against_float64():
    speeds = [1.0, 0.4, 0.8]
    for world in (1, 3):
        for y, yc, p1, pc, W1, b1, W2, b2, ffn, (Wc, bc) in run(_layers_on_plan, world, speeds):
            assert p1 == ffn and pc == ffn and all(f % 4 == 0 for f in ffn)
            if world == 3:
                assert ffn[0] > ffn[2] > ffn[1]
            x = rng_for(8, 0).standard_normal((5, 24))
            h = x @ np.float64(W1).T + b1
            act = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
            want = act @ np.float64(W2).T + b2
            assert np.abs(y - want).max() < 1e-4 * (1 + np.abs(want).max())
            wantc = x @ np.float64(Wc).T + bc
            assert np.abs(yc - wantc).max() < 1e-4 * (1 + np.abs(wantc).max())


def _plan_misuse(comm):
    cfg = tpcore.Config(**LLAMA)
    plan = plan_from_measurements(cfg, [1.0, 2.0])
    errs = []
    for fn in (lambda: tpcore.models.TransformerLM(cfg, comm, plan=plan, partition=[2, 4]),
               lambda: tpcore.models.TransformerLM(tpcore.Config(**dict(LLAMA, heads=4)), comm, plan=plan),
               lambda: tpcore.models.TransformerLM(tpcore.Config(**dict(LLAMA, ffn_hidden=40)), comm,
                                                   plan=plan_from_measurements(cfg, [1.0, 1.0])),
               lambda: tpcore.ParallelMLP(24, 50, comm, plan=plan_from_measurements(cfg, [1.0, 1.0])),
               lambda: tpcore.models.TransformerLM(cfg, comm, plan={"heads": [3, 3]})):
        try:
            fn()
            errs.append(None)
        except (TypeError, ValueError) as e:
            errs.append(f"{type(e).__name__}: {e}")
    return errs


def test_plan_misuse_is_a_clear_error():
    errs = run(_plan_misuse, 2)[0]
    assert "TransformerLM: give either plan or partition, not both" in errs[0]
    assert "plan was made for heads=6 but the model has heads=4" in errs[1]
    assert "plan was made for ffn=36 but the model has ffn=40" in errs[2]
    assert "ParallelMLP: the plan splits no dimension of length 50" in errs[3]
    assert errs[4].startswith("TypeError: TransformerLM: plan must be a tpcore.Plan")


def _world_mismatch(comm):
    cfg = tpcore.Config(**LLAMA)
    try:
        tpcore.models.TransformerLM(cfg, comm, plan=plan_from_measurements(cfg, [1.0, 2.0, 1.0]))
    except ValueError as e:
        return str(e)


def test_plan_for_another_world_size_is_refused():
    assert "the plan is for 3 ranks but the communicator has 2" in run(_world_mismatch, 2)[0]


# ------------------------------------------------------------- measuring and the throttle

def _measured(comm, slow_rank, factor):
    if comm.rank == slow_rank:
        tpcore.set_throttle(factor)
    try:
        plan = tpcore.plan_partition(comm, (256, 1024), budget=0.2)
    finally:
        tpcore.set_throttle(1.0)
    return plan.speeds, plan.ffn, plan.memory, plan.measurements


def test_plan_partition_measures_the_throttled_rank_slower():
    for speeds, ffn, memory, meas in run(_measured, 2, 1, 2.5):
        assert speeds[0] == 1.0 and speeds[1] < 0.75, speeds
        assert ffn[0] > ffn[1]
        assert len(memory) == 2 and all(m > 0 for m in memory)
        assert len(meas["ranks"]) == 2 and all(m["gemm_gflops"] > 0 and m["gemv_gbs"] > 0 for m in meas["ranks"])


def test_throttle_set_get_and_bad_values():
    assert tpcore.get_throttle() == 1.0
    try:
        tpcore.set_throttle(2.5)
        assert tpcore.get_throttle() == 2.5
        for bad, exc in ((0.5, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                         (1001, ValueError), (-2, ValueError), ("2", TypeError), (True, TypeError), (None, TypeError)):
            with pytest.raises(exc, match="set_throttle: factor must be"):
                tpcore.set_throttle(bad)
            assert tpcore.get_throttle() == 2.5
        with pytest.raises(ValueError, match=r"set_throttle: factor must be a finite number in \[1, 1000\]"):
            tpcore._C.set_throttle(0.25)  # the C core's own check
    finally:
        tpcore.set_throttle(1)
    assert tpcore.get_throttle() == 1.0


def test_throttle_env_parsing():
    from tpcore.distributed import throttle as _throttle
    assert _throttle.parse("2") == {None: 2.0}
    assert _throttle.parse(" 1:2.0, 0:1.5 ") == {1: 2.0, 0: 1.5}
    for text, msg in (("0.5", "the factor must be a number in"), ("1:2,1:3", "rank 1 is given twice"),
                      ("a:2", "rank:factor pairs"), ("1:x", "the factor of rank 1"), ("1:2,", "rank:factor pairs"),
                      ("-1:2", "rank:factor pairs"), ("nan", "the factor must be")):
        with pytest.raises(ValueError, match=msg):
            _throttle.parse(text)


def _env_factor(comm):
    return tpcore.get_throttle()


def test_throttle_env_reaches_spawned_ranks(monkeypatch):
    monkeypatch.setenv("TPCORE_THROTTLE", "1:2.5,2:1.25")
    assert run(_env_factor, 3) == [1.0, 2.5, 1.25]
    monkeypatch.setenv("TPCORE_THROTTLE", "3")
    assert run(_env_factor, 2) == [3.0, 3.0]
    monkeypatch.setenv("TPCORE_THROTTLE", "1:0")
    with pytest.raises(Exception, match="TPCORE_THROTTLE"):
        run(_env_factor, 2)


def _throttled_layer(comm):
    tpcore.set_num_threads(1)  # one core: less exposed to whatever else runs on the machine
    mlp = tpcore.ParallelMLP(256, 1024, comm, activation="gelu", seed=1)
    x = rng_for(3, 0).standard_normal((64, 256)).astype(np.float32)
    w = rng_for(4, 0).standard_normal((2048, 256)).astype(np.float32)
    calls = (lambda: mlp.forward(x), lambda: tpcore._C.linear_forward(x, w))
    best = {(f, i): math.inf for f in (1.0, 2.0) for i in range(2)}
    try:
        for _ in range(7):  # interleaved rounds: both factors see the same machine
            for f in (1.0, 2.0):
                tpcore.set_throttle(f)
                for i, fn in enumerate(calls):
                    fn()
                    for _ in range(3):
                        t0 = time.perf_counter()
                        fn()
                        best[f, i] = min(best[f, i], time.perf_counter() - t0)
    finally:
        tpcore.set_throttle(1.0)
    return [(best[f, 0], best[f, 1]) for f in (1.0, 2.0)]


def test_throttle_factor_2_roughly_doubles_compute():
    # a loose check (2 shared cores): min-of-N times, ratio > 1.5 for a layer and a direct GEMM
    (mlp1, gemm1), (mlp2, gemm2) = run(_throttled_layer, 1)[0]
    assert mlp2 / mlp1 > 1.5, (mlp1, mlp2)
    assert gemm2 / gemm1 > 1.5, (gemm1, gemm2)
    assert mlp2 / mlp1 < 4 and gemm2 / gemm1 < 4


def test_throttle_env_through_the_launcher(tmp_path):
    import subprocess
    import sys
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(tpcore.__file__)))
    (tmp_path / "thr.py").write_text("import tpcore\nc = tpcore.init()\n"
                                     "print('factor', c.rank, tpcore.get_throttle())\nc.close()\n")
    r = subprocess.run([sys.executable, "-m", "tpcore.launch", "-n", "3", str(tmp_path / "thr.py")],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=pkg_parent, TPCORE_THROTTLE="1:2.0"))
    assert r.returncode == 0, r.stdout + r.stderr
    for rank, f in ((0, 1.0), (1, 2.0), (2, 1.0)):
        assert f"factor {rank} {f}" in r.stdout, r.stdout


def _embedding_on_plan(comm):
    cfg = tpcore.Config(**dict(GPT2, vocab_size=40))  # vocab == ffn: the embedding takes the vocabulary's split
    plan = plan_from_measurements(cfg, [1.0, 3.0], align={"ffn": 4, "vocab": 1})
    emb = tpcore.VocabParallelEmbedding(40, 8, comm, plan=plan, seed=2)
    toks = np.array([0, 7, 39, 20, 33])
    full = emb.gather_full()
    return [s for _, s in emb.partition], plan.vocab, plan.ffn, emb.forward(toks), full[toks]


def test_embedding_on_planned_shards():
    for part, vocab, ffn, got, want in run(_embedding_on_plan, 2):
        assert part == vocab and vocab != ffn and vocab[1] > vocab[0]
        assert np.array_equal(got, want)


def _disagree_case(comm, how):
    cfg = tpcore.Config(vocab_size=64, hidden=32, layers=1, heads=4, ffn_hidden=64)
    kw = dict(speeds=[1.0, 0.5], memory_limits=[1 << 30, 1 << 30])
    if how == "memory":
        kw["memory_limits"] = [1 << 30, (1 << 20) * (1 + comm.rank)]
    elif how == "align":
        kw["align"] = 8 if comm.rank == 0 else 16
    elif how == "one-bad":
        kw["dtype"] = "float32" if comm.rank == 0 else "int3"
    try:
        tpcore.plan_partition(comm, cfg, **kw)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("how", ["memory", "align", "one-bad"])
def test_ranks_that_pass_different_arguments_fail_together(how):
    """plan_partition is a collective: arguments that differ across ranks (or a refusal on one rank)
    are a ValueError on every rank, before anything is measured, never a plan that differs per rank."""
    errs = tpcore.spawn(_disagree_case, 2, args=(how,), timeout=20)
    assert all(errs), errs
    if how == "one-bad":  # rank 1 says what it refused; rank 0 names rank 1
        assert "dtype must be one of" in errs[1] and "rank 1 refused its arguments" in errs[0], errs
    else:
        assert all("the arguments" in e and "differ" in e for e in errs), errs
