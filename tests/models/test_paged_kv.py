"""The paged KV cache end to end (TransformerLM.cache_paged, forward's block_table): tiny random
Llama and Mistral (sliding window 5) checkpoints built and saved by transformers, read by
tpcore.models.from_pretrained at worlds 1 and 2, prefilled in chunks (pos0 > 0, a chunk longer
than the window) and decoded greedily through a pool whose blocks are a random permutation,
each row's table growing as its sequence does (entries past it -1), beside a padding row of -1
only: every logit within 1e-4 relative of transformers' own forward over the whole sequence,
the same greedy tokens, at block sizes 1, 4 (not dividing the lengths) and 16.  Then the bad
arguments, each a clear error."""
import math

import numpy as np
import pytest

import tpcore
from conftest import run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, P, STEPS = 97, 13, 5          # vocabulary, prompt length, decode steps
CHUNKS = (5, 1, 7)               # the prompt's prefill chunks (7 > the window of 5)
SIZES = (1, 4, 16)               # block sizes
_BUILT = {}


def _config(name):
    T = transformers
    base = dict(vocab_size=V, max_position_embeddings=64, hidden_size=48, intermediate_size=37,
                num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, pad_token_id=None,
                bos_token_id=None, eos_token_id=None)
    if name == "llama":
        return T.LlamaConfig(**base, attention_bias=True)
    return T.MistralConfig(**base, sliding_window=5)


def _built(name, tmp_path_factory):
    """(folder, transformers' greedy sequence (2, P + STEPS + 1), its logits over it) of a family."""
    if name not in _BUILT:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(name), attn_implementation="eager").eval()
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                torch.nn.init.normal_(p, mean=1.0 if (p.ndim == 1 and "norm" in pname) else 0.0, std=0.2,
                                      generator=g)
        path = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(path)
        seq = np.random.default_rng(3).integers(0, V, (2, P))
        with torch.no_grad():
            for _ in range(STEPS + 1):
                nxt = model(torch.tensor(seq)).logits[:, -1].argmax(-1).numpy()
                seq = np.concatenate([seq, nxt[:, None]], 1)
            logits = model(torch.tensor(seq)).logits.double().numpy()
        _BUILT[name] = (path, seq, logits)
    return _BUILT[name]


def _paged_run(model, prompts, bs, seed):
    """Chunked prefill + greedy decode through a paged pool: (tokens (B, P + STEPS + 1), logits
    (B, P + STEPS, V)) of the B real rows (a padding row rides along)."""
    B = prompts.shape[0]
    L = P + STEPS + 1
    need = math.ceil(L / bs)
    cols = need + 1                                   # a column past every sequence: -1
    blocks = B * need + 3
    model.cache_paged(blocks, bs)
    full = np.random.default_rng(seed).permutation(blocks)[:B * need].reshape(B, need)

    def step(toks, pos0):
        T = toks.shape[1]
        table = -np.ones((B + 1, cols), np.int64)     # the row's blocks so far (the engine's growth)
        for c in range(need):
            if c * bs < pos0 + T:
                table[:B, c] = full[:, c]
        x = np.concatenate([toks, np.zeros((1, T), np.int64)])       # row B: padding, all -1
        h = model._forward(x, pos0=np.array([pos0] * B + [0], np.int64), use_cache=True, block_table=table)
        C = model.config.hidden
        lg = model.gather_logits(model.logits_shard(np.ascontiguousarray(np.asarray(h).reshape(-1, C))))
        return lg.reshape(B + 1, T, -1)[:B]

    outs, pos = [], 0
    for n in CHUNKS:
        outs.append(step(prompts[:, pos:pos + n], pos))
        pos += n
    seq = prompts.copy()
    for _ in range(STEPS + 1):
        nxt = outs[-1][:, -1].argmax(-1)
        seq = np.concatenate([seq, nxt[:, None]], 1)
        if seq.shape[1] < L:
            outs.append(step(nxt[:, None], seq.shape[1] - 1))
    return seq, np.concatenate(outs, axis=1)


def _ranks(comm, cases):
    out = []
    for path, prompts in cases:
        model = tpcore.models.from_pretrained(path, comm, progress=False)
        out.append([_paged_run(model, prompts, bs, seed=bs) for bs in SIZES])
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_paged_prefill_in_chunks_and_decode_match_transformers(world, tmp_path_factory):
    names = ("llama", "mistral")
    built = [_built(n, tmp_path_factory) for n in names]
    got = run(_ranks, world, [(path, seq[:, :P]) for path, seq, _ in built])
    for r, per_rank in enumerate(got):
        for name, (_, seq, logits), per_size in zip(names, built, per_rank):
            for bs, (toks, lg) in zip(SIZES, per_size):
                what = f"{name}, world {world}, rank {r}, block size {bs}"
                assert np.array_equal(toks, seq), f"{what}: greedy tokens differ"
                want = logits[:, :P + STEPS]
                err = float(np.abs(lg - want).max())
                assert err <= 1e-4 * float(np.abs(want).max()), f"{what}: logits off by {err}"


def _memory(comm, path):
    model = tpcore.models.from_pretrained(path, comm, progress=False)
    model.cache_paged(7, 3)
    before = model.memory()
    model._forward(np.zeros((1, 4), np.int64), pos0=np.zeros(1, np.int64), use_cache=True,
                   block_table=np.array([[5, 2, -1]]))
    est = tpcore.models.estimate_memory(model.config, 1, kv_blocks=(7, 3), max_len=4)[0]
    return before, model.memory(), [b._c.info["cache_block_size"] for b in model.blocks], est


def test_paged_memory_counts_the_pool(tmp_path_factory):
    path = _built("llama", tmp_path_factory)[0]
    before, after, sizes, est = run(_memory, 1, path)[0]
    per_row = 2 * 2 * 2 * 8 * 4                      # K and V, 2 layers, 2 KV heads of 8, float32
    assert before["kv_cache"] == 7 * 3 * per_row and before["kv_cache_used"] == 0
    assert est["kv_cache"] == before["kv_cache"] and est["kv_cache_used"] == 4 * per_row
    assert after["kv_cache_used"] == 4 * per_row     # 4 positions written: rows 0-2 of block 5, row 0 of block 2
    assert sizes == [3, 3]


BAD = [  # (change to a good forward's arguments, the error's type, words of its message)
    (dict(block_table=np.array([[0, 1]], np.float64)), TypeError, "block_table must be integers"),
    (dict(block_table=np.array([0, 1])), ValueError, "shape (B, cols) = (1, cols >= 1)"),
    (dict(block_table=np.zeros((2, 2), np.int64)), ValueError, "shape (B, cols) = (1, cols >= 1)"),
    (dict(block_table=np.array([[0, 8]])), ValueError, "block_table[0, 1] = 8 is outside the paged KV cache's 8"),
    (dict(block_table=np.array([[0]])), ValueError, "row 0 reaches position 6 (pos0 + T)"),
    (dict(block_table=None), ValueError, "use_cache=True needs block_table"),
    (dict(use_cache=False), ValueError, "it needs use_cache=True"),
    (dict(block_table=np.array([[3, 3]])), ValueError, "two tokens of the batch would write row 0 of KV block 3"),
]


def _bad(comm, path):
    """Each bad call's (type, message), or None where it did not fail."""
    model = tpcore.models.from_pretrained(path, comm, progress=False)
    model.cache_paged(8, 4)
    calls = []
    for change, _, _ in BAD:
        kw = dict(pos0=np.array([0], np.int64), use_cache=True, block_table=np.array([[0, 1]]))
        kw.update(change)
        calls.append(lambda kw=kw: model._forward(np.zeros((1, 6), np.int64), **kw))
    calls += [lambda: model.cache_paged(0, 4), lambda: model.cache_paged(4, 2.5),
              lambda: (model.cache(1, 8), model._forward(np.zeros((1, 2), np.int64), use_cache=True,
                                                         block_table=np.array([[0]])))]
    out = []
    for f in calls:
        try:
            f()
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append((type(e).__name__, str(e)))
    ok = model._forward(np.zeros((1, 2), np.int64), use_cache=True)   # the cache of sequences still works
    return out, ok.shape


def test_paged_bad_arguments(tmp_path_factory):
    path = _built("llama", tmp_path_factory)[0]
    out, shape = run(_bad, 1, path)[0]
    want = [(err.__name__, words) for _, err, words in BAD] + [
        ("ValueError", "num_blocks must be"), ("TypeError", "block_size"),
        ("ValueError", "needs a paged KV cache: call cache_paged")]
    for got, (typ, words) in zip(out, want):
        assert got is not None and got[0] == typ and words in got[1], (typ, words, got)
    assert shape == (1, 2, 48)
