"""Tensor-parallel Transformer models: logits equal at world 1-4 and equal to a
float64 NumPy reference of the whole model; greedy generation identical at
every world size and equal to decoding without the KV cache; a tiny model
trains on a copy task with matching loss curves at world 1 and 2; checkpoints
saved at one world size load at others (full, sharded, Hugging Face GPT-2 and
Llama naming written by the test) with each rank's memory near its shard."""
import json
import os

import numpy as np
import pytest

import tpcore
import reference_transformer as ref
from conftest import WORLD_SIZES, rng_for, run
from tpcore.io.formats import write_safetensors

GPT2 = dict(vocab_size=97, hidden=24, layers=2, heads=6, ffn_hidden=40, norm="layernorm", activation="gelu_tanh",
            positions="learned", max_positions=32, causal=True, pre_norm=True, bias=True, tie_embeddings=True,
            model_type="gpt2")
LLAMA = dict(vocab_size=101, hidden=24, layers=2, heads=6, kv_heads=2, ffn_hidden=36, norm="rmsnorm", eps=1e-6,
             activation="swiglu", positions="rope", rope_theta=1000.0, max_positions=64, causal=True, pre_norm=True,
             bias=False, tie_embeddings=False, model_type="llama")
BERT = dict(vocab_size=89, hidden=20, layers=2, heads=5, ffn_hidden=33, norm="layernorm", eps=1e-12,
            activation="gelu", positions="learned", max_positions=16, causal=False, pre_norm=False, bias=True,
            type_vocab_size=2, final_norm=False, embedding_norm=True, model_type="bert")
CFGS = {"gpt2": GPT2, "llama": LLAMA, "bert": BERT}


def _tokens(cfg, B=2, T=7, seed=3):
    return rng_for(seed, 0).integers(0, cfg.vocab_size, (B, T))


def _logits(comm, name):
    cfg = tpcore.Config(**CFGS[name])
    model = tpcore.models.TransformerLM(cfg, comm, seed=11)
    toks = _tokens(cfg)
    if name == "bert":
        mask = np.ones_like(toks)
        mask[1, 5:] = 0
        return model.encode(toks, attention_mask=mask)
    return model.logits(toks)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_logits_equal_at_every_world_size(name):
    want = run(_logits, 1, name)[0]
    for world in (2, 3, 4):
        for r, got in enumerate(run(_logits, world, name)):
            assert np.allclose(got, want, rtol=1e-4, atol=1e-5), f"world {world} rank {r}: {np.abs(got - want).max()}"


def _reference_logits(cfg, sd, toks, mask=None, types=None):
    """The whole model in float64 from full tensors (tpcore names)."""
    P = {k: np.asarray(v, np.float64) for k, v in sd.items()}
    B, T = toks.shape
    h = P["wte.weight"][toks]
    if cfg.positions == "learned":
        h = h + P["wpe.weight"][np.arange(T)][None]
    if cfg.type_vocab_size:
        h = h + P["tte.weight"][np.zeros_like(toks) if types is None else types]
    if cfg.embedding_norm:
        h = ref.norm(cfg, h, P["emb_norm.weight"], P.get("emb_norm.bias"))
    for i in range(cfg.layers):
        blk = {k[len(f"blocks.{i}."):]: v for k, v in P.items() if k.startswith(f"blocks.{i}.")}
        h = ref.block(cfg, blk, h, key_mask=mask)
    if cfg.final_norm and cfg.pre_norm:
        h = ref.norm(cfg, h, P["final_norm.weight"], P.get("final_norm.bias"))
    if not cfg.causal:
        return h
    W = P["wte.weight"] if cfg.tie_embeddings else P["lm_head.weight"]
    return h @ W.T


def _against_reference(comm, name):
    cfg = tpcore.Config(**CFGS[name])
    model = tpcore.models.TransformerLM(cfg, comm, seed=5)
    toks = _tokens(cfg, seed=6)
    sd = model.state_dict_full()
    if name == "bert":
        mask = np.ones_like(toks)
        mask[0, 4:] = 0
        got = model.encode(toks, attention_mask=mask)
        want = _reference_logits(cfg, sd, toks, mask=mask)
        return float(np.abs(got - want).max() / (1 + np.abs(want).max()))
    got = model.logits(toks)
    want = _reference_logits(cfg, sd, toks)
    return float(np.abs(got - want).max() / (1 + np.abs(want).max()))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_model_against_float64_reference(world, name):
    for r, err in enumerate(run(_against_reference, world, name)):
        assert err < 1e-5, f"rank {r}: relative error {err}"


def _generate(comm, name, ragged):
    cfg = tpcore.Config(**CFGS[name])
    model = tpcore.models.TransformerLM(cfg, comm, seed=21)
    g = rng_for(4, 0)
    if ragged:
        prompts = [list(g.integers(0, cfg.vocab_size, n)) for n in (5, 2, 7)]
    else:
        prompts = g.integers(0, cfg.vocab_size, (2, 5))
    out = model.generate(prompts, max_new_tokens=6, temperature=0.0)
    # the same greedy tokens without the cache: recompute the whole sequence each step
    seqs = [list(p) for p in prompts]
    for _ in range(6):
        for s in seqs:
            s.append(int(model.logits(np.array([s]))[0, -1].argmax()))
    sampled = model.generate(prompts, max_new_tokens=4, temperature=0.8, top_k=5, seed=7)
    return [list(map(int, o)) for o in out], seqs, [list(map(int, o)) for o in sampled]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("ragged", [False, True], ids=["same-length", "ragged"])
def test_greedy_generation_same_at_every_world_size_and_equal_to_recompute(name, ragged):
    want, recomputed, sampled = run(_generate, 1, name, ragged)[0]
    assert want == recomputed
    for world in (2, 3, 4):
        for r, (got, _, samp) in enumerate(run(_generate, world, name, ragged)):
            assert got == want, f"world {world} rank {r}"
            assert samp == sampled, f"sampling with a seed: world {world} rank {r}"


def _train(comm, steps):
    cfg = tpcore.Config(vocab_size=16, hidden=32, layers=2, heads=4, ffn_hidden=64, positions="learned",
                        max_positions=16, activation="gelu_tanh")
    model = tpcore.models.TransformerLM(cfg, comm, seed=2)
    opt = tpcore.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        # copy task: the second half repeats the first; targets are the next tokens
        half = g.integers(1, 16, (8, 6))
        seq = np.concatenate([half, half], 1)
        toks, targets = seq[:, :-1], seq[:, 1:].copy()
        targets[:, :5] = -100  # only the copied half is scored
        model.zero_grad()
        losses.append(model.loss(toks, targets))
        model.backward()
        opt.step()
    return losses


def test_training_loss_falls_and_matches_across_world_sizes():
    one = run(_train, 1, 60)[0]
    two = run(_train, 2, 60)
    assert two[0] == two[1]
    assert np.allclose(one, two[0], rtol=2e-3, atol=2e-3), np.abs(np.array(one) - two[0]).max()
    assert np.mean(one[-5:]) < 0.6 * np.mean(one[:5]), (one[:5], one[-5:])


def _save(comm, path, name, sharded):
    cfg = tpcore.Config(**CFGS[name])
    model = tpcore.models.TransformerLM(cfg, comm, seed=8)
    model.save_pretrained(path, sharded=sharded)
    return model.logits(_tokens(cfg)) if cfg.causal else None


def _load(comm, path, name):
    cfg = tpcore.Config(**CFGS[name])
    model = tpcore.models.from_pretrained(path, comm, progress=False)
    return model.logits(_tokens(cfg))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_checkpoint_saved_at_four_loads_at_one_two_three(tmp_path, name):
    path = str(tmp_path / "ckpt")
    want = run(_save, 4, path, name, False)[0]
    for world in (1, 2, 3):
        for got in run(_load, world, path, name):
            assert np.allclose(got, want, rtol=1e-5, atol=1e-6)
    spath = str(tmp_path / "sharded")
    want = run(_save, 3, spath, name, True)[0]
    assert all(np.array_equal(got, want) for got in run(_load, 3, spath, name))
    with pytest.raises(Exception, match="another world size"):
        run(_load, 2, spath, name)


def _to_hf(cfg, sd, kind):
    """tpcore's full tensors under Hugging Face's names (GPT-2: Conv1D weights are (in, out), c_attn fused)."""
    out = {}
    if kind == "gpt2":
        out["transformer.wte.weight"], out["transformer.wpe.weight"] = sd["wte.weight"], sd["wpe.weight"]
        out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd["final_norm.weight"], sd["final_norm.bias"]
        for i in range(cfg.layers):
            p, q = f"transformer.h.{i}.", f"blocks.{i}."
            out[p + "ln_1.weight"], out[p + "ln_1.bias"] = sd[q + "norm1.weight"], sd[q + "norm1.bias"]
            out[p + "ln_2.weight"], out[p + "ln_2.bias"] = sd[q + "norm2.weight"], sd[q + "norm2.bias"]
            out[p + "attn.c_attn.weight"] = np.concatenate([sd[q + f"attn.{n}.weight"] for n in "qkv"]).T.copy()
            out[p + "attn.c_attn.bias"] = np.concatenate([sd[q + f"attn.{n}.bias"] for n in "qkv"])
            out[p + "attn.c_proj.weight"] = sd[q + "attn.out.weight"].T.copy()
            out[p + "attn.c_proj.bias"] = sd[q + "attn.out.bias"]
            out[p + "mlp.c_fc.weight"] = sd[q + "mlp.fc1.weight"].T.copy()
            out[p + "mlp.c_fc.bias"] = sd[q + "mlp.fc1.bias"]
            out[p + "mlp.c_proj.weight"] = sd[q + "mlp.fc2.weight"].T.copy()
            out[p + "mlp.c_proj.bias"] = sd[q + "mlp.fc2.bias"]
            out[p + "attn.bias"] = np.tril(np.ones((cfg.max_positions, cfg.max_positions), np.float32))  # a buffer
        hf_cfg = {"model_type": "gpt2", "vocab_size": cfg.vocab_size, "n_embd": cfg.hidden, "n_layer": cfg.layers,
                  "n_head": cfg.heads, "n_positions": cfg.max_positions, "n_inner": cfg.ffn_hidden,
                  "activation_function": "gelu_new", "layer_norm_epsilon": cfg.eps}
    else:
        out["model.embed_tokens.weight"], out["model.norm.weight"] = sd["wte.weight"], sd["final_norm.weight"]
        out["lm_head.weight"] = sd["lm_head.weight"]
        F = cfg.ffn_hidden
        for i in range(cfg.layers):
            p, q = f"model.layers.{i}.", f"blocks.{i}."
            out[p + "input_layernorm.weight"] = sd[q + "norm1.weight"]
            out[p + "post_attention_layernorm.weight"] = sd[q + "norm2.weight"]
            for n in "qkv":
                out[p + f"self_attn.{n}_proj.weight"] = sd[q + f"attn.{n}.weight"]
            out[p + "self_attn.o_proj.weight"] = sd[q + "attn.out.weight"]
            out[p + "mlp.gate_proj.weight"] = sd[q + "mlp.fc1.weight"][:F].copy()
            out[p + "mlp.up_proj.weight"] = sd[q + "mlp.fc1.weight"][F:].copy()
            out[p + "mlp.down_proj.weight"] = sd[q + "mlp.fc2.weight"]
        hf_cfg = {"model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden,
                  "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
                  "num_key_value_heads": cfg.kv_heads, "intermediate_size": cfg.ffn_hidden,
                  "rms_norm_eps": cfg.eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_positions,
                  "hidden_act": "silu", "tie_word_embeddings": False}
    return out, hf_cfg


def _hf_source(comm, path, name):
    cfg = tpcore.Config(**CFGS[name])
    model = tpcore.models.TransformerLM(cfg, comm, seed=13)
    tensors, hf_cfg = _to_hf(cfg, model.state_dict_full(), name)
    os.makedirs(path, exist_ok=True)
    # two files, like sharded Hugging Face checkpoints
    names = sorted(tensors)
    write_safetensors(os.path.join(path, "model-00001-of-00002.safetensors"), {k: tensors[k] for k in names[::2]})
    write_safetensors(os.path.join(path, "model-00002-of-00002.safetensors"), {k: tensors[k] for k in names[1::2]})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f)
    return model.logits(_tokens(cfg))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_named_checkpoint_loads_at_every_world_size(tmp_path, name):
    path = str(tmp_path / name)
    want = run(_hf_source, 1, path, name)[0]
    for world in WORLD_SIZES:
        for r, got in enumerate(run(_load, world, path, name)):
            assert np.allclose(got, want, rtol=1e-5, atol=1e-6), f"world {world} rank {r}"


def _rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _load_memory(comm, path):
    import gc
    cfg = tpcore.Config.from_hf(path)
    model = tpcore.models.TransformerLM(cfg, comm)   # the shard's own memory, before loading
    gc.collect()
    before = _rss_kib()
    from tpcore.models import hf
    model.load_state_dict_full(hf.gpt2_names(hf._open(path), cfg))
    gc.collect()
    after = _rss_kib()
    return (after - before) * 1024, model.param_bytes()


def test_loading_reads_about_a_shard(tmp_path):
    """A 4-way split loads a ~36 MB GPT-2 checkpoint growing each rank's resident memory by
    well under the file's size (only the rank's slices are read and kept)."""
    cfg = tpcore.Config(vocab_size=20000, hidden=256, layers=4, heads=8, ffn_hidden=1024, max_positions=64)
    path = str(tmp_path / "big")

    def make(comm):
        model = tpcore.models.TransformerLM(cfg, comm, seed=1)
        tensors, hf_cfg = _to_hf(cfg, model.state_dict_full(), "gpt2")
        os.makedirs(path, exist_ok=True)
        write_safetensors(os.path.join(path, "model.safetensors"), tensors)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf_cfg, f)
        return os.path.getsize(os.path.join(path, "model.safetensors"))

    size = run(make, 1)[0]
    for r, (grown, shard) in enumerate(run(_load_memory, 4, path)):
        assert grown < 0.5 * size, f"rank {r}: resident memory grew {grown / 1e6:.1f} MB for a {size / 1e6:.1f} MB file"
        assert shard < 0.35 * size


def _bad(comm):
    errs = []
    for call, etype, word in (
            (lambda: tpcore.Config(hidden=24, heads=6, kv_heads=4), ValueError, "multiple of kv_heads"),
            (lambda: tpcore.Config(hidden=25, heads=6), ValueError, "head_dim"),
            (lambda: tpcore.Config(norm="batchnorm"), ValueError, "norm"),
            (lambda: tpcore.models.TransformerLM(tpcore.Config(**GPT2), comm).generate([[1, 2]], max_new_tokens=40),
             ValueError, "max_positions"),
            (lambda: tpcore.models.TransformerLM(tpcore.Config(**GPT2), comm).logits(np.array([[1, 200]])),
             ValueError, "out of range"),
            (lambda: tpcore.models.TransformerLM(tpcore.Config(**GPT2), comm).logits(np.zeros((2, 40), np.int64)),
             ValueError, "max_positions"),
            (lambda: tpcore.models.TransformerLM(tpcore.Config(**BERT), comm).generate([[1, 2]]), ValueError, "causal"),
            (lambda: tpcore.TransformerBlock(tpcore.Config(**GPT2), comm, head_partition=[7] + [0] * (comm.size - 1)),
             ValueError, "partition")):
        try:
            call()
            errs.append(f"no error ({word})")
        except etype as e:
            if word not in str(e):
                errs.append(f"{etype.__name__} without {word!r}: {e}")
    return errs


@pytest.mark.parametrize("world", [1, 2])
def test_bad_configs_and_inputs(world):
    for r, errs in enumerate(run(_bad, world)):
        assert not errs, f"rank {r}: {errs}"


def _mismatched(comm, path):
    cfg = tpcore.Config(**dict(GPT2, hidden=30, heads=5, ffn_hidden=40))
    model = tpcore.models.TransformerLM(cfg, comm)
    from tpcore.models import hf
    try:
        model.load_state_dict_full(hf.gpt2_names(hf._open(path), cfg))
    except ValueError as e:
        return str(e)
    return "no error"


def test_mismatched_checkpoint_shapes(tmp_path):
    path = str(tmp_path / "gpt2")
    run(_hf_source, 1, path, "gpt2")
    for msg in run(_mismatched, 2, path):
        assert "shape" in msg, msg


def test_config_from_hf_dicts():
    g = tpcore.Config.from_hf_dict({"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12,
                                    "n_head": 12, "n_positions": 1024, "activation_function": "gelu_new"})
    assert (g.positions, g.norm, g.activation, g.ffn_hidden, g.tie_embeddings) == ("learned", "layernorm",
                                                                                  "gelu_tanh", 3072, True)
    ll = tpcore.Config.from_hf_dict({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
                                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                     "intermediate_size": 11008, "rms_norm_eps": 1e-5, "rope_theta": 500000.0})
    assert (ll.kv_heads, ll.activation, ll.positions, ll.norm, ll.bias, ll.head_dim) == (8, "swiglu", "rope",
                                                                                        "rmsnorm", False, 128)
    b = tpcore.Config.from_hf_dict({"model_type": "bert", "vocab_size": 30522, "hidden_size": 768,
                                    "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                                    "type_vocab_size": 2, "hidden_act": "gelu"})
    assert (b.causal, b.pre_norm, b.embedding_norm, b.final_norm) == (False, False, True, False)
    with pytest.raises(ValueError, match="not supported"):
        tpcore.Config.from_hf_dict({"model_type": "t5"})


def test_lazy_views_index_like_numpy():
    from tpcore.models.hf import View, _Stack
    base = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    keys = [slice(None), slice(1, 3), slice(1, 10), slice(-2, None), slice(None, -1), -1, 2, np.array([3, 0, 2]),
            np.array([True, False, True, False]), (slice(None), slice(1, 3)), (2, 3), (np.array([1, 2]), 0), Ellipsis]
    for view, full in ((View(base, 4, 4, transpose=True), base[:, 4:8].T), (View(base, 2, 4), base[2:6])):
        for k in keys:
            assert np.array_equal(view[k], full[k]), (k, view[k], full[k])
    a, b = base[:3], base[3:]
    st, full = _Stack(a, b), base
    for k in keys[:8] + [np.array([4, 1, 5]), (slice(None), slice(1, 3)), (-1, 2)]:
        assert np.array_equal(st[k], full[k]), k


def _stops(comm):
    cfg = tpcore.Config(**GPT2)
    model = tpcore.models.TransformerLM(cfg, comm, seed=21)
    prompt = [3, 1, 4, 1, 5]
    free = model.generate(prompt, max_new_tokens=6, eos_token_id=-1)[0]  # a flat list is one prompt
    stop = int(free[len(prompt) + 1])
    # several eos ids (Llama 3 Instruct has three), one outside the vocabulary: any stops the sequence
    got = model.generate([prompt], max_new_tokens=6, eos_token_id=[10 ** 6, stop], pad_token_id=0)[0]
    return free.tolist(), got.tolist(), stop


def test_generate_stops_on_any_eos_id():
    free, got, stop = run(_stops, 2)[0]
    first = free.index(stop, 5)
    assert got[:first + 1] == free[:first + 1] and all(t == 0 for t in got[first + 1:]), (free, got)


def _bad_backward(comm):
    cfg = tpcore.Config(**GPT2)
    blk = tpcore.TransformerBlock(cfg, comm)
    blk(rng_for(1, 0).standard_normal((2, 5, cfg.hidden)).astype(np.float32))
    try:
        blk.backward(np.ones((1, 1, cfg.hidden), np.float32))
    except ValueError as e:
        return str(e)
    return "no error"


def test_block_backward_checks_rows():
    for msg in run(_bad_backward, 2):
        assert "(1, 1, 24)" in msg and "(2, 5, 24)" in msg, msg


def test_sliding_window_and_explicit_default_rope():
    """A Mistral config with an explicit default rope loads; its window is kept (the attention
    itself is checked against transformers in test_sliding_window.py); an unknown rope type is
    refused by name."""
    base = {"model_type": "mistral", "vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 24, "sliding_window": 6,
            "rope_scaling": {"rope_type": "default"}}
    cfg = tpcore.Config.from_hf_dict(base)
    assert cfg.sliding_window == 6 and cfg.positions == "rope" and cfg.rope_scaling in (None, {})

    def case(comm):
        model = tpcore.models.TransformerLM(cfg, comm)
        return [b.sliding_window for b in model.blocks], model.logits(np.arange(9).reshape(1, 9)).shape

    assert run(case, 1)[0] == ([6], (1, 9, 50))
    with pytest.raises(ValueError, match="mrope"):
        tpcore.Config.from_hf_dict(dict(base, rope_scaling={"rope_type": "mrope", "factor": 8.0}))


BAD_LOGITS = {"nan": (np.nan, "hold NaN"), "+inf": (np.inf, "hold +inf"), "-inf": (-np.inf, "are all -inf")}


def _spoil(logits, row, kind, g):
    """logits (n, V) with row spoiled: a NaN or +inf at random places among finite values, or every
    logit -inf; the other rows keep some -inf (masked tokens: still fine)."""
    out = np.array(logits, np.float32)
    V = out.shape[1]
    for r in range(len(out)):
        if r != row:
            out[r, g.choice(V, V // 3, replace=False)] = -np.inf
    value, _ = BAD_LOGITS[kind]
    if kind == "-inf":
        out[row] = -np.inf
    else:
        out[row, g.choice(V, int(g.integers(1, 4)), replace=False)] = value
    return out


@pytest.mark.parametrize("kind", list(BAD_LOGITS))
def test_sample_refuses_logits_no_token_can_be_drawn_from(kind):
    """Greedy, sampling and top-k alike: a row holding NaN or +inf, or all -inf, is a ValueError
    naming the row and the step instead of a token (NumPy's argmax picks the first NaN, the
    softmax gives NaN probabilities); rows with some -inf are fine and never pick those."""
    from tpcore.models.generate import sample
    seed = int(np.random.default_rng().integers(2 ** 31))
    g = np.random.default_rng(seed)
    n, V = int(g.integers(2, 6)), int(g.integers(5, 60))
    row, step = int(g.integers(n)), int(g.integers(0, 50))
    bad = _spoil(g.standard_normal((n, V)) * 5, row, kind, g)
    for temperature, top_k in ((0.0, 0), (1.0, 0), (0.7, 3)):
        with pytest.raises(ValueError) as e:
            sample(bad, temperature, top_k, np.random.default_rng(seed), "generate", step)
        want = f"generate: the logits of sequence {row} at step {step} {BAD_LOGITS[kind][1]}"
        assert want in str(e.value) and "NaN/Inf" in str(e.value), (seed, str(e.value))
        good = np.delete(bad, row, axis=0)
        tok = sample(good, temperature, top_k, np.random.default_rng(seed), "generate", step)
        assert np.isfinite(good[np.arange(len(good)), tok]).all(), (seed, temperature, tok)


def _nan_generate(comm, seed, kind):
    """generate with NaN weights (every sequence, step 0), then with one sequence's logits spoiled
    at a later step (the gathered logits, as a model gone bad mid-way gives them): a ValueError
    naming the sequence and the step on every rank, greedy and sampling alike."""
    cfg = tpcore.Config(**LLAMA)
    model = tpcore.models.TransformerLM(cfg, comm, seed=seed % 1000)
    g = rng_for(seed, 0)
    prompts = [g.integers(0, cfg.vocab_size, int(n)).tolist() for n in g.integers(1, 6, 3)]
    out = []
    row, step = int(g.integers(3)), int(g.integers(1, 5))
    real = model.gather_logits
    calls = []

    def spoiled(shard):
        logits = real(shard)
        calls.append(1)
        return _spoil(logits, row, kind, rng_for(seed, len(calls))) if len(calls) == step + 1 else logits

    for temperature in (0.0, 1.0):
        calls.clear()
        model.gather_logits = spoiled
        try:
            model.generate(prompts, max_new_tokens=6, temperature=temperature, seed=seed)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
        model.gather_logits = real
    w = model.blocks[0].named_parameters()["norm1.weight"][0]
    w[int(g.integers(w.size))] = np.nan  # (replicated: the same on every rank)
    for temperature in (0.0, 1.0):
        try:
            model.generate(prompts, max_new_tokens=6, temperature=temperature, seed=seed)
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out, row, step


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind", list(BAD_LOGITS))
def test_generate_refuses_nan_logits_on_every_rank(world, kind):
    seed = int(np.random.default_rng().integers(2 ** 31))
    for r, (msgs, row, step) in enumerate(run(_nan_generate, world, seed, kind)):
        for m in msgs[:2]:
            assert f"generate: the logits of sequence {row} at step {step} {BAD_LOGITS[kind][1]}" in m, (r, seed, m)
        for m in msgs[2:]:
            assert "generate: the logits of sequence 0 at step 0 hold NaN" in m, (r, seed, m)
