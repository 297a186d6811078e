"""Sampling (tpcore.models.sampling) and its use in generate / iter_generate.

The filters against transformers' own logits processors (RepetitionPenaltyLogitsProcessor,
TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper on float64
torch tensors), the presence / frequency penalties against float64 NumPy written here, the
draws' empirical distribution against the filtered softmax (chi-square, fixed seed, and the
same check shown to reject a wrong distribution), logprobs against a float64 log-softmax, the
draw of tpcore before SamplingParams kept for the same seed, bad settings refused naming the
field, generation_config defaults, and the same seed giving the same tokens at world 1, 2
and 3 (uneven heads)."""
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import chi2
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

import tpcore
from conftest import rng_for, run
from tpcore.models.sampling import (Sampler, SamplingParams, TokenLogprob, bad_logits, draw, filtered_probs,
                                    sample_batch)

LLAMA = dict(vocab_size=101, hidden=24, layers=2, heads=6, kv_heads=2, ffn_hidden=36, norm="rmsnorm", eps=1e-6,
             activation="swiglu", positions="rope", rope_theta=1000.0, max_positions=64, causal=True, pre_norm=True,
             bias=False, tie_embeddings=False, model_type="llama")
FULL = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.3,
            frequency_penalty=0.2)


# ------------------------------------------------------------------ references written here

def ref_penalize(row, prompt, out, rep, presence, frequency):
    """float64, one token at a time: repetition over prompt and output (divided when > 0, else
    multiplied), then OpenAI's presence / frequency over the output."""
    z = np.array(row, np.float64)
    for t in set(prompt) | set(out):
        z[t] = z[t] / rep if z[t] > 0 else z[t] * rep
    for t in set(out):
        z[t] -= frequency * out.count(t) + presence
    return z


def hf_probs(row, prompt, out, p: SamplingParams):
    """The distribution transformers' processors give (float64 torch), with the presence and
    frequency penalties (which transformers lacks) from ref_penalize between them."""
    ids = torch.tensor([list(prompt) + list(out)], dtype=torch.long)
    s = torch.tensor(np.asarray(row, np.float64)[None])
    if p.repetition_penalty != 1:
        s = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, s)
    s = torch.tensor(ref_penalize(s[0].numpy(), [], list(out), 1.0, p.presence_penalty, p.frequency_penalty)[None])
    if p.temperature == 0:
        onehot = np.zeros(s.shape[1])
        onehot[int(s[0].argmax())] = 1
        return onehot
    s = TemperatureLogitsWarper(p.temperature)(ids, s)
    if p.top_k:
        s = TopKLogitsWarper(p.top_k)(ids, s)
    if p.top_p < 1:
        s = TopPLogitsWarper(p.top_p)(ids, s)
    if p.min_p > 0:
        s = MinPLogitsWarper(p.min_p)(ids, s)
    return torch.softmax(s, -1)[0].numpy()


def log_softmax64(row):
    z = np.asarray(row, np.float64)
    m = z.max()
    return z - m - math.log(np.exp(z - m).sum())


def old_sample(logits, temperature, top_k, rng):
    """tpcore's draw before SamplingParams (generate's `sample`): the tokens a seed gave."""
    if temperature <= 0:
        return logits.argmax(-1)
    z = logits.astype(np.float64) / temperature
    if top_k:
        z = np.where(z >= np.sort(z, -1)[:, -int(top_k)][:, None], z, -np.inf)
    z -= z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    u = rng.random(len(p))[:, None]
    return np.minimum((np.cumsum(p, -1) < u).sum(-1), p.shape[-1] - 1)


def _sampler(p, V, prompt, out):
    s = Sampler(p, V, prompt)
    for t in out:
        s.accept(t)
    return s


# ------------------------------------------------------------------ filters and penalties

CASES = [dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8),
         dict(temperature=1.0, min_p=0.1), dict(temperature=0.8, top_k=30, top_p=0.7, min_p=0.05),
         dict(temperature=1.0, repetition_penalty=1.5), dict(temperature=1.1, repetition_penalty=0.7, top_p=0.95),
         dict(temperature=0.9, presence_penalty=1.5, frequency_penalty=-0.5, top_k=10), FULL,
         dict(temperature=0.0, repetition_penalty=1.8, presence_penalty=2.0, frequency_penalty=1.0),
         dict(temperature=1.0, top_p=1e-9), dict(temperature=1.0, top_k=1), dict(temperature=1.0, min_p=1.0)]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_filters_and_penalties_against_transformers(case):
    """Sampler.probs (the distribution drawn from) equals softmax of transformers' processors
    chain, on rows with -inf entries and several scales; the support is the same exactly."""
    seed = int(np.random.default_rng().integers(2 ** 31))
    g = np.random.default_rng(seed)
    params = SamplingParams(**CASES[case])
    for _ in range(20):
        V = int(g.integers(2, 300))
        row = (g.standard_normal(V) * float(g.choice([0.5, 3, 20]))).astype(np.float32)
        row[g.random(V) < 0.1] = -np.inf
        row[int(g.integers(V))] = 1.0 + (abs(row[np.isfinite(row)]).max() if np.isfinite(row).any() else 0.0)
        finite = row[np.isfinite(row)]
        if np.unique(finite).size < finite.size:  # a float32 tie: the order of tied tokens is transformers' own
            continue
        prompt = g.integers(0, V, int(g.integers(0, 8))).tolist()
        out = g.integers(0, V, int(g.integers(0, 12))).tolist()
        got = _sampler(params, V, prompt, out).probs(row)
        want = hf_probs(row, prompt, out, params)
        assert np.array_equal(got > 0, want > 0), (seed, np.flatnonzero(got > 0), np.flatnonzero(want > 0))
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=f"seed {seed}")
        assert abs(got.sum() - 1) < 1e-12


def test_top_k_keeps_ties_and_clamps_to_the_vocabulary():
    """Integer logits (ties at the k-th): every tied token kept, as TopKLogitsWarper; top_k past
    the vocabulary is the whole of it (no refusal)."""
    g = np.random.default_rng(3)
    for _ in range(50):
        V = int(g.integers(3, 40))
        row = g.integers(-3, 4, V).astype(np.float32)
        for k in (1, 2, V - 1, V, V + 1, 100000):
            p = SamplingParams(temperature=1.0, top_k=k)
            got = Sampler(p, V).probs(row)
            ids = torch.zeros((1, 1), dtype=torch.long)
            want = torch.softmax(TopKLogitsWarper(k)(ids, torch.tensor(row[None], dtype=torch.float64)), -1)[0]
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-15)


def test_penalties_against_float64_numpy():
    """Sampler.penalize after accept() of the output: ref_penalize (the prompt counts for the
    repetition penalty only); a greedy pick is the argmax of the penalised row."""
    seed = int(np.random.default_rng().integers(2 ** 31))
    g = np.random.default_rng(seed)
    for _ in range(100):
        V = int(g.integers(2, 200))
        rep, pres, freq = float(g.uniform(0.3, 3)), float(g.uniform(-2, 2)), float(g.uniform(-2, 2))
        row = (g.standard_normal(V) * 4).astype(np.float32)
        prompt = g.integers(0, V, int(g.integers(0, 10))).tolist()
        out = g.integers(0, min(V, 8), int(g.integers(0, 30))).tolist()  # repeats
        p = SamplingParams(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
        s = _sampler(p, V, prompt, out)
        want = ref_penalize(row, prompt, out, rep, pres, freq)
        np.testing.assert_allclose(s.penalize(row), want, rtol=1e-12, atol=1e-12, err_msg=f"seed {seed}")
        assert s.pick(row)[0] == int(np.argmax(want))
        assert sample_batch(row[None], [s])[0][0] == int(np.argmax(want))
    plain = Sampler(SamplingParams(), 5)
    row = np.arange(5, dtype=np.float32)
    assert plain.penalize(row) is row  # no penalty: no copy


# ------------------------------------------------------------------ the draw

def _chi2_pvalue(counts, p):
    keep = p > 0
    n = counts.sum()
    stat = float((((counts - n * p) ** 2)[keep] / (n * p[keep])).sum())
    return chi2.sf(stat, int(keep.sum()) - 1)


def test_draws_follow_the_filtered_distribution():
    """20,000 picks of one sampler (pick counts nothing: the distribution stays) against
    hf_probs: no token outside the support, chi-square p-value > 1e-4 (fixed seed); the same
    counts against the distribution without top_p are rejected (p < 1e-6), so the check can
    fail."""
    g = np.random.default_rng(11)
    V = 16
    row = (g.standard_normal(V) * 1.5).astype(np.float32)
    prompt, out = [1, 2, 3], [4, 4, 5, 9]
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.85, min_p=0.05, repetition_penalty=1.3,
                            presence_penalty=0.4, frequency_penalty=0.3, seed=2024)
    s = _sampler(params, V, prompt, out)
    counts = np.bincount([s.pick(row)[0] for _ in range(20000)], minlength=V)
    want = hf_probs(row, prompt, out, params)
    assert counts[want == 0].sum() == 0, (counts, want)
    assert (want > 0).sum() >= 4, want  # several tokens in play
    assert _chi2_pvalue(counts, want) > 1e-4, (counts, 20000 * want)
    wrong = hf_probs(row, prompt, out, dataclasses.replace(params, top_p=1.0))
    assert (wrong > 0).sum() > (want > 0).sum() and _chi2_pvalue(counts, wrong) < 1e-6, (counts, 20000 * wrong)
    # sample_batch: the same stream, row after row
    s2 = _sampler(params, V, prompt, out)
    ids, lps = sample_batch(np.repeat(row[None], 500, 0), [s2] * 500)
    s3 = _sampler(params, V, prompt, out)
    assert ids.tolist() == [s3.pick(row)[0] for _ in range(500)] and lps == [None] * 500


def test_same_seed_same_tokens_and_the_earlier_draw_kept():
    """A seed gives the same tokens twice, another seed others; with only temperature / top_k /
    seed the tokens are those of tpcore's earlier draw (old_sample) for that seed, one row or a
    batch sharing a stream."""
    g = np.random.default_rng(5)
    for trial in range(40):
        B, V = int(g.integers(1, 5)), int(g.choice([7, 101, 5000]))
        temp, k = float(g.choice([0.0, 0.5, 1.0, 1.7])), int(g.choice([0, 1, 3, V, V + 50]))
        seed = int(g.integers(2 ** 64, dtype=np.uint64))
        params = SamplingParams(temperature=temp, top_k=k, seed=seed)
        rng = np.random.default_rng(seed)
        samplers = [Sampler(params, V, rng=np.random.default_rng(seed) if B == 1 else None) for _ in range(B)]
        if B > 1:
            shared = np.random.default_rng(seed)
            samplers = [Sampler(params, V, rng=shared) for _ in range(B)]
        for step in range(4):
            logits = (g.standard_normal((B, V)) * 3).astype(np.float32)
            got, _ = sample_batch(logits, samplers)
            want = old_sample(logits, temp, k if k < V else 0, rng)
            assert got.tolist() == want.tolist(), (trial, step)
    row = (g.standard_normal(50) * 2).astype(np.float32)
    a = [Sampler(SamplingParams(**FULL, seed=9), 50).pick(row)[0] for _ in range(3)]
    s, t = Sampler(SamplingParams(**FULL, seed=9), 50), Sampler(SamplingParams(**FULL, seed=10), 50)
    assert len(set(a)) == 1
    x, y = [s.pick(row)[0] for _ in range(40)], [t.pick(row)[0] for _ in range(40)]
    assert x != y and x[0] == a[0]


class _FixedRng:
    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_draw_never_returns_a_filtered_token_at_the_edges():
    """u == 0 and u past the last cumulative probability (rounding) still give a token the
    filters kept (the first / last one), never a filtered one at either end."""
    z = np.array([-5.0, 3.0, 2.0, 1.0, -5.0])
    assert draw(z, 1.0, 3, 1.0, 0.0, _FixedRng(0.0)) == 1
    assert draw(z, 1.0, 3, 1.0, 0.0, _FixedRng(np.nextafter(1.0, 0))) == 3
    assert draw(z, 1.0, 3, 1.0, 0.0, _FixedRng(2.0)) == 3
    p = filtered_probs(z, 1.0, 3, 1.0, 0.0)
    assert p[0] == p[4] == 0 and abs(p.sum() - 1) < 1e-15


# ------------------------------------------------------------------ logprobs

def test_logprobs_are_the_raw_log_softmax():
    """The chosen token's logprob and the top k (most probable first, ties by id) from the raw
    logits, whatever the penalties and temperature; logprobs=0: the chosen one only."""
    g = np.random.default_rng(8)
    for _ in range(40):
        V = int(g.integers(2, 300))
        row = (g.standard_normal(V) * 4).astype(np.float32)
        row[g.random(V) < 0.2] = -np.inf
        row[0] = 1.0
        if V > 5:
            row[3] = row[5] = row[0]  # ties
        k = int(g.integers(0, 21))
        params = SamplingParams(logprobs=k, seed=int(g.integers(100)), **FULL)
        s = _sampler(params, V, [1, 2], [0])
        tok, lp = s.pick(row)
        ref = log_softmax64(row)
        assert isinstance(lp, TokenLogprob) and lp.token == tok and abs(lp.logprob - ref[tok]) < 1e-12
        order = sorted(range(V), key=lambda i: (-ref[i], i))[:min(k, V)]
        assert [i for i, _ in lp.top] == order
        np.testing.assert_allclose([v for _, v in lp.top], ref[order], rtol=0, atol=1e-12)
        ids, lps = sample_batch(np.stack([row, row]), [_sampler(params, V, [1, 2], [0]) for _ in range(2)])
        assert lps[0] == lp and lps[1].token == ids[1]
    assert Sampler(SamplingParams(), 4).pick(np.zeros(4, np.float32))[1] is None


def test_bad_logits_fail_only_their_row():
    """sample_batch: a row with NaN, +inf or all -inf gets bad_logits' code and no logprobs, the
    others their tokens; pick refuses such a row naming the step, and rows of the wrong width."""
    g = np.random.default_rng(2)
    logits = g.standard_normal((4, 9)).astype(np.float32)
    logits[1, 3], logits[2, 5] = np.nan, np.inf
    logits[3] = -np.inf
    samplers = [Sampler(SamplingParams(temperature=1.0, logprobs=2), 9) for _ in range(4)]
    ids, lps = sample_batch(logits, samplers)
    assert ids[1:].tolist() == [-1, -2, -3] and 0 <= ids[0] < 9 and lps[1:] == [None] * 3 and lps[0] is not None
    assert bad_logits(logits).tolist() == [0, -1, -2, -3]
    s = Sampler(SamplingParams(), 9)
    s.accept(4)
    with pytest.raises(ValueError, match="at step 1 hold NaN"):
        s.pick(logits[1])
    with pytest.raises(ValueError, match=r"logits_row must be a float array of shape \(9,\)"):
        s.pick(np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="token_id"):
        s.accept(9)
    with pytest.raises(ValueError, match="B = len"):
        sample_batch(logits, samplers[:3])


# ------------------------------------------------------------------ settings

BAD = [("temperature", -0.1, ValueError), ("temperature", float("nan"), ValueError),
       ("temperature", float("inf"), ValueError), ("temperature", "hot", TypeError), ("temperature", True, TypeError),
       ("top_p", 0.0, ValueError), ("top_p", 1.5, ValueError), ("top_p", float("nan"), ValueError),
       ("top_k", -2, ValueError), ("top_k", 2.5, TypeError), ("top_k", True, TypeError),
       ("min_p", -0.1, ValueError), ("min_p", 1.1, ValueError), ("min_p", float("nan"), ValueError),
       ("repetition_penalty", 0.0, ValueError), ("repetition_penalty", -1.2, ValueError),
       ("repetition_penalty", float("inf"), ValueError), ("presence_penalty", 2.5, ValueError),
       ("presence_penalty", float("nan"), ValueError), ("frequency_penalty", -3.0, ValueError),
       ("frequency_penalty", "1", TypeError), ("seed", -1, ValueError), ("seed", 2 ** 64, ValueError),
       ("seed", 1.5, TypeError), ("logprobs", -1, ValueError), ("logprobs", 21, ValueError),
       ("logprobs", 1.0, TypeError)]


@pytest.mark.parametrize("field,value,exc", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_settings_refused_naming_the_field(field, value, exc):
    with pytest.raises(exc, match=f"SamplingParams: {field} must be"):
        SamplingParams(**{field: value})
    with pytest.raises(exc, match=f"request: {field} must be"):
        SamplingParams.make("request", **{field: value})
    if field in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):  # generation_config's keys
        with pytest.raises(exc, match=f"request: generation_config: {field} must be"):
            SamplingParams.make("request", defaults={field: value})


def test_settings_normalised_and_unknown_ones_refused():
    assert SamplingParams(top_k=None).top_k == SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams().seed == 0 and SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1
    assert SamplingParams(temperature=1).temperature == 1.0 and isinstance(SamplingParams(temperature=1).temperature,
                                                                           float)
    with pytest.raises(TypeError, match="unknown sampling setting top_q"):
        SamplingParams.make("request", top_q=0.5)
    with pytest.raises(TypeError, match="defaults must be a dict"):
        SamplingParams.make("request", defaults=[("top_p", 0.5)])
    with pytest.raises(TypeError, match="do_sample must be True or False"):
        SamplingParams.make("request", defaults={"do_sample": "yes"})
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        Sampler(dict(temperature=1.0), 10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 1.0


def test_generation_config_defaults():
    """Unset settings from a generation_config: do_sample False: greedy; True without a
    temperature: 1.0; without do_sample its temperature applies (as vLLM reads it); what the
    caller gives wins; other keys are ignored."""
    gen = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
           "eos_token_id": 2, "max_new_tokens": 30}
    p = SamplingParams.make("request", defaults=gen)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    assert SamplingParams.make("request", defaults={**gen, "do_sample": False}).temperature == 0.0
    assert SamplingParams.make("request", defaults={**gen, "do_sample": True}).temperature == 0.6
    assert SamplingParams.make("request", defaults={"do_sample": True}).temperature == 1.0
    assert SamplingParams.make("request", defaults={"do_sample": False}, temperature=0.8).temperature == 0.8
    q = SamplingParams.make("request", defaults=gen, temperature=0.0, top_k=0, top_p=None, seed=None)
    assert (q.temperature, q.top_k, q.top_p, q.seed) == (0.0, 0, 0.9, 0)
    assert SamplingParams.make("request") == SamplingParams.make("request", defaults={}) == SamplingParams()


def test_read_generation_config_keeps_the_sampling_keys(tmp_path):
    from tpcore.io.formats import read_generation_config
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
         "eos_token_id": [1, 2], "transformers_version": "5.0"}))
    got = read_generation_config(str(tmp_path))
    assert got == {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                   "eos_token_id": [1, 2]}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": "high"}))
    with pytest.raises(Exception, match="top_p"):
        read_generation_config(str(tmp_path))


# ------------------------------------------------------------------ generate

def _model(comm):
    cfg = tpcore.Config(**LLAMA)
    part = None if comm.size < 3 else tpcore.nn.config.head_partition(cfg, comm.size, weights=[1, 3, 1])
    return tpcore.models.TransformerLM(cfg, comm, seed=7, partition=part)


def _prompts(cfg):
    g = rng_for(12, 0)
    return [g.integers(0, cfg.vocab_size, int(n)).tolist() for n in (5, 2, 7)]


def _world_case(comm):
    """generate with every setting, iter_generate's steps and logprobs, on this world; at world
    2, ranks passing different top_p are refused on every rank."""
    model = _model(comm)
    prompts = _prompts(model.config)
    out = model.generate(prompts, 10, seed=1234, **FULL)
    stream = model.iter_generate(prompts, 10, seed=1234, logprobs=3, **FULL)
    steps = [ids.tolist() for ids in stream]
    lps = [[(t.token, t.logprob, [i for i, _ in t.top]) for t in row] for row in stream.logprobs]
    refused = None
    if comm.size == 2:
        try:
            model.generate(prompts, 3, temperature=1.0, top_p=0.5 + 0.1 * comm.rank)
        except ValueError as e:
            refused = str(e)
    return [o.tolist() for o in out], steps, lps, refused


def test_same_seed_same_tokens_at_every_world_size():
    """world 1, 2 and 3 (uneven heads): the same sampled tokens for the same seed, with every
    filter and penalty; iter_generate's steps are generate's tokens; logprobs agree."""
    res = {w: run(_world_case, w) for w in (1, 2, 3)}
    out, steps, lps, _ = res[1][0]
    for w, ranks in res.items():
        for r, (o, st, lp, refused) in enumerate(ranks):
            assert o == out and st == steps, (w, r)
            assert [[(t, k) for t, _, k in row] for row in lp] == [[(t, k) for t, _, k in row] for row in lps]
            np.testing.assert_allclose([v for row in lp for _, v, _ in row], [v for row in lps for _, v, _ in row],
                                       rtol=0, atol=1e-4)  # (the float32 logits of another world: rounding)
            if w == 2:
                assert refused and "top_p differs across ranks" in refused, refused
    prompts = _prompts(tpcore.Config(**LLAMA))
    for b, p in enumerate(prompts):
        assert out[b][:len(p)] == p and [s[b] for s in steps] == out[b][len(p):]
    assert len({tuple(o[len(p):]) for o, p in zip(out, prompts)}) == 3


def test_generate_settings_and_defaults_single_rank():
    """generate on one rank: top_k=100000 clamped (= no top-k), bad settings named, the
    model's generation_config as defaults, sampling= given whole, greedy penalties change the
    argmax path, and a stream whose cache is taken is refused."""
    res = run(_single_case, 1)[0]
    assert res == "ok", res


def _single_case(comm):
    model = _model(comm)
    p = _prompts(model.config)[:2]
    a = model.generate(p, 8, temperature=0.9, seed=3, top_k=100000)
    b = model.generate(p, 8, temperature=0.9, seed=3)
    assert np.array_equal(a, b) if isinstance(a, np.ndarray) else all(np.array_equal(x, y) for x, y in zip(a, b))
    for kw, exc, name in ((dict(temperature=float("nan")), ValueError, "temperature"),
                          (dict(top_p=0.0), ValueError, "top_p"), (dict(top_p=1.01), ValueError, "top_p"),
                          (dict(repetition_penalty=-1.0), ValueError, "repetition_penalty"),
                          (dict(presence_penalty=9.0), ValueError, "presence_penalty"),
                          (dict(min_p="0.1"), TypeError, "min_p"), (dict(top_k=-5), ValueError, "top_k")):
        try:
            model.generate(p, 2, **kw)
            return f"{kw} accepted"
        except exc as e:
            if not str(e).startswith(f"generate: {name} must be"):
                return f"{kw}: {e}"
    try:
        model.generate(p, 2, sampling=SamplingParams(), temperature=1.0)
        return "sampling with temperature accepted"
    except TypeError as e:
        assert "either sampling or the settings temperature" in str(e), e
    greedy = [x.tolist() for x in model.generate(p, 8, temperature=0.0)]
    pen = [x.tolist() for x in model.generate(p, 8, temperature=0.0, repetition_penalty=2.0,
                                              frequency_penalty=2.0)]
    assert greedy != pen, "penalties changed nothing in greedy decoding"
    model.generation_config = {"do_sample": True, "temperature": 0.8, "top_k": 5, "top_p": 0.9}
    dflt = [x.tolist() for x in model.generate(p, 8, seed=4)]
    expl = [x.tolist() for x in model.generate(p, 8, sampling=SamplingParams(temperature=0.8, top_k=5,
                                                                             top_p=0.9, seed=4))]
    assert dflt == expl and dflt != greedy, (dflt, expl, greedy)
    assert [x.tolist() for x in model.generate(p, 8, temperature=0.0)] == greedy
    model.generation_config = {"do_sample": False, "temperature": 0.8}
    assert [x.tolist() for x in model.generate(p, 8, seed=4)] == greedy
    model.generation_config = {}
    s = model.iter_generate(p, 5)
    next(s)
    model.generate(p, 2)
    try:
        next(s)
        return "a stream whose cache was reallocated went on"
    except RuntimeError as e:
        assert "KV cache was reallocated" in str(e)
    s = model.iter_generate(p, 5)
    first = next(s)
    s.close()
    assert list(s) == [] and first.shape == (2,) and s.steps == 1
    return "ok"
