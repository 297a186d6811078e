"""tpcore.PipelineLM: pipeline stages over the PP group of a ProcessGrid.  Every training step at
TP x PP x DP grids, under both schedules, against the single-process TransformerLM on the whole
batch (losses and every parameter after several optimizer steps); greedy generate and logits
against world 1; the stage cuts; the schedules' in-flight micro-batches; bad and mismatched
arguments refused on every rank; a stage that dies named by the others."""
import os
import time

import numpy as np
import pytest

import tpcore
from conftest import BF16, rng_for, run

LLAMA = dict(vocab_size=41, hidden=24, layers=3, heads=4, kv_heads=2, head_dim=6, ffn_hidden=40, norm="rmsnorm",
             activation="swiglu", positions="rope", bias=False, max_positions=32, model_type="llama",
             tie_embeddings=False)
# GPT-2 style: learned positions, LayerNorm, GELU, biases and the LM head tied to the token embedding
# (the first and the last stage each hold a copy, their gradients summed every step)
GPT2 = dict(vocab_size=37, hidden=16, layers=4, heads=4, head_dim=4, ffn_hidden=28, norm="layernorm",
            activation="gelu", positions="learned", bias=True, max_positions=24, model_type="gpt2",
            tie_embeddings=True)
MODELS = {"llama": LLAMA, "gpt2": GPT2}
B, T, STEPS = 5, 6, 3


def _optimizer(model, params):
    # AdamW for Llama; SGD for GPT-2, whose key bias has a gradient that is zero but for rounding
    # (softmax ignores a shift shared by all keys), which Adam's normalisation would amplify into
    # steps of lr in rounding-dependent directions
    if model == "llama":
        return tpcore.optim.AdamW(params, lr=0.02, weight_decay=0.01)
    return tpcore.optim.SGD(params, lr=0.1, momentum=0.9)


def _batch(model):
    g = rng_for(97, 0)  # the same global batch on every rank
    V = MODELS[model]["vocab_size"]
    tokens = g.integers(0, V, (B, T))
    targets = g.integers(0, V, (B, T))
    targets[1, 2:] = -100      # ignored targets: micro-batches weigh by their counted targets
    targets[3, :] = -100
    return tokens, targets


def _reference(comm, model):
    """The whole batch on one process: loss(), backward(), AdamW, STEPS times."""
    m = tpcore.models.TransformerLM(tpcore.Config(**MODELS[model]), comm, seed=11)
    opt = _optimizer(model, m)
    tokens, targets = _batch(model)
    losses = []
    for _ in range(STEPS):
        losses.append(m.loss(tokens, targets))
        m.backward()
        opt.step()
        m.zero_grad()
    sd = {k: np.asarray(v).copy() for k, v in m.state_dict_full().items()}
    return losses, sd


def _pipeline(comm, model, tp, pp, dp, schedule, micro, stages=None):
    grid = tpcore.ProcessGrid(comm, tp=tp, pp=pp, dp=dp)
    m = tpcore.PipelineLM(tpcore.Config(**MODELS[model]), grid, stages=stages, seed=11)
    opt = _optimizer(model, m)
    tokens, targets = _batch(model)
    # DP: the replicas split the batch; with no ignored targets in a share the mean of the shares'
    # means is the batch mean only when the shares count the same targets, so each replica's loss
    # is weighted by its count and the gradients scaled to match (what DP frameworks do with
    # per-token losses)
    cuts = np.linspace(0, B, dp + 1).round().astype(int)
    a, b = cuts[grid.dp_rank], cuts[grid.dp_rank + 1]
    mine = (targets[a:b] != -100).sum()
    counts = grid.dp.all_gather(np.array([mine], np.int64))
    share = float(mine) / float(counts.sum()) * dp
    losses, stats = [], []
    for _ in range(STEPS):
        loss = m.train_step(tokens[a:b], targets[a:b], micro_batches=min(micro, b - a), schedule=schedule)
        losses.append(float(grid.dp.all_reduce(np.array([loss * share / dp]))[0]))
        for _, g in m.parameters():
            g *= share
        grid.average_gradients(m)
        opt.step()
        m.zero_grad()
        stats.append(dict(m.last_stats))
    sd = {k: np.asarray(v).copy() for k, v in m.state_dict_full().items()}
    m.close()
    grid.close()
    return losses, sd, stats


_REF = {}


def _ref(model):
    if model not in _REF:
        _REF[model] = run(_reference, 1, model)[0]
    return _REF[model]


@pytest.mark.parametrize("model,tp,pp,dp,schedule,micro", [
    ("llama", 1, 2, 1, "gpipe", 3), ("llama", 1, 2, 1, "1f1b", 3), ("gpt2", 1, 2, 1, "1f1b", 5),
    ("gpt2", 2, 2, 1, "1f1b", 2), ("llama", 2, 2, 1, "gpipe", 4), ("gpt2", 1, 2, 2, "gpipe", 2),
    ("llama", 1, 2, 2, "1f1b", 3), ("gpt2", 2, 1, 2, "1f1b", 2), ("llama", 1, 1, 4, "gpipe", 1),
    ("gpt2", 1, 4, 1, "1f1b", 3), ("llama", 1, 3, 1, "1f1b", 5), ("gpt2", 1, 3, 1, "gpipe", 2),
    ("gpt2", 3, 1, 1, "gpipe", 2)])
def test_training_equals_one_process(model, tp, pp, dp, schedule, micro):
    ref_losses, ref_sd = _ref(model)
    res = run(_pipeline, tp * pp * dp, model, tp, pp, dp, schedule, micro)
    held = set()
    for r, (losses, sd, _) in enumerate(res):
        assert np.allclose(losses, ref_losses, rtol=1e-5, atol=1e-6), (r, losses, ref_losses)
        for k, v in sd.items():
            assert np.allclose(v, ref_sd[k], rtol=1e-4, atol=2e-5), (r, k, float(np.abs(v - ref_sd[k]).max()))
        held |= set(sd)
    assert held == set(ref_sd)  # the stages together hold the whole model


def test_uneven_stages_with_an_empty_first_stage():
    ref_losses, ref_sd = _ref("gpt2")
    res = run(_pipeline, 3, "gpt2", 1, 3, 1, "1f1b", 3, [0, 3, 1])
    assert set(res[0][1]) == {"wte.weight", "wpe.weight"}     # embeddings only
    assert {k.split(".")[1] for k in res[1][1] if k.startswith("blocks.")} == {"0", "1", "2"}
    for losses, sd, _ in res:
        assert np.allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
        for k, v in sd.items():
            assert np.allclose(v, ref_sd[k], rtol=1e-4, atol=2e-5), k


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_hold_what_they_promise(schedule):
    """GPipe holds every micro-batch's input on every stage; 1F1B at most P - s on stage s, and its
    last stage never re-runs a forward."""
    P, M = 4, 3  # (every micro-batch of _batch has counted targets at M = 3)
    res = run(_pipeline, P, "gpt2", 1, P, 1, schedule, M)
    for s, (_, _, stats) in enumerate(res):
        st = stats[-1]
        assert st["schedule"] == schedule and st["micro_batches"] == M and st["stage"] == s
        if schedule == "gpipe":
            assert st["peak_inputs"] == M
            assert st["recomputes"] == M - 1       # all but the last forward's context
        else:
            assert st["peak_inputs"] == min(P - s, M)
            assert st["recomputes"] == (0 if s == P - 1 else M)
        assert 0 <= st["wait_s"] <= st["step_s"]
        # activations forward (not from the last stage) and gradients backward (not from the first)
        per = B * T * GPT2["hidden"] * 4
        assert st["sent_bytes"] == per * ((s < P - 1) + (s > 0))


def _generate(comm, model, tp, pp, prompts, kw):
    grid = tpcore.ProcessGrid(comm, tp=tp, pp=pp)
    if pp == 1:
        m = tpcore.models.TransformerLM(tpcore.Config(**MODELS[model]), grid.tp, seed=11)
    else:
        m = tpcore.PipelineLM(tpcore.Config(**MODELS[model]), grid, seed=11)
    out = m.generate(prompts, **kw)
    tokens = _batch(model)[0]
    logits = m.logits(tokens)
    return [np.asarray(o).tolist() for o in out], logits


@pytest.mark.parametrize("model,tp,pp", [("gpt2", 1, 2), ("llama", 1, 3), ("gpt2", 2, 2), ("gpt2", 1, 4)])
def test_generate_and_logits_equal_world_1(model, tp, pp):
    g = rng_for(5, 1)
    V = MODELS[model]["vocab_size"]
    prompts = [g.integers(0, V, n).tolist() for n in (3, 7, 1)]
    kw = dict(max_new_tokens=6)
    want, want_logits = run(_generate, 1, model, 1, 1, prompts, kw)[0]
    for got, logits in run(_generate, tp * pp, model, tp, pp, prompts, kw):
        assert got == want
        assert np.allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
    # an end-of-sequence id stops a sequence (pads after it), as at world 1
    kw = dict(max_new_tokens=5, eos_token_id=want[0][3], pad_token_id=0)
    want_eos = run(_generate, 1, model, 1, 1, prompts, kw)[0][0]
    for got, _ in run(_generate, tp * pp, model, tp, pp, prompts, kw):
        assert got == want_eos


def test_stage_partition():
    assert tpcore.stage_partition(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert tpcore.stage_partition(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert tpcore.stage_partition(5, 2, [0, 5]) == [(0, 0), (0, 5)]
    with pytest.raises(ValueError, match="every stage needs a block"):
        tpcore.stage_partition(2, 3)
    with pytest.raises(ValueError, match="sum to 4"):
        tpcore.stage_partition(5, 2, [2, 2])
    with pytest.raises(ValueError, match="3 entries"):
        tpcore.stage_partition(5, 2, [2, 2, 1])
    with pytest.raises((TypeError, ValueError)):
        tpcore.stage_partition(5, 2, [6, -1])
    with pytest.raises(TypeError):
        tpcore.stage_partition(5, 2, "23")


def _stage_steps(comm):
    """A whole model's loss and gradients, and the same from TransformerLM's stage steps driven by
    hand over the model cut in two (tied embeddings: the two copies' gradients add up)."""
    cfg = tpcore.Config(**GPT2)
    tokens, targets = _batch("gpt2")
    whole = tpcore.models.TransformerLM(cfg, comm, seed=5)
    want = whole.loss(tokens, targets)
    whole.backward()
    first = tpcore.models.TransformerLM(cfg, comm, seed=5, stage=(0, 2, True, False))
    last = tpcore.models.TransformerLM(cfg, comm, seed=5, stage=(2, 4, False, True))
    toks, pos, mask = first.check_inputs(tokens)
    h = last.run_blocks(first.run_blocks(first.embed(toks, pos), need_backward=True), need_backward=True)
    got = last.head_loss(h, targets)
    first.embed_backward(first.blocks_backward(last.blocks_backward(last.head_backward())), pos)
    pairs = [(whole.wte.grad_weight, first.wte.grad_weight + last.wte.grad_weight), (whole.wpe_grad, first.wpe_grad)]
    for wb, sb in zip(whole.blocks, first.blocks + last.blocks):
        pairs += [(g, h) for (_, g), (_, h) in zip(wb.parameters(), sb.parameters())]
    pairs += [(g, h) for (_, g), (_, h) in zip(whole.final_norm.parameters(), last.final_norm.parameters())]
    refused = []
    for bad in [(0, 5, True, True), (3, 2, True, True), (0, 1, 1, True), "0:2"]:
        try:
            tpcore.models.TransformerLM(cfg, comm, stage=bad)
        except (TypeError, ValueError) as e:
            refused.append(f"{type(e).__name__}: {e}")
    return want, got, max(float(np.abs(a - b).max()) for a, b in pairs), mask, refused


def test_stage_steps_are_the_whole_models_loss_and_backward():
    want, got, grad_diff, mask, refused = run(_stage_steps, 1)[0]
    assert abs(want - got) <= 1e-6 * abs(want) and grad_diff < 1e-5, (want, got, grad_diff)
    assert mask is None
    assert len(refused) == 4 and all("stage" in m for m in refused), refused


def _bad(comm, case):
    grid = tpcore.ProcessGrid(comm, pp=comm.size)
    cfg = tpcore.Config(**GPT2)
    try:
        if case == "stages_disagree":
            tpcore.PipelineLM(cfg, grid, stages=[2, 2] if comm.rank == 0 else [1, 3])
            return "no error"
        if case == "not_a_grid":
            tpcore.PipelineLM(cfg, comm)
            return "no error"
        m = tpcore.PipelineLM(cfg, grid, seed=1)
        tokens, targets = _batch("gpt2")
        if case == "tokens_differ":
            if comm.rank == 1:
                tokens = tokens.copy()
                tokens[0, 0] = (tokens[0, 0] + 1) % GPT2["vocab_size"]
            m.train_step(tokens, targets, micro_batches=2)
        elif case == "too_many_micro_batches":
            m.train_step(tokens, targets, micro_batches=B + 1)
        elif case == "schedule":
            m.train_step(tokens, targets, schedule="interleaved")
        elif case == "targets_shape":
            m.train_step(tokens, targets[:, :-1])
        elif case == "token_out_of_vocab":
            tokens = tokens.copy()
            tokens[2, 1] = GPT2["vocab_size"]
            m.train_step(tokens, targets)
        elif case == "prompts_differ":
            m.generate([[1, 2, 3 + comm.rank]], max_new_tokens=2)
        # after a refused call every rank is still in step: a real step works
        loss = m.train_step(tokens, targets, micro_batches=2)
        return f"no error (loss {loss})"
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("case,words", [
    ("stages_disagree", "the stages differ"), ("not_a_grid", "must be a tpcore.ProcessGrid"),
    ("tokens_differ", "the tokens differ"), ("too_many_micro_batches", "micro_batches"),
    ("schedule", "'gpipe'"), ("targets_shape", "targets must have shape"),
    ("token_out_of_vocab", "vocab"), ("prompts_differ", "the prompts differ")])
def test_bad_arguments_are_refused_on_every_rank(case, words):
    for r, msg in enumerate(run(_bad, 2, case, deadline=120)):
        assert "no error" not in msg and words in msg, (r, msg)


def _dies(comm, outdir):
    grid = tpcore.ProcessGrid(comm, pp=comm.size)
    m = tpcore.PipelineLM(tpcore.Config(**GPT2), grid, seed=1)
    tokens, targets = _batch("gpt2")
    m.train_step(tokens, targets, micro_batches=3)
    if comm.rank == 1:  # stage 1 dies in the middle of the next step: at its first backward
        m.stage.blocks_backward = lambda *a, **kw: os._exit(9)
    t = time.monotonic()
    try:
        m.train_step(tokens, targets, micro_batches=3)
        msg = "no error"
    except tpcore.CommError as e:
        msg = f"{type(e).__name__}: {e}"
    with open(os.path.join(outdir, f"rank{comm.rank}"), "w") as f:
        f.write(f"{time.monotonic() - t:.1f}\n{msg}")


def test_a_stage_that_dies_is_named_by_the_others(tmp_path):
    with pytest.raises(tpcore.RankExitedError) as info:
        run(_dies, 3, str(tmp_path), deadline=120, timeout=20)
    assert info.value.rank == 1 and info.value.exitcode == 9
    for r in (0, 2):
        secs, msg = (tmp_path / f"rank{r}").read_text().split("\n", 1)
        assert float(secs) < 20 and "rank 1" in msg, msg


def _lowp(comm, pp, dtype):
    grid = tpcore.ProcessGrid(comm, pp=pp)
    cfg = tpcore.Config(**GPT2)
    if pp == 1:
        m = tpcore.models.TransformerLM(cfg, comm, seed=3, dtype=dtype)
    else:
        m = tpcore.PipelineLM(cfg, grid, seed=3, dtype=dtype)
    out = m.generate([[1, 2, 3], [5]], max_new_tokens=5)
    tokens, targets = _batch("gpt2")
    if pp == 1:
        loss = m.loss(tokens, targets)
        m.backward()
    else:
        loss = m.train_step(tokens, targets, micro_batches=2)
    return [np.asarray(o).tolist() for o in out], loss


@pytest.mark.skipif(BF16 is None, reason="needs ml_dtypes")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_weights_through_the_stages(dtype):
    want_tokens, want_loss = run(_lowp, 1, 1, dtype)[0]
    for tokens, loss in run(_lowp, 2, 2, dtype):
        assert tokens == want_tokens
        assert np.isclose(loss, want_loss, rtol=1e-5)


def _bad_logits(comm, seed):
    """The last stage's logits of one sequence spoiled (NaN, +inf or all -inf) at one step: every
    stage raises the ValueError naming the sequence and the step (the last stage broadcasts what
    it found instead of tokens), then the pipeline still generates."""
    grid = tpcore.ProcessGrid(comm, pp=comm.size)
    m = tpcore.PipelineLM(tpcore.Config(**LLAMA), grid, seed=11)
    g = rng_for(seed, 0)
    prompts = [g.integers(0, LLAMA["vocab_size"], int(n)).tolist() for n in g.integers(1, 6, 3)]
    row, step, kind = int(g.integers(3)), int(g.integers(0, 4)), int(g.integers(3))
    if m.last:
        real, calls = m.stage.gather_logits, []

        def spoiled(shard):
            logits = np.array(real(shard))
            calls.append(1)
            if len(calls) == step + 1:
                logits[row] = -np.inf if kind == 2 else logits[row]
                logits[row, int(g.integers(logits.shape[1]))] = (np.nan, np.inf, -np.inf)[kind]
            return logits
        m.stage.gather_logits = spoiled
    try:
        m.generate(prompts, max_new_tokens=5)
        msg = "no error"
    except ValueError as e:
        msg = str(e)
    if m.last:
        m.stage.gather_logits = real
    out = m.generate(prompts, max_new_tokens=2)
    return msg, row, step, ("hold NaN", "hold +inf", "are all -inf")[kind], len(out)


@pytest.mark.parametrize("world", [2, 3])
def test_nan_logits_are_refused_on_every_stage(world):
    seed = int(np.random.default_rng().integers(2 ** 31))
    for r, (msg, row, step, what, n) in enumerate(run(_bad_logits, world, seed)):
        assert f"the logits of sequence {row} at step {step} {what}" in msg and n == 3, (r, seed, msg)
