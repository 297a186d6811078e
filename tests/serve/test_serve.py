"""Continuous batching (tpcore.serve.Engine) and the KV-cache slots under it.

The block's slots (tp_block_batch_t.slots): sequences prefilled into and decoded from
arbitrary cache slots, in shuffled row orders, a slot reused after stale tokens, against the
float64 reference of each whole sequence, at world 1-4 with uneven head partitions; bad slots
refused on every rank.  The engine: every request's tokens equal generate() of it alone
(greedy and sampled, EOS in the middle, max_batch below the number of requests so slots are
reused, requests submitted while others run) at world 1, 2 and 3 (uneven heads), GPT-2- and
Llama-style models; bad requests refused; ranks that submit different requests get a
ValueError on every rank."""
import numpy as np
import pytest

import tpcore
import reference_transformer as ref
from conftest import WORLDS, rng_for, run

BLOCKS = {
    "gpt2": dict(hidden=24, heads=6, ffn_hidden=40, norm="layernorm", activation="gelu_tanh", positions="none",
                 causal=True, pre_norm=True, bias=True),
    "llama_gqa": dict(hidden=24, heads=6, kv_heads=2, head_dim=6, ffn_hidden=36, norm="rmsnorm", activation="swiglu",
                      positions="rope", rope_theta=500.0, causal=True, pre_norm=True, bias=False, eps=1e-6),
}
GPT2 = dict(vocab_size=97, hidden=24, layers=2, heads=6, ffn_hidden=40, norm="layernorm", activation="gelu_tanh",
            positions="learned", max_positions=32, causal=True, pre_norm=True, bias=True, tie_embeddings=True,
            model_type="gpt2")
LLAMA = dict(vocab_size=101, hidden=24, layers=2, heads=6, kv_heads=2, ffn_hidden=36, norm="rmsnorm", eps=1e-6,
             activation="swiglu", positions="rope", rope_theta=1000.0, max_positions=64, causal=True, pre_norm=True,
             bias=False, tie_embeddings=False, model_type="llama")
MODELS = {"gpt2": GPT2, "llama": LLAMA}


def _uneven(cfg, world):
    return tpcore.nn.config.head_partition(cfg, world, weights=[1 + 2 * (r % 2) for r in range(world)])


# ------------------------------------------------------------------ block slots

def _block_slots_case(comm, name):
    cfg = tpcore.Config(vocab_size=10, **BLOCKS[name])
    blk = tpcore.TransformerBlock(cfg, comm, seed=4, head_partition=_uneven(cfg, comm.size))
    g = rng_for(17, 0)  # the same full tensors and inputs on every rank
    P = {}
    for n, shape in blk.full_shapes().items():
        scale = 1.0 if n.startswith("norm") and n.endswith("weight") else 0
        P[n] = (scale + g.standard_normal(shape) * (0.3 if n.endswith("weight") else 0.2)).astype(np.float32)
    blk.load_full(P)
    P64 = {k: v.astype(np.float64) for k, v in P.items()}
    C, S, L = cfg.hidden, 5, 12
    blk.cache(S, L)
    # sequences (id: length), each prefilled with a prompt then decoded one token at a time
    lens = {"a": 9, "b": 6, "c": 8, "d": 5, "e": 4}
    xs = {k: g.standard_normal((n, C)).astype(np.float32) for k, n in lens.items()}
    got = {k: np.full((n, C), np.nan) for k, n in lens.items()}
    # a stale sequence fills slot 1 first (its tokens must never be seen by "c", which reuses it)
    blk(g.standard_normal((1, L, C)).astype(np.float32), pos0=[0], use_cache=True, need_backward=False, slots=[1])
    at, slot = {}, {"a": 3, "b": 0, "c": 1, "d": 4, "e": 3}  # "e" reuses the slot "a" held

    def prefill(keys, n):
        T = max(n[k] for k in keys)
        x = g.standard_normal((len(keys), T, C)).astype(np.float32)  # right padding: random rows
        for i, k in enumerate(keys):
            x[i, :n[k]] = xs[k][:n[k]]
        y = blk(x, pos0=np.zeros(len(keys), np.int64), use_cache=True, need_backward=False,
                slots=[slot[k] for k in keys])
        for i, k in enumerate(keys):
            got[k][:n[k]] = y[i, :n[k]]
            at[k] = n[k]

    def decode(keys):
        x = np.stack([xs[k][at[k]] for k in keys])[:, None]
        y = blk(x, pos0=[at[k] for k in keys], use_cache=True, need_backward=False, slots=[slot[k] for k in keys])
        for i, k in enumerate(keys):
            got[k][at[k]] = y[i, 0]
            at[k] += 1

    prefill(["a", "b"], {"a": 5, "b": 2})
    decode(["b", "a"])
    decode(["a", "b"])
    prefill(["c", "d"], {"c": 3, "d": 4})    # "c" into the stale slot 1
    decode(["d", "b", "c", "a"])
    decode(["c", "a", "b"])                  # "a" and "b" are complete
    prefill(["e"], {"e": 2})                 # into the slot "a" left (its stale tokens behind)
    for keys in (["c", "e"], ["e", "c"], ["c"]):
        decode(keys)
    errs = []
    for k, n in lens.items():
        if at[k] != n:
            errs.append(f"{k}: decoded {at[k]} of {n}")
        want = ref.block(cfg, P64, xs[k][None].astype(np.float64))[0]
        err = float(np.abs(got[k] - want).max())
        if not err < 2e-4 * max(1.0, float(np.abs(want).max())):
            errs.append(f"{k}: max error {err}")
    # bad slots: refused with the index named (the ranks agree first: every rank raises)
    x1 = np.zeros((2, 1, C), np.float32)
    for slots, word in (([0, 0], "both 0"), ([0, 5], "slots[1] = 5"), ([-1, 0], "slots[0] = -1"),
                        ([0], "shape (2,)"), ([[0, 1]], "shape (2,)")):
        try:
            blk(x1, pos0=[0, 0], use_cache=True, need_backward=False, slots=slots)
            errs.append(f"{slots}: no error")
        except ValueError as e:
            if word not in str(e):
                errs.append(f"{slots}: {e}")
    for bad, exc, word in (([0.5, 1.0], TypeError, "integers"), ("ab", TypeError, "integers")):
        try:
            blk(x1, pos0=[0, 0], use_cache=True, need_backward=False, slots=bad)
            errs.append(f"{bad!r}: no error")
        except exc as e:
            if word not in str(e):
                errs.append(f"{bad!r}: {e}")
    try:
        blk(x1, need_backward=False, slots=[0, 1])
        errs.append("slots without the cache: no error")
    except ValueError as e:
        if "use_cache" not in str(e):
            errs.append(str(e))
    if comm.size > 1:  # ranks that pass different slots: a ValueError on every rank, no hang
        try:
            blk(x1, pos0=[0, 0], use_cache=True, need_backward=False, slots=[0, 1 + (comm.rank == 1)])
            errs.append("different slots across ranks: no error")
        except ValueError as e:
            if "slots differ" not in str(e):
                errs.append(str(e))
    return errs


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_block_slots_against_the_reference(world, name):
    for r, errs in enumerate(run(_block_slots_case, world, name)):
        assert not errs, (r, errs)


def _lm_slots_case(comm, name):
    """TransformerLM.forward(slots=): two prompts prefilled into cache slots 2 and 0, decoded in the
    other row order, against the model's own forward over each whole sequence (no cache)."""
    cfg = tpcore.Config(**MODELS[name])
    model = tpcore.models.TransformerLM(cfg, comm, seed=9, partition=_uneven(cfg, comm.size))
    g = rng_for(5, 0)
    toks = g.integers(0, cfg.vocab_size, (2, 9))
    full = model.forward(toks)
    model.cache(3, 16)
    got = np.zeros_like(full)
    got[:, :6] = model.forward(toks[:, :6], pos0=[0, 0], use_cache=True, slots=[2, 0])
    for t in range(6, 9):
        got[::-1, t:t + 1] = model.forward(toks[::-1, t:t + 1], pos0=[t, t], use_cache=True, slots=[0, 2])
    errs = []
    err = float(np.abs(got - full).max())
    if not err < 1e-4:
        errs.append(f"max error {err}")
    for slots, word in (([1, 1], "both 1"), ([0, 3], "slots[1] = 3"), ([0], "shape (2,)")):
        try:
            model.forward(toks[:, :1], pos0=[0, 0], use_cache=True, slots=slots)
            errs.append(f"{slots}: no error")
        except ValueError as e:
            if word not in str(e):
                errs.append(f"{slots}: {e}")
    try:  # slot 1 holds no tokens: a forward at position 6 there would skip past them
        model.forward(toks[:, :1], pos0=[6, 6], use_cache=True, slots=[2, 1])
        errs.append("skipping past a slot's cached tokens: no error")
    except ValueError as e:
        if "skips past the 0 tokens cached for sequence 1" not in str(e):
            errs.append(str(e))
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_model_forward_with_slots(world, name):
    for r, errs in enumerate(run(_lm_slots_case, world, name)):
        assert not errs, (r, errs)


# ------------------------------------------------------------------ the engine

def _requests(cfg, n, seed, longest):
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        new = int(g.integers(1, 11))
        plen = int(g.integers(1, min(14, longest - new) + 1))
        out.append((g.integers(0, cfg.vocab_size, plen), new))
    return out


def _engine_case(comm, name):
    cfg = tpcore.Config(**MODELS[name])
    uneven = comm.size == 3
    model = tpcore.models.TransformerLM(cfg, comm, seed=7, partition=_uneven(cfg, comm.size) if uneven else None)
    reqs = _requests(cfg, 12, 21, cfg.max_positions if name == "gpt2" else 30)
    # EOS in the middle: requests 2, 5 and 9 stop on the id greedy decoding gives them third;
    # requests 4 and 10 sample (temperature, top_k, their own seed)
    plain = [model.generate([p], n)[0][p.size:] for p, n in reqs]
    extra = [{} for _ in reqs]
    for i in (2, 5, 9):
        reqs[i] = (reqs[i][0], 10)
        plain[i] = model.generate([reqs[i][0]], 10)[0][reqs[i][0].size:]
        extra[i] = dict(eos_token_id=int(plain[i][2]))
    extra[4] = dict(temperature=0.9, seed=123)
    extra[10] = dict(temperature=1.3, top_k=5, seed=2 ** 64 - 5)
    want = []
    for (p, n), kw in zip(reqs, extra):
        want.append(model.generate([p], n, **kw)[0][p.size:])
    eng = tpcore.Engine(model, max_batch=4)
    handles = [eng.submit(p, n, **kw) for (p, n), kw in zip(reqs[:6], extra[:6])]
    order = []
    for r in eng.run():  # the rest arrive while the first ones run
        order.append(r.id)
        if len(handles) < len(reqs):
            k = len(handles)
            handles += [eng.submit(p, n, **kw) for (p, n), kw in zip(reqs[k:k + 3], extra[k:k + 3])]
    errs = []
    for i, (h, w) in enumerate(zip(handles, want)):
        if not np.array_equal(h.tokens, w):
            errs.append(f"request {i}: {h.tokens.tolist()} != generate's {w.tolist()}")
        if not h.done or h.running:
            errs.append(f"request {i}: not finished")
        if len(h.token_times) != h.tokens.size or h.latencies.size != h.tokens.size - 1 or not h.ttft > 0 \
                or not h.submitted <= h.first_token <= h.finished or np.any(h.latencies < 0):
            errs.append(f"request {i}: times {h.submitted}, {h.first_token}, {h.token_times}, {h.finished}")
    reasons = [h.finish_reason for h in handles]
    for i in (2, 5, 9):
        if reasons[i] != "stop" or handles[i].tokens[-1] != extra[i]["eos_token_id"] or handles[i].tokens.size >= 10:
            errs.append(f"request {i}: finished by {reasons[i]} after {handles[i].tokens.size} tokens")
    if reasons.count("length") < 6:
        errs.append(f"finish reasons {reasons}")
    st = eng.stats()
    if sorted(order) != list(range(len(reqs))) or st["finished"] != len(reqs) or st["running"] or st["waiting"]:
        errs.append(f"finished {order}, stats {st}")
    if st["peak_running"] != 4 or st["used_blocks"] != 0 or st["decodes"] >= st["generated_tokens"] / 2:
        errs.append(f"not batched: {st}")
    if st["generated_tokens"] != sum(h.tokens.size for h in handles):
        errs.append(f"generated {st['generated_tokens']}")
    # generate() between runs takes the cache; the engine takes it back when nothing runs
    model.generate([reqs[0][0]], 2)
    h = eng.submit(reqs[1][0], reqs[1][1])
    done = list(eng.run())
    if done != [h] or not np.array_equal(h.tokens, want[1]):
        errs.append(f"after generate(): {h.tokens.tolist()} != {want[1].tolist()}")
    # ... but while requests run, a reallocated cache is refused
    eng.submit(reqs[0][0], 5)
    eng.step()
    model.cache(2, 8)
    try:
        eng.step()
        errs.append("a reallocated cache under running requests: no error")
    except RuntimeError as e:
        if "reallocated" not in str(e):
            errs.append(str(e))
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_engine_tokens_equal_generate_alone(world, name):
    for r, errs in enumerate(run(_engine_case, world, name)):
        assert not errs, (r, errs)


def _device_path_case(comm, name):
    """The GPU code path of the model (DeviceArrays between the layers, the d_ kernels), run on
    the CPU: the engine's row gathers and logits there give generate()'s tokens too."""
    cfg = tpcore.Config(**MODELS[name])
    model = tpcore.models.TransformerLM(cfg, comm, seed=3, _device_path=True)
    reqs = _requests(cfg, 6, 8, 30)
    want = [model.generate([p], n)[0][p.size:].tolist() for p, n in reqs]
    eng = tpcore.Engine(model, max_batch=3)
    hs = [eng.submit(p, n) for p, n in reqs]
    list(eng.run())
    return [f"request {i}: {h.tokens.tolist()} != {w}" for i, (h, w) in enumerate(zip(hs, want))
            if h.tokens.tolist() != w]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_engine_on_the_device_code_path(name):
    for r, errs in enumerate(run(_device_path_case, 2, name)):
        assert not errs, (r, errs)


def _budget_case(comm):
    """max_prefill_tokens: prompts split in chunks over steps (no step computes more prompt
    tokens than the budget), the same tokens."""
    cfg = tpcore.Config(**LLAMA)
    model = tpcore.models.TransformerLM(cfg, comm, seed=6)
    reqs = _requests(cfg, 10, 13, 30)
    want = [model.generate([p], n)[0][p.size:].tolist() for p, n in reqs]
    longest = max(p.size for p, _ in reqs)
    eng = tpcore.Engine(model, max_batch=6, max_prefill_tokens=longest - 1)
    hs = [eng.submit(p, n) for p, n in reqs]
    list(eng.run())
    st = eng.stats()
    errs = [f"request {i}: {h.tokens.tolist()} != {w}" for i, (h, w) in enumerate(zip(hs, want))
            if h.tokens.tolist() != w]
    if st["prefill_step_max"] != longest - 1 or st["prefills"] < 4:  # the longest prompt went in two pieces
        errs.append(f"{st}")
    return errs


def test_engine_prefill_budget():
    for r, errs in enumerate(run(_budget_case, 2)):
        assert not errs, (r, errs)


def _bad_inputs_case(comm):
    cfg = tpcore.Config(**GPT2)
    model = tpcore.models.TransformerLM(cfg, comm, seed=1)
    eng = tpcore.Engine(model, max_batch=2, max_len=20)
    errs = []
    cases = [
        (lambda: eng.submit([], 3), ValueError, "at least one token"),
        (lambda: eng.submit([1, 97], 3), ValueError, "97 at index 1"),
        (lambda: eng.submit([-1], 3), ValueError, "-1 at index 0"),
        (lambda: eng.submit([1, 2], 0), ValueError, "max_new_tokens"),
        (lambda: eng.submit([1, 2], -4), ValueError, "max_new_tokens"),
        (lambda: eng.submit(list(range(15)), 6), ValueError, "max_len - max_new_tokens = 14"),
        (lambda: eng.submit("hello", 3), TypeError, "prompt"),
        (lambda: eng.submit(5, 3), TypeError, "prompt"),
        (lambda: eng.submit([1.5, 2.0], 3), TypeError, "integers"),
        (lambda: eng.submit([[1, 2]], 3), ValueError, "1-D"),
        (lambda: eng.submit([1, 2], 2.5), TypeError, "max_new_tokens"),
        (lambda: eng.submit([1, 2], True), TypeError, "max_new_tokens"),
        (lambda: eng.submit([1, 2], 3, eos_token_id="x"), TypeError, "eos_token_id"),
        (lambda: eng.submit([1, 2], 3, temperature=-1), ValueError, "temperature"),
        (lambda: eng.submit([1, 2], 3, top_k=-2), ValueError, "top_k"),
        (lambda: eng.submit([1, 2], 3, temperature=float("nan")), ValueError, "temperature"),
        (lambda: eng.submit([1, 2], 3, top_p=0.0), ValueError, "top_p"),
        (lambda: eng.submit([1, 2], 3, top_p=0.5, sampling=tpcore.models.sampling.SamplingParams()), TypeError,
         "not both"),
        (lambda: eng.submit([1, 2], 3, stop=["x"]), ValueError, "tokenizer"),
        (lambda: eng.submit([1, 2], 3, stop_token_ids=[97]), ValueError, "stop_token_ids"),
        (lambda: eng.cancel(5), ValueError, "no request 5"),
        (lambda: eng.cancel("a"), TypeError, "Request"),
        (lambda: tpcore.Engine("model"), TypeError, "TransformerLM"),
        (lambda: tpcore.Engine(model, max_batch=0), ValueError, "max_batch"),
        (lambda: tpcore.Engine(model, max_len=33), ValueError, "max_positions (32)"),
        (lambda: tpcore.Engine(model, max_batch=1.5), TypeError, "max_batch"),
        (lambda: tpcore.Engine(model, max_prefill_tokens=0), ValueError, "max_prefill_tokens"),
        (lambda: tpcore.Engine(model, max_len=20, block_size=0), ValueError, "block_size"),
        (lambda: tpcore.Engine(model, max_len=20, block_size=4, num_blocks=4), ValueError, "num_blocks"),
        (lambda: tpcore.Engine(model, prefix_caching="yes"), TypeError, "prefix_caching"),
        (lambda: tpcore.Engine(tpcore.models.TransformerLM(tpcore.Config(
            vocab_size=11, hidden=8, layers=1, heads=2, ffn_hidden=8, causal=False, max_positions=8), comm)),
         ValueError, "causal"),
    ]
    for i, (call, exc, word) in enumerate(cases):
        try:
            call()
            errs.append(f"case {i}: no error")
        except exc as e:
            if word not in str(e):
                errs.append(f"case {i}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            errs.append(f"case {i}: {type(e).__name__}: {e}")
    # the refused requests left nothing behind; a good one still runs
    if eng.waiting or eng.running or eng.stats()["submitted"]:
        errs.append(f"refused requests were queued: {eng.stats()}")
    h = eng.submit(list(range(14)), 6)  # exactly max_len tokens in all
    list(eng.run())
    if h.tokens.size != 6 or h.finish_reason != "length":
        errs.append(f"{h}")
    return errs


def test_engine_refuses_bad_inputs():
    errs = run(_bad_inputs_case, 1)[0]
    assert not errs, errs


def _mismatch_case(comm, how):
    cfg = tpcore.Config(**LLAMA)
    model = tpcore.models.TransformerLM(cfg, comm, seed=2)
    eng = tpcore.Engine(model, max_batch=2)
    eng.submit([1, 2, 3], 4)
    eng.step()
    if how == "prompt":
        eng.submit([5, 6] if comm.rank != 1 else [5, 7], 3)
    else:
        for _ in range(1 if comm.rank == 0 else 2):
            eng.submit([4], 2)
    try:
        eng.step()
        return "no error"
    except ValueError as e:
        msg = str(e)
    try:  # the engine stays refused, on every rank, without a collective that could hang
        eng.step()
        return "a second step ran"
    except ValueError:
        pass
    return msg


@pytest.mark.parametrize("how", ["prompt", "count"])
def test_ranks_that_submit_different_requests_get_a_value_error(how):
    msgs = run(_mismatch_case, 3, how)
    want = ("the submitted or cancelled requests differ" if how == "prompt" else
            "the number of submitted requests differs")
    for r, m in enumerate(msgs):
        assert "Engine.step" in m and want in m and "same requests in the same order" in m, (r, m)


def _failed_step_case(comm):
    """A step that fails part-way (here the prefill's forward raises once) breaks the engine with a
    RuntimeError naming the failure on every later step; a new engine on the same model serves
    again and its tokens still equal generate's."""
    cfg = tpcore.Config(**GPT2)
    model = tpcore.models.TransformerLM(cfg, comm, seed=3)
    eng = tpcore.Engine(model, max_batch=2, max_len=24)
    eng.submit([5, 6, 7], 4)
    real = model._forward

    def boom(*a, **k):
        model._forward = real
        raise KeyboardInterrupt("stopped by the user")

    model._forward = boom
    errs = []
    try:
        eng.step()
        errs.append("the failing step did not raise")
    except KeyboardInterrupt:
        pass
    for _ in range(2):
        try:
            eng.step()
            errs.append("a broken engine stepped")
        except RuntimeError as e:
            if "KeyboardInterrupt: stopped by the user" not in str(e) or "make a new one" not in str(e):
                errs.append(f"unclear error: {e}")
    eng2 = tpcore.Engine(model, max_batch=2, max_len=24)
    r = eng2.submit([5, 6, 7], 4)
    list(eng2.run())
    want = model.generate([np.array([5, 6, 7])], max_new_tokens=4, eos_token_id=-1)
    if r.tokens.tolist() != np.asarray(want)[0, 3:].tolist():
        errs.append(f"new engine: {r.tokens.tolist()} vs generate {want}")
    return errs


def test_a_step_that_fails_part_way_breaks_the_engine_clearly():
    for r, errs in enumerate(run(_failed_step_case, 2)):
        assert not errs, (r, errs)


def _nan_case(comm, seed):
    """One token's embedding row NaN (an untied head: only the sequences that read it go bad):
    a request with it in its prompt fails at step 0, one that generates it fails at the next
    step, each with finish_reason "error" and a ValueError naming it and the step; the other
    requests go on (in the failed ones' slots too, over their NaN cache rows) with the tokens
    generate() gives them alone."""
    cfg = tpcore.Config(**LLAMA)
    model = tpcore.models.TransformerLM(cfg, comm, seed=seed % 1000)
    reqs = [(p, n + 4) for p, n in _requests(cfg, 8, seed, 30)]
    clean = [model.generate([p], n, eos_token_id=-1)[0][p.size:] for p, n in reqs]
    poison = None
    for p, c in zip(reqs, clean):  # a token some request generates before its last step, not in its prompt
        for j, t in enumerate(c[:-1].tolist()):
            if t not in p[0] and t not in c[:j]:
                poison = t
                break
        if poison is not None:
            break
    if poison is None:
        return [f"seed {seed}: no request generates a token outside its prompt"]
    g = rng_for(seed, 1)
    p = g.integers(0, cfg.vocab_size, 6)
    p[int(g.integers(6))] = poison
    at = int(g.integers(len(reqs) + 1))
    reqs.insert(at, (p, 5))
    clean.insert(at, model.generate([p], 5, eos_token_id=-1)[0][p.size:])
    want = []  # (finish reason, tokens, failing step)
    for (q, _), c in zip(reqs, clean):
        if poison in q:
            want.append(("error", [], 0))
        elif poison in c[:-1].tolist():
            j = c.tolist().index(poison)
            want.append(("error", c[:j + 1].tolist(), j + 1))
        else:
            want.append(("length", c.tolist(), None))
    lo, n = model.vocab_partition[comm.rank]
    if lo <= poison < lo + n:
        model.wte.weight[poison - lo] = np.nan
    eng = tpcore.Engine(model, max_batch=3, max_len=40, eos_token_id=-1)
    handles = [eng.submit(q, n) for q, n in reqs]
    done = list(eng.run())
    errs = []
    for h, (reason, toks, step) in zip(handles, want):
        if h.finish_reason != reason or h.tokens.tolist() != toks or not h.done or h.running:
            errs.append(f"request {h.id}: {h.finish_reason} {h.tokens.tolist()}, want {reason} {toks}")
        text = f"Engine: the logits of request {h.id} at step {step} hold NaN"
        if (reason == "error") != isinstance(h.error, ValueError) or (step is not None and text not in str(h.error)):
            errs.append(f"request {h.id}: error {h.error!r}, want {text!r}")
    failed = sum(w[0] == "error" for w in want)
    st = eng.stats()
    if sorted(r.id for r in done) != list(range(len(reqs))) or st["failed"] != failed or st["used_blocks"] != 0:
        errs.append(f"finished {[r.id for r in done]}, stats {st}")
    if failed < 2 or failed == len(reqs):
        errs.append(f"seed {seed}: {failed} of {len(reqs)} requests failed (the test wants some of both)")
    return errs


@pytest.mark.parametrize("world", [1, 2])
def test_a_request_with_nan_logits_fails_alone(world):
    seed = int(np.random.default_rng().integers(2 ** 31))
    for r, errs in enumerate(run(_nan_case, world, seed)):
        # short, seed first: the sanitized suite shows only the tail of its output
        assert not errs, f"seed {seed}, rank {r}: {errs[0][:300]} (and {len(errs) - 1} more)"
