"""A Mixtral decoder layer (tpcore.models.moe_block.MoEBlock) on ProcessGrid(tp=, ep=, dp=) grids:
attention heads over grid.tp, whole experts over grid.ep, each EP lane and DP replica with its
own rows of the batch; after grid.average_gradients (dense tensors over ep x dp, experts over dp
and / ep) the gradients are those of transformers' MixtralDecoderLayer over the whole batch by
torch autograd (the mean over the replicas), and the outputs are its outputs."""
import numpy as np
import pytest

import tpcore
from conftest import run
from tpcore.models.moe_block import MoEBlock

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")

C, H, HK, D, F, E, K, B, T = 32, 4, 2, 8, 24, 5, 2, 4, 6


def _hf():
    torch.manual_seed(2)
    cfg = transformers.MixtralConfig(vocab_size=16, hidden_size=C, intermediate_size=F, num_hidden_layers=1,
                                     num_attention_heads=H, num_key_value_heads=HK, head_dim=D, num_local_experts=E,
                                     num_experts_per_tok=K, rms_norm_eps=1e-5, rope_theta=10000.0,
                                     max_position_embeddings=64, sliding_window=None)
    cfg._experts_implementation = "eager"
    cfg._attn_implementation = "eager"
    layer = mixtral.MixtralDecoderLayer(cfg, 0).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0, 0.5 if "gate.weight" in name else 0.15)
    return cfg, layer


def _reference():
    cfg, layer = _hf()
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((B, T, C)), rng.standard_normal((B, T, C))
    xt = torch.tensor(x, requires_grad=True)
    pos = torch.arange(T)[None].expand(B, T)
    cos, sin = mixtral.MixtralRotaryEmbedding(cfg)(xt, pos)
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    y = layer(xt, position_embeddings=(cos.double(), sin.double()), attention_mask=mask, position_ids=pos)
    (y * torch.tensor(g)).sum().backward()
    a, m = layer.self_attn, layer.mlp
    sd = {"norm1.weight": layer.input_layernorm.weight, "norm2.weight": layer.post_attention_layernorm.weight,
          "attn.q.weight": a.q_proj.weight, "attn.k.weight": a.k_proj.weight, "attn.v.weight": a.v_proj.weight,
          "attn.out.weight": a.o_proj.weight, "moe.router.weight": m.gate.weight}
    for e in range(E):
        sd[f"moe.experts.{e}.fc1.weight"] = m.experts.gate_up_proj[e]
        sd[f"moe.experts.{e}.fc2.weight"] = m.experts.down_proj[e]
    grads = {k: v.grad for k, v in sd.items() if not k.startswith("moe.experts")}
    grads.update({f"moe.experts.{e}.fc1.weight": m.experts.gate_up_proj.grad[e] for e in range(E)})
    grads.update({f"moe.experts.{e}.fc2.weight": m.experts.down_proj.grad[e] for e in range(E)})
    f32 = {k: np.ascontiguousarray(v.detach().numpy(), np.float32) for k, v in sd.items()}
    return f32, x, g, y.detach().numpy(), {k: v.numpy() for k, v in grads.items()}


def _cfg():
    return tpcore.Config(vocab_size=16, hidden=C, layers=1, heads=H, kv_heads=HK, head_dim=D, ffn_hidden=F,
                         norm="rmsnorm", eps=1e-5, activation="swiglu", positions="rope", rope_theta=10000.0,
                         bias=False, max_positions=64, model_type="llama", experts=E, experts_per_token=K)


def _grid_step(comm, tp, ep, dp, sd, x, g):
    grid = tpcore.ProcessGrid(comm, tp=tp, ep=ep, dp=dp)
    blk = MoEBlock(_cfg(), grid.tp, ep=grid.ep)
    blk.load_full(sd)
    replica = grid.ep_rank + ep * grid.dp_rank  # each EP lane and DP replica: its own rows
    rows = slice(replica * B // (ep * dp), (replica + 1) * B // (ep * dp))
    y = blk(x[rows].astype(np.float32))
    blk.backward(g[rows].astype(np.float32))
    grid.average_gradients(blk)
    grads = blk.gather_full(grads=True)
    experts = blk.moe.experts_local
    grid.close()
    return rows, y, grads, experts


@pytest.mark.parametrize("tp,ep,dp", [(1, 2, 1), (2, 2, 1), (1, 2, 2), (1, 4, 1), (1, 3, 1)])
def test_tp_x_ep_x_dp_grid_matches_transformers(tp, ep, dp):
    sd, x, g, y, grads = _reference()
    replicas = ep * dp
    res = run(_grid_step, tp * ep * dp, tp, ep, dp, sd, x, g)
    for rows, out, got, _ in res:
        want = y[rows]
        assert np.abs(out - want).max() <= 1e-4 * np.abs(want).max()
        for name, w in grads.items():  # the averaged gradient is the mean over the replicas
            err = np.abs(got[name] * replicas - w).max() / np.abs(w).max()
            assert err < 1e-4, (name, err)
    assert sorted(e for r in res[:tp * ep:tp] for e in r[3]) == list(range(E))


def _bad_block(comm, case):
    kw = {}
    if case == "dense":
        cfg = tpcore.Config(**dict(_cfg().__dict__, experts=0, experts_per_token=0))
    elif case == "geglu":
        cfg = tpcore.Config(**dict(_cfg().__dict__, activation="geglu"))
    elif case == "bias":
        cfg = tpcore.Config(**dict(_cfg().__dict__, mlp_bias=True))
    else:
        cfg = _cfg()
        kw = {"device": "cuda"} if case == "device" else {"dtype": {"fc1": "bfloat16"}} if case == "dtype" else \
            {"ffn_partition": [F]}
    try:
        MoEBlock(cfg, comm, **kw)
        return "no error"
    except (TypeError, ValueError) as e:
        return str(e)


@pytest.mark.parametrize("case,words", [("dense", "experts is 0"), ("geglu", "'geglu'"), ("bias", "no biases"),
                                        ("device", "device must be 'cpu'"), ("dtype", "'bfloat16' for fc1"),
                                        ("ffn", "ffn_partition")])
def test_configs_a_moe_block_cannot_run_are_refused_by_name(case, words):
    msg = run(_bad_block, 1, case)[0]
    assert words in msg, msg
