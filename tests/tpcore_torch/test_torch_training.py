"""tpcore.torch in training: a small model trained at world 2 step for step against the plain torch
model (SGD, AdamW), full state dicts across world sizes and from plain torch modules, sharded
state dicts, bad inputs, import without torch, bfloat16 parameters, the docs' training loop.
The modules' forward and backward against float64 references: test_torch.py."""
import copy
import pickle
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import tpcore  # noqa: E402  (after importorskip("torch"): the module skips without torch)
import tpcore.torch as tt  # noqa: E402  (after importorskip("torch"): the module skips without torch)
from conftest import run  # noqa: E402  (after importorskip("torch"): the module skips without torch)
from torch_reference import (  # noqa: E402  (after importorskip("torch"))
    close, CONFIGS, DIM, FFN, gen, H, IN, OUT, randn, ref_block, uneven, V,
)
import paths  # noqa: E402  (after importorskip("torch"))

# ------------------------------------------------------------------ training at world 2
class PlainModel(torch.nn.Module):
    """The single-process torch model: embedding -> block -> LM head -> cross-entropy."""

    def __init__(self, cfg, sd):
        super().__init__()
        self.cfg, self.names = cfg, list(sd)
        self.P = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(v.clone()) for k, v in sd.items()})

    def forward(self, tokens, targets):
        P = {k: self.P[k.replace(".", "_")] for k in self.names}
        block = {k[len("block."):]: v for k, v in P.items() if k.startswith("block.")}
        h = ref_block(self.cfg, block, F.embedding(tokens, P["emb.weight"]))
        logits = F.linear(h, P["head.weight"])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TPModel(torch.nn.Module):
    def __init__(self, cfg, comm):
        super().__init__()
        self.comm = comm
        self.emb = tt.VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, comm, seed=1)
        self.block = tt.TransformerBlock(cfg, comm, seed=2)
        self.head = tt.ColumnParallelLinear(cfg.hidden, cfg.vocab_size, comm, bias=False, seed=3)
        self.xent = tt.VocabParallelCrossEntropy(comm)

    def forward(self, tokens, targets):
        return self.xent(self.head(self.block(self.emb(tokens))), targets)


def _train_case(comm, opt_name, name):
    cfg = tpcore.Config(**CONFIGS[name])
    tp = TPModel(cfg, comm)
    sd = tp.state_dict()  # full tensors: the plain model starts from the same weights
    plain = PlainModel(cfg, sd)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}[opt_name]
    opt_tp, opt_plain = make(tp.parameters()), make(plain.parameters())
    g = gen(6000)  # the same batches on both ranks (data parallel would differ; tensor parallel does not)
    for step in range(4):
        tokens = torch.randint(0, V, (2, 5), generator=g)
        targets = torch.randint(0, V, (2, 5), generator=g)
        opt_tp.zero_grad()
        opt_plain.zero_grad()
        loss_tp = tp(tokens, targets)
        loss_plain = plain(tokens, targets)
        close(loss_tp, loss_plain, f"step {step}: loss", 1e-5)
        loss_tp.backward()
        loss_plain.backward()
        opt_tp.step()
        opt_plain.step()
        now = tp.state_dict()
        for k in sd:
            close(now[k], plain.P[k.replace(".", "_")], f"step {step}: {k}", 1e-4)
    assert not torch.equal(now["head.weight"], sd["head.weight"])  # it did train
    return float(loss_tp)


# Adam's update normalises the gradient: a gradient that is zero in exact arithmetic (the key
# bias: softmax is invariant to it) is rounding noise, turned into steps of size lr that differ
# between any two float32 implementations; the Adam case uses the bias-free Llama block.
@pytest.mark.parametrize("opt_name,name", [("sgd", "gpt"), ("adamw", "llama")])
def test_training_matches_plain_torch_step_for_step(opt_name, name):
    losses = run(_train_case, 2, opt_name, name)
    assert losses[0] == losses[1]


# ------------------------------------------------------------------ state dicts
def _build(comm, seed):
    cfg = tpcore.Config(**CONFIGS["llama"])
    return torch.nn.ModuleDict({
        "col": tt.ColumnParallelLinear(IN, OUT, comm, gated=True, seed=seed),
        "row": tt.RowParallelLinear(OUT, IN, comm, input_is_parallel=False, seed=seed),
        "mlp": tt.ParallelMLP(H, FFN, comm, activation="swiglu", seed=seed),
        "emb": tt.VocabParallelEmbedding(V, DIM, comm, seed=seed),
        "block": tt.TransformerBlock(cfg, comm, seed=seed),
        "norm": torch.nn.LayerNorm(3),  # a plain module in the same model
    })


def _outputs(model):
    g = gen(7000)
    with torch.no_grad():
        return {"col": model["col"](randn(g, 2, IN)), "row": model["row"](randn(g, 2, OUT)),
                "mlp": model["mlp"](randn(g, 2, H)), "emb": model["emb"](torch.tensor([0, 16, 7])),
                "block": model["block"](randn(g, 1, 4, 12))}


def _gated_output(comm, model):
    """The gated column layer's full output in [gates | ups] order (each rank outputs its
    [gate_r | up_r] columns): comparable across world sizes."""
    part = model["col"].partition
    y = comm.all_gather(_outputs(model)["col"].numpy(), axis=-1, sizes=[2 * s for _, s in part])
    gates, ups, o = [], [], 0
    for _, s in part:
        gates.append(y[..., o:o + s])
        ups.append(y[..., o + s:o + 2 * s])
        o += 2 * s
    return np.concatenate(gates + ups, -1)


def _save_case(comm):
    model = _build(comm, 11)
    with torch.no_grad():
        model["norm"].weight.uniform_(generator=gen(1))
    sd = model.state_dict()
    out = _outputs(model)
    return {k: v.clone() for k, v in sd.items()}, {k: v for k, v in out.items() if k != "col"}, \
        _gated_output(comm, model)


def _load_case(comm, sd, want, want_col):
    model = _build(comm, 99)  # other weights: everything must come from sd
    assert not torch.equal(model.state_dict()["emb.weight"], sd["emb.weight"])
    model.load_state_dict(sd)
    out = _outputs(model)
    for k, v in want.items():
        close(out[k], v, f"{k} after loading at world {comm.size}", 1e-6)
    np.testing.assert_allclose(_gated_output(comm, model), want_col, rtol=1e-6, atol=1e-6)
    again = model.state_dict()
    assert sorted(again) == sorted(sd)
    for k in sd:
        assert torch.equal(again[k], sd[k]), k
    return True


def test_full_state_dict_reshards_across_world_sizes():
    saved = run(_save_case, 2)
    sd, want, want_col = saved[0]
    assert all(torch.equal(sd[k], saved[1][0][k]) for k in sd)  # every rank gets the full tensors
    assert sd["col.weight"].shape == (2 * OUT, IN) and sd["mlp.fc1.weight"].shape == (2 * FFN, H)
    assert "block.attn.q.weight" in sd and "block.attn.qkv.weight" not in sd
    assert sd["norm.weight"].shape == (3,)
    for world in (3, 1):
        assert run(_load_case, world, sd, want, want_col) == [True] * world


def test_full_state_dict_from_plain_torch_modules():
    def case(comm):
        torch.manual_seed(0)  # the same plain modules on every rank
        lin = torch.nn.Linear(IN, OUT)
        emb = torch.nn.Embedding(V, DIM)
        m = tt.RowParallelLinear(IN, OUT, comm, input_is_parallel=False)
        e = tt.VocabParallelEmbedding(V, DIM, comm)
        m.load_state_dict(lin.state_dict())
        e.load_state_dict(emb.state_dict())
        x, t = torch.randn(3, IN), torch.tensor([[4, 0, 16]])
        with torch.no_grad():
            close(m(x), lin(x), "row vs nn.Linear", 1e-6)
            close(e(t), emb(t), "embedding vs nn.Embedding", 0)
        return True
    assert run(case, 3) == [True] * 3


def _sharded_case(comm):
    n, r = comm.size, comm.rank
    model = _build(comm, 5)
    sd = tt.sharded_state_dict(model)
    assert sd["col._tp_shard"].tolist()[:3] == [1, n, r]
    assert sd["col.weight"].shape == model["col"].weight.shape  # only this rank's shard
    assert sd["block.attn.qkv.weight"].shape == model["block"].attn.qkv.weight.shape
    out = _outputs(model)
    other = _build(comm, 6)
    tt.load_sharded_state_dict(other, sd)
    for k, v in _outputs(other).items():
        assert torch.equal(v, out[k]), k
    # another rank's shard: refused, naming both layouts
    peer = {k: v.clone() for k, v in sd.items()}
    peer["col._tp_shard"][2] = (r + 1) % n
    with pytest.raises(RuntimeError, match=rf"col._tp_shard: the shard was saved with .*rank {(r + 1) % n}, .* but "
                                           rf".*rank {r}, .*same world size, rank and partition"):
        tt.load_sharded_state_dict(other, peer)
    # the same world size and rank but another partition
    col = {k[len("col."):]: v for k, v in sd.items() if k.startswith("col.")}
    moved = tt.ColumnParallelLinear(IN, OUT, comm, gated=True, partition=uneven(OUT, n))
    if moved.partition != model["col"].partition:
        sizes = ", ".join(str(sz) for _, sz in moved.partition)
        with pytest.raises(RuntimeError, match=rf"partition \[5, 5\] but .* partition \[{sizes}\]"):
            tt.load_sharded_state_dict(moved, col)
    # a shard without its metadata, and a sharded dict handed to load_state_dict
    bad = {k: v for k, v in sd.items() if k != "mlp._tp_shard"}
    with pytest.raises(RuntimeError, match="mlp._tp_shard is missing"):
        tt.load_sharded_state_dict(other, bad)
    with pytest.raises(RuntimeError, match="load it with tpcore.torch.load_sharded_state_dict"):
        other.load_state_dict(sd)
    return {k: v.clone() for k, v in sd.items()}


def test_sharded_state_dict():
    sd0 = run(_sharded_case, 2)[0]

    def wrong_world(comm):
        model = _build(comm, 7)
        with pytest.raises(RuntimeError, match=r"world size 2, rank 0.*world size 3"):
            tt.load_sharded_state_dict(model, sd0)
        return True
    assert run(wrong_world, 3) == [True] * 3


def _errors_case(comm):
    m = tt.ColumnParallelLinear(IN, OUT, comm)
    x = torch.randn(2, IN)
    with pytest.raises(TypeError, match=r"ColumnParallelLinear: x is on meta:0 but the module is on the CPU"):
        m(torch.empty(2, IN, device="meta"))
    with pytest.raises(TypeError, match=r"x has dtype torch.float64; expected torch.float32"):
        m(x.double())
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got ndarray"):
        m(x.numpy())
    with pytest.raises(ValueError, match=r"x must have shape \(\.\.\., 13\)"):
        m(torch.randn(2, IN + 1))
    with pytest.raises(TypeError, match="cannot be moved or converted"):
        m.double()
    with pytest.raises(TypeError, match="cannot be moved or converted"):
        m.to(torch.bfloat16)
    assert m.to("cpu") is m and m.weight.data_ptr() == m.layer.weight.ctypes.data
    # share_memory_ works in place (same tensor, new storage): refused before it moves anything
    for owner in (m, torch.nn.Sequential(m)):
        with pytest.raises(TypeError, match="cannot be moved or converted"):
            owner.share_memory()
        assert m.weight.data_ptr() == m.layer.weight.ctypes.data
    with pytest.raises(TypeError, match="comm must be a tpcore.Comm"):
        tt.ParallelMLP(4, 4, object())
    with pytest.raises(ValueError, match="activation"):
        tt.ParallelMLP(4, 4, comm, activation="tanh")
    e = tt.VocabParallelEmbedding(V, DIM, comm)
    with pytest.raises(TypeError, match="tokens must be an integer tensor"):
        e(torch.zeros(3))
    with pytest.raises(ValueError, match="out of range|outside"):
        e(torch.tensor([V]))
    with pytest.raises(TypeError, match="logits_shard must be float32"):
        tt.vocab_parallel_cross_entropy(torch.zeros(2, 3, dtype=torch.float64), torch.tensor([0, 1]), comm)
    with pytest.raises(ValueError, match="reduction"):
        tt.VocabParallelCrossEntropy(comm, reduction="avg")
    # state dicts: wrong shapes, missing and unexpected keys
    sd = m.state_dict()
    with pytest.raises(RuntimeError, match=r"size mismatch for weight: .*shape \(10, 12\).*full \(unsharded\) "
                                           r"shape .* is \(10, 13\)"):
        m.load_state_dict({"weight": torch.zeros(OUT, IN - 1), "bias": sd["bias"]})
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "bias"'):
        m.load_state_dict({"weight": sd["weight"]})
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        m.load_state_dict(dict(sd, extra=torch.zeros(1)))
    with pytest.raises(RuntimeError, match="must be a floating-point tensor"):
        m.load_state_dict({"weight": torch.zeros(OUT, IN, dtype=torch.int64), "bias": sd["bias"]})
    # strict=False: what is given is loaded, the rest kept
    W = torch.randn(OUT, IN)
    m.load_state_dict({"weight": W}, strict=False)
    now = m.state_dict()
    assert torch.equal(now["weight"], W) and torch.equal(now["bias"], sd["bias"])
    # pickling and copying: refused by name (a shallow copy would share the C layer but not the
    # forward counter, so the replay before backward would be skipped: wrong gradients)
    for how, what in ((copy.copy, m), (copy.deepcopy, torch.nn.Sequential(m)), (pickle.dumps, torch.nn.Sequential(m))):
        with pytest.raises(TypeError, match="ColumnParallelLinear cannot be pickled or copied.*state_dict"):
            how(what)
    # a parameter parted from the C memory (its .data replaced, or another Parameter assigned)
    # would train a copy the C layer never sees: the next forward says so
    mlp = tt.ParallelMLP(4, 5, comm)
    torch.nn.utils.vector_to_parameters(torch.nn.utils.parameters_to_vector(mlp.parameters()) + 1, mlp.parameters())
    with pytest.raises(RuntimeError, match=r"ParallelMLP: parameter fc\d\.\w+ no longer views the C layer's memory"):
        mlp(torch.randn(2, 4))
    m.weight = torch.nn.Parameter(W.clone())  # e.g. tying the weight to another module's
    with pytest.raises(RuntimeError, match="parameter weight no longer views the C layer's memory"):
        m(x)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_errors(world):
    assert run(_errors_case, world) == [True] * world


def test_import_tpcore_does_not_import_torch_and_missing_torch_is_explained():
    code = ("import sys; import tpcore; assert 'torch' not in sys.modules, 'tpcore imported torch'\n"
            "sys.modules['torch'] = None  # as if torch were not installed\n"
            "try:\n    import tpcore.torch\nexcept ImportError as e:\n    print(e)\nelse:\n    print('imported')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "tpcore.torch needs PyTorch, an optional dependency" in out.stdout
    assert "pip install 'torch>=2.1'" in out.stdout


def _bf16_params_case(comm):
    r = comm.rank
    g = gen(8000)
    m = tt.ColumnParallelLinear(IN, OUT, comm, dtype="bfloat16", seed=2)
    mlp = tt.ParallelMLP(H, FFN, comm, activation="gelu_tanh", dtype="bfloat16", seed=3)
    assert m.weight.dtype == torch.bfloat16 and m.bias.dtype == torch.float32  # 16-bit weights, float32 biases
    assert m.weight.data_ptr() == m.layer.weight.ctypes.data
    sd = m.state_dict()
    assert sd["weight"].dtype == torch.bfloat16
    W, b = sd["weight"].double(), sd["bias"].double()
    off, loc = m.partition[r]
    x, dy = randn(g, 4, IN).requires_grad_(), randn(g, 4, loc)
    y = m(x)
    want = x.detach().double() @ W.T + b
    close(y, want[:, off:off + loc], "bf16-weight y", 1e-5)  # float32 arithmetic on the bf16 weights
    y.backward(dy)
    dy_full = torch.from_numpy(comm.all_gather(dy.numpy(), axis=1, sizes=[s for _, s in m.partition]))
    assert m.weight.grad.dtype == torch.bfloat16  # as a bf16 nn.Linear's
    close(m.weight.grad, (dy.double().T @ x.detach().double()), "bf16-weight dW", 1e-2)
    close(x.grad, dy_full.double() @ W, "bf16-weight dx", 1e-5)
    torch.optim.SGD(m.parameters(), lr=0.5).step()  # a bf16 step lands in the C weight
    assert m.weight.data_ptr() == m.layer.weight.ctypes.data
    after = m.state_dict()["weight"]
    assert not torch.equal(after, sd["weight"])
    close(after, sd["weight"].double() - 0.5 * _gather_rows(comm, m.weight.grad, m.partition), "bf16 step", 1e-2)
    # full state dicts of 16-bit weights round trip bit for bit
    mlp2 = tt.ParallelMLP(H, FFN, comm, activation="gelu_tanh", dtype="bfloat16", seed=9)
    msd = mlp.state_dict()
    mlp2.load_state_dict(msd)
    assert all(torch.equal(v, msd[k]) for k, v in mlp2.state_dict().items())
    xm = randn(g, 2, H)
    with torch.no_grad():
        assert torch.equal(mlp(xm), mlp2(xm))
    return True


def _gather_rows(comm, t, part):
    return torch.from_numpy(comm.all_gather(t.float().numpy(), sizes=[s for _, s in part])).double()


def test_bfloat16_parameters():
    pytest.importorskip("ml_dtypes")  # tpcore's NumPy views of 16-bit weights
    assert run(_bf16_params_case, 2) == [True, True]


@pytest.mark.slow  # the docs' script in a subprocess; test_training_matches_plain_torch_step_for_step: the same
def test_docs_training_loop_runs(tmp_path):
    """The tpcore.torch page's example (docs/torch.md), run as it is (fewer steps, the checkpoint in tmp_path)."""
    import os
    page = open(paths.ROOT / "docs" / "torch.md").read()
    i = page.index("# PyTorch modules: tpcore.torch")
    j = page.index("```python\n", i) + len("```python\n")
    code = page[j:page.index("```", j)]
    assert "tpcore.spawn(train, 2)" in code and "range(10)" in code
    code = code.replace("range(10)", "range(2)").replace('"tiny.pt"', repr(str(tmp_path / "tiny.pt")))
    code = code.replace("tpcore.spawn(train, 2)", "tpcore.spawn(train, 2, deadline=120)")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(tpcore.__file__), ".."),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    sd = torch.load(tmp_path / "tiny.pt")
    assert sd["head.weight"].shape == (1000, 64) and sd["emb.weight"].shape == (1000, 64)
