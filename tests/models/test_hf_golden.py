"""Golden references from an implementation nobody here wrote: tiny random GPT-2,
Llama (grouped-query attention) and BERT checkpoints written by Hugging Face
transformers (tests/fixtures/make_hf_fixtures.py, run by hand) with
transformers' own logits, greedy generations and hidden states.  tpcore loads
them with each rank reading its slices and must agree at world sizes 1-4."""
import os

import numpy as np
import pytest

import tpcore
from conftest import WORLDS, run
import paths

FIX = str(paths.FIXTURES)


def _decoder(comm, name):
    path = os.path.join(FIX, name)
    exp = np.load(os.path.join(path, "expected.npz"))
    model = tpcore.models.from_pretrained(path, comm, progress=False)
    logits = model.logits(exp["input_ids"])
    new = exp["generated"].shape[1] - exp["input_ids"].shape[1]
    gen = model.generate(exp["input_ids"], max_new_tokens=new, pad_token_id=0)  # as make_hf_fixtures.py
    return float(np.abs(logits - exp["logits"]).max()), float(np.abs(exp["logits"]).max()), \
        bool(np.array_equal(gen, exp["generated"]))


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_decoder_matches_transformers(world, name):
    for r, (err, scale, same_tokens) in enumerate(run(_decoder, world, name)):
        assert err <= 2e-5 * (1 + scale), f"rank {r}: logits off by {err} (max |logit| {scale})"
        assert same_tokens, f"rank {r}: greedy generation differs from transformers'"


def _bert(comm):
    path = os.path.join(FIX, "bert")
    exp = np.load(os.path.join(path, "expected.npz"))
    model = tpcore.models.from_pretrained(path, comm, progress=False)
    h = model.encode(exp["input_ids"], attention_mask=exp["attention_mask"], token_type_ids=exp["token_type_ids"])
    return float(np.abs(h - exp["last_hidden_state"]).max())


@pytest.mark.parametrize("world", WORLDS)
def test_bert_matches_transformers(world):
    for r, err in enumerate(run(_bert, world)):
        assert err < 1e-4, f"rank {r}: last_hidden_state off by {err}"


def _resave(comm, name, out):
    model = tpcore.models.from_pretrained(os.path.join(FIX, name), comm, progress=False)
    model.save_pretrained(out, hf=True)
    return model.config


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_saved_in_hugging_face_layout_equals_the_original_file(tmp_path, name):
    """Loaded at 3 ranks and saved with hf=True: the same tensor names, shapes and values as
    the file transformers wrote, and a config.json that reads back to the same Config."""
    from tpcore.io.formats import read_safetensors
    out = str(tmp_path / name)
    cfg = run(_resave, 3, name, out)[0]
    orig, _ = read_safetensors(os.path.join(FIX, name, "model.safetensors"))
    new, _ = read_safetensors(os.path.join(out, "model.safetensors"))
    assert sorted(new) == sorted(orig)
    for k in orig:
        assert np.array_equal(np.asarray(new[k]), np.asarray(orig[k])), k
    assert tpcore.Config.from_hf(out) == cfg
