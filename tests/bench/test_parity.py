"""python -m tpcore.bench parity: perplexity, KL against one rank and transformers, greedy agreement.

The references are transformers' own: the test computes the perplexity from transformers' logits
of the same checkpoint (its own windows, its own float64 log-softmax), never from tpcore's.  A
checkpoint with one weight changed, loaded at world 2 only, shows that the KL columns see a
difference when there is one."""
import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest

import paths
import tpcore
from tpcore.bench import parity
from tpcore.bench.__main__ import main

FIXTURE = os.path.join(str(paths.FIXTURES), "llama")
TEXT = ("Tensor parallel ranks must agree. Cada rango calcula su parte; the all-reduce adds them up. "
        "Greedy tokens and perplexity show it to the user, window after window of the context.") * 2


def _tokenizer_json(path):
    """A small byte-level BPE tokenizer trained on TEXT, its ids < the fixture's vocabulary (128)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=120, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60]))
    tok.save(os.path.join(path, "tokenizer.json"))
    return tok


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The repo's tiny HF Llama (GQA 4/2, context 64), with a tokenizer.json beside it."""
    pytest.importorskip("tokenizers")
    d = tmp_path_factory.mktemp("parity") / "llama"
    shutil.copytree(FIXTURE, d)
    tok = _tokenizer_json(str(d))
    ids = np.asarray(tok.encode(TEXT).ids, np.int64)
    assert 64 < ids.size and ids.max() < 128  # more than one window of the context
    (d.parent / "text.txt").write_text(TEXT, encoding="utf-8")
    return {"dir": str(d), "ids": ids, "text": str(d.parent / "text.txt")}


@pytest.fixture(scope="module")
def cli_run(ckpt):
    pytest.importorskip("transformers")
    out = os.path.join(os.path.dirname(ckpt["dir"]), "parity.json")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # `python -m tpcore.bench parity ...` in this process
        code = main(["parity", "--checkpoint", ckpt["dir"], "--worlds", "1,2,3", "--text", ckpt["text"], "--new",
                     "10", "--json", out, "--no-progress"])
    assert code == 0, printed.getvalue()[-3000:]
    with open(out) as f:
        return printed.getvalue(), json.load(f)


def _hf_nll(path, ids, window):
    """transformers' logits of ids, window by window, and float64 -log p of each next token."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = np.concatenate([model(torch.from_numpy(ids[None, s:s + window])).logits[0].numpy()
                                 for s in range(0, ids.size, window)]).astype(np.float64)
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return lse[:-1] - logits[np.arange(ids.size - 1), ids[1:]]


def test_the_table_and_the_json(cli_run, ckpt):
    out, data = cli_run
    lines = out.splitlines()
    head = next(line for line in lines if line.lstrip().startswith("world"))
    for col in ("ppl", "KL mean vs 1", "KL max vs 1", "agree vs 1", "diverges vs 1", "KL mean vs HF", "agree vs HF",
                "ms/token"):
        assert col in head
    rows = [line.split() for line in lines[lines.index(head) + 1:] if line.strip() and not line.startswith("#")]
    assert [r[0] for r in rows] == ["1", "2", "3", "HF"]
    assert f"{ckpt['ids'].size} tokens" in out and "through tokenizer.json" in out
    assert data["tokens"] == ckpt["ids"].size and data["window"] == 64 and data["windows"] == -(-ckpt["ids"].size // 64)
    assert [r["world"] for r in data["worlds"]] == [1, 2, 3]
    for r in data["worlds"]:
        for key in ("ppl", "kl_mean_world1", "kl_max_world1", "agree_world1", "diverges_at_world1", "ms_per_token",
                    "kl_mean_transformers", "kl_max_transformers", "agree_transformers", "diverges_at_transformers"):
            assert key in r, key
        assert len(r["greedy"]) == 10 and r["same_greedy_across_ranks"]
    assert data["transformers"]["ppl"] > 0 and len(data["kl_per_position"]["world2_vs_world1"]) == data["tokens"] - 1


def test_every_world_equals_one_rank_and_transformers(cli_run, ckpt):
    _, data = cli_run
    hf_ppl = float(np.exp(_hf_nll(ckpt["dir"], ckpt["ids"], 64).mean()))
    assert data["transformers"]["ppl"] == pytest.approx(hf_ppl, rel=1e-6)
    for r in data["worlds"]:
        assert r["ppl"] == pytest.approx(hf_ppl, rel=1e-4)
        assert 0.0 <= r["kl_mean_world1"] <= r["kl_max_world1"] < 1e-6
        assert r["agree_world1"] == 1.0 and r["diverges_at_world1"] is None
        assert r["kl_max_transformers"] < 1e-6 and r["agree_transformers"] == 1.0
        assert r["diverges_at_transformers"] is None
        assert r["greedy"] == data["transformers"]["greedy"]
    assert data["worlds"][0]["kl_max_world1"] == 0.0  # world 1 against itself: the same logits


def _perturbed_at_world_2(good, bad):
    real = tpcore.models.from_pretrained

    def load(path, comm, **kw):  # runs in the forked ranks: world 2 loads the changed weights
        return real(bad if comm.size == 2 else path, comm, **kw)
    return load


def test_a_changed_weight_shows_in_the_kl(ckpt, tmp_path, monkeypatch):
    from safetensors.numpy import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(ckpt["dir"], bad)
    sd = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    sd[name] = sd[name].copy()
    sd[name][3, 5] += 2.0
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setattr(tpcore.models, "from_pretrained", _perturbed_at_world_2(ckpt["dir"], str(bad)))
    data = parity.run(ckpt["dir"], [1, 2], ckpt["ids"], 64, prompt=8, new=12, with_transformers=False)
    data["token_source"] = "test"
    one, two = data["worlds"]
    assert one["kl_max_world1"] == 0.0
    assert two["kl_mean_world1"] > 1e-4 and two["kl_max_world1"] > two["kl_mean_world1"]
    assert abs(two["ppl"] - one["ppl"]) > 1e-4 * one["ppl"]
    # the same numbers from the changed file's own transformers logits: KL is what was measured
    hf_ppl = float(np.exp(_hf_nll(str(bad), ckpt["ids"], 64).mean()))
    assert two["ppl"] == pytest.approx(hf_ppl, rel=1e-4)
    row = [line for line in parity.table(data).splitlines() if line.split()[0] == "2"][0]
    assert f"{two['kl_mean_world1']:.2e}" in row and "0.00e+00" not in row


def test_perplexity_and_kl_from_known_logits():
    ids = np.array([0, 1, 2, 0])
    lg = np.log(np.array([[0.5, 0.25, 0.25], [0.2, 0.6, 0.2], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]))
    # next tokens 1, 2, 0: p = 0.25, 0.2, 0.1
    assert parity.perplexity(lg, ids) == pytest.approx((0.25 * 0.2 * 0.1) ** (-1 / 3), rel=1e-12)
    other = lg.copy()
    other[1] = np.log([0.6, 0.2, 0.2])
    c = parity.compare(lg, other)
    kl1 = 0.2 * np.log(0.2 / 0.6) + 0.6 * np.log(0.6 / 0.2) + 0.2 * np.log(1.0)
    assert c["kl_max"] == pytest.approx(kl1, rel=1e-12) and c["kl_mean"] == pytest.approx(kl1 / 3, rel=1e-12)
    assert c["agree"] == pytest.approx(2 / 3) and c["kl_argmax"] == 1
    assert parity.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert parity.first_divergence([1, 2, 3], [1, 5, 3]) == 1


@pytest.mark.parametrize("args, words", [
    (["--worlds", "0,2"], "--worlds must be a comma list of positive integers, got '0,2'"),
    (["--worlds", "1,x"], "--worlds must be a comma list of positive integers"),
    (["--checkpoint", "/nonexistent/ckpt"], "--checkpoint '/nonexistent/ckpt': no such file or folder"),
    (["NO-CHECKPOINT"], "--checkpoint is required"),
    (["--text", "EMPTY"], "the text is empty"),
    (["--text", "/nonexistent/text.txt"], "No such file"),
    (["--tokens", "1,2,999"], "ids must be in [0, 128) (the vocabulary), got 999"),
    (["--tokens", "5"], "the text has 1 token(s); at least 2 are needed"),
    (["--tokens", "1,2", "--text", "EMPTY"], "give --text or --tokens, not both"),
    (["--max-tokens", "many"], "argument --max-tokens: invalid int value: 'many'"),
    (["--checkpoint", os.path.join(str(paths.FIXTURES), "bert")], "a bert encoder (bidirectional) has no next-token"),
    (["--window", "65"], "--window must be in [1, 64] (the model's context), got 65"),
])
def test_bad_arguments_exit_2_with_one_line(args, words, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    argv = ["parity", "--no-transformers"]
    if "--checkpoint" not in args and "NO-CHECKPOINT" not in args:
        argv += ["--checkpoint", FIXTURE]
    argv += [str(empty) if a == "EMPTY" else a for a in args if a != "NO-CHECKPOINT"]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("parity: ") and words in err, err
    assert "Traceback" not in err


def test_gpt2_tied_head_and_learned_positions_equal_transformers():
    """The GPT-2 fixture (tied embeddings, learned positions, context 64) at worlds 1 and 2, in
    this process: transformers compared by run() itself, and by the test's own perplexity."""
    pytest.importorskip("transformers")
    path = os.path.join(str(paths.FIXTURES), "gpt2")
    ids = np.frombuffer(TEXT.encode("utf-8"), np.uint8).astype(np.int64) % 128
    data = parity.run(path, [2], ids, 50, prompt=5, new=9)
    assert [r["world"] for r in data["worlds"]] == [1, 2] and data["windows"] == -(-ids.size // 50)
    hf_ppl = float(np.exp(_hf_nll(path, ids, 50).mean()))
    for r in data["worlds"]:
        assert r["ppl"] == pytest.approx(hf_ppl, rel=1e-4)
        assert r["kl_max_world1"] < 1e-6 and r["kl_max_transformers"] < 1e-6
        assert r["agree_world1"] == r["agree_transformers"] == 1.0
        assert r["diverges_at_transformers"] is None and len(r["greedy"]) == 9


def test_a_gguf_file_without_merges_falls_back_to_bytes_and_equals_float64(tmp_path):
    """A small Llama GGUF written by the gguf package (tests/models/test_gguf.py's writer; its
    vocabulary has no merges, so no tokenizer: the bytes fallback, labelled), at worlds 1 and 2;
    the perplexity equals a float64 NumPy model's of the same weights (reference_transformer)."""
    import importlib.util
    from tpcore.models import gguf as tg
    spec = importlib.util.spec_from_file_location("_parity_gguf_writers",
                                                  os.path.join(str(paths.TESTS), "models", "test_gguf.py"))
    writers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writers)
    path = str(tmp_path / "tiny.gguf")
    sd = writers.write_llama(path, seed=3)
    cfg = tg.read_gguf(path)[0]
    ids, label = parity.text_tokens(path, cfg.vocab_size, TEXT)
    assert "UTF-8 bytes modulo" in label and "tokenizer.ggml.merges" in label
    ids = ids[:80]
    W = cfg.max_positions
    assert ids.size > 2 * W
    data = parity.run(path, [1, 2], ids, W, prompt=6, new=8, with_transformers=False)
    ref = np.concatenate([writers.reference_logits(cfg, sd, ids[None, s:s + W])[0] for s in range(0, ids.size, W)])
    lse = np.log(np.exp(ref - ref.max(-1, keepdims=True)).sum(-1)) + ref.max(-1)
    ref_ppl = float(np.exp((lse[:-1] - ref[np.arange(ids.size - 1), ids[1:]]).mean()))
    for r in data["worlds"]:
        assert r["ppl"] == pytest.approx(ref_ppl, rel=1e-4)
        assert r["kl_max_world1"] < 1e-6 and r["agree_world1"] == 1.0 and r["diverges_at_world1"] is None
