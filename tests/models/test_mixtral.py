"""A tiny Mixtral as a tpcore.models.TransformerLM with MoE decoder layers (config.experts > 0,
tpcore.models.moe_block) against transformers' MixtralForCausalLM built from its config with random
non-zero weights (loaded from its state_dict with a small name map of this test's own): logits at
world 1-4 (experts split over the ranks, 8 on 3 as 3, 3, 2), greedy generation with the KV cache,
the training loss with the router's load-balancing loss (padding masked) and every block's
gradients against torch autograd; and a TP x EP grid (attention over grid.tp, experts over
grid.ep, different tokens per EP rank) whose averaged gradients equal one process's."""
import numpy as np
import pytest

import tpcore
from conftest import run
from tpcore.nn.moe import load_balancing_loss
from tpcore.models.moe_block import MoEBlock, expert_bytes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, C, L, H, HK, D, F, E, K = 61, 32, 2, 4, 2, 8, 24, 8, 2
COEF = 0.05


def _config(E=E):
    return tpcore.Config(vocab_size=V, hidden=C, layers=L, heads=H, kv_heads=HK, head_dim=D, ffn_hidden=F,
                         norm="rmsnorm", eps=1e-5, activation="swiglu", positions="rope", rope_theta=10000.0,
                         bias=False, max_positions=64, model_type="llama", experts=E, experts_per_token=K,
                         norm_topk_prob=True, router_aux_loss_coef=COEF, tie_embeddings=False)


def _hf_model(E=E):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=C, intermediate_size=F, num_hidden_layers=L,
                                     num_attention_heads=H, num_key_value_heads=HK, head_dim=D, num_local_experts=E,
                                     num_experts_per_tok=K, rms_norm_eps=1e-5, rope_theta=10000.0,
                                     max_position_embeddings=64, tie_word_embeddings=False,
                                     router_aux_loss_coef=COEF, output_router_logits=True, sliding_window=None)
    cfg._experts_implementation = "eager"  # (the grouped-GEMM path takes no float64)
    cfg._attn_implementation = "eager"
    m = transformers.MixtralForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "gate.weight" in name:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
    return m


def _ours(sd, E=E):
    """transformers' Mixtral tensors -> tpcore's full names (float32)."""
    out = {"wte.weight": sd["model.embed_tokens.weight"], "final_norm.weight": sd["model.norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(L):
        p, q = f"model.layers.{i}.", f"blocks.{i}."
        out[q + "norm1.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "norm2.weight"] = sd[p + "post_attention_layernorm.weight"]
        for n in "qkv":
            out[q + f"attn.{n}.weight"] = sd[p + f"self_attn.{n}_proj.weight"]
        out[q + "attn.out.weight"] = sd[p + "self_attn.o_proj.weight"]
        out[q + "moe.router.weight"] = sd[p + "mlp.gate.weight"]
        for e in range(E):
            out[q + f"moe.experts.{e}.fc1.weight"] = sd[p + "mlp.experts.gate_up_proj"][e]
            out[q + f"moe.experts.{e}.fc2.weight"] = sd[p + "mlp.experts.down_proj"][e]
    return {k: np.ascontiguousarray(v.detach().numpy(), np.float32) for k, v in out.items()}


def _data():
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, V, (2, 9))
    mask = np.ones((2, 9), np.int64)
    mask[1, -3:] = 0  # right padding (a left-padded query attends to nothing: NaN in transformers)
    return tokens, mask


def _reference(E=E):
    m = _hf_model(E)
    tokens, mask = _data()
    tt = torch.tensor(tokens)
    with torch.no_grad():
        logits = m(tt).logits.numpy()
        gen = m.generate(tt[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()[:, 5:]
    m.zero_grad()
    labels = tt.clone()
    labels[torch.tensor(mask) == 0] = -100
    out = m(tt, attention_mask=torch.tensor(mask), labels=labels)
    out.loss.backward()
    grads = {}
    for i in range(L):
        q = f"blocks.{i}."
        lay = m.model.layers[i]
        grads[q + "moe.router.weight"] = lay.mlp.gate.weight.grad.numpy()
        grads[q + "norm2.weight"] = lay.post_attention_layernorm.weight.grad.numpy()
        grads[q + "attn.q.weight"] = lay.self_attn.q_proj.weight.grad.numpy()
        for e in range(E):
            grads[q + f"moe.experts.{e}.fc1.weight"] = lay.mlp.experts.gate_up_proj.grad[e].numpy()
            grads[q + f"moe.experts.{e}.fc2.weight"] = lay.mlp.experts.down_proj.grad[e].numpy()
    return _ours(m.state_dict(), E), logits, gen, float(out.loss.detach()), float(out.aux_loss.detach()), grads


def _ranks(comm, sd, E=E):
    tokens, mask = _data()
    model = tpcore.models.TransformerLM(_config(E), comm)
    assert all(isinstance(b, MoEBlock) for b in model.blocks)
    model.load_state_dict_full(sd)
    logits = model.logits(tokens)
    gen = model.generate(tokens[:1, :5], max_new_tokens=6)
    read = model.blocks[0].expert_bytes_read()  # the last decode step's
    moe = model.blocks[0].moe  # "ep": whole experts; "tp": every expert's ffn_local columns
    assert expert_bytes(model)["held"] == len(moe.experts_local) * 3 * moe.ffn_local * C * 4 * L
    assert expert_bytes(model)["read"] <= K * 3 * F * C * 4 * L
    targets = np.where(mask == 1, tokens, -100)
    targets = np.concatenate([targets[:, 1:], np.full((2, 1), -100)], 1)
    total = model.loss(tokens, targets, attention_mask=mask)  # CE + coef x aux (config.router_aux_loss_coef)
    assert all(b.moe._aux_dprobs is not None for b in model.blocks)  # loss registered the aux gradient
    aux = load_balancing_loss(model, mask, coef=model.config.router_aux_loss_coef)  # (registers the same gradient)
    model.backward()
    grads = {}
    for i, b in enumerate(model.blocks):
        grads.update({f"blocks.{i}.{k}": v for k, v in b.gather_full(grads=True).items()})
    return logits, np.asarray(gen), read, total, aux, grads, [b.moe.experts_local for b in model.blocks], \
        model.blocks[0].moe.mode


_REFS = {}


def reference(E):
    """transformers' results for a Mixtral of E experts (made once per module)."""
    if E not in _REFS:
        _REFS[E] = _reference(E)
    return _REFS[E]


def _close(a, b, tol=1e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)
    assert err < tol, err


@pytest.mark.parametrize("world,E", [(1, E), (2, E), (3, E), (4, E), (3, 2)])
def test_mixtral_logits_generation_loss_and_gradients_match_transformers(world, E):
    """8 experts: expert parallelism (whole experts per rank); 2 experts on 3 ranks: tensor
    parallelism inside the experts (every rank a slice of each)."""
    sd, logits, gen, loss, aux, grads = reference(E)
    for r, (lg, g, read, ce, a, gr, local, mode) in enumerate(run(_ranks, world, sd, E)):
        _close(lg, logits)
        assert np.array_equal(np.asarray(g).reshape(-1)[-6:], gen.reshape(-1)), (g, gen)
        assert abs(a - aux) <= 1e-5 * abs(aux), (a, aux)
        assert abs(ce - loss) <= 1e-5 * abs(loss), (ce, loss)
        for name, want in grads.items():
            _close(gr[name], want)
        if E >= world:
            assert mode == "ep" and local[0] == list(range(sum((E // world + (q < E % world)) for q in range(r)),
                                                           sum((E // world + (q < E % world)) for q in range(r + 1))))
        else:
            assert mode == "tp" and local[0] == list(range(E))
        assert read <= K * 3 * F * C * 4  # a decode step reads at most top-k experts' weights
