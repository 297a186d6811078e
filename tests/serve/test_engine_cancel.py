"""What the HTTP front end needs of the Engine: cancel(request_id) (a waiting and a running
request cancelled between steps finish "cancelled" at the next step, their KV blocks freed, the others'
tokens still generate()'s; a cancel that differs across ranks refused on every rank; bad ids
refused) and submit(sampling=SamplingParams) (every setting, logprobs, equal to generate() with
the same settings), at world 1 and 2."""
import numpy as np
import pytest

import tpcore
from conftest import run

LLAMA = dict(vocab_size=101, hidden=24, layers=2, heads=6, kv_heads=2, ffn_hidden=36, norm="rmsnorm", eps=1e-6,
             activation="swiglu", positions="rope", rope_theta=1000.0, max_positions=64, causal=True, pre_norm=True,
             bias=False, tie_embeddings=False, model_type="llama")
PROMPTS = [[5, 9, 2, 7], [11, 3], [8, 8, 1, 4, 6], [2, 40, 17]]
SAMPLED = dict(temperature=0.8, top_p=0.9, top_k=30, min_p=0.01, repetition_penalty=1.3, presence_penalty=0.4,
               frequency_penalty=0.2, seed=77, logprobs=3)


def _cancel_case(comm):
    model = tpcore.models.TransformerLM(tpcore.Config(**LLAMA), comm, seed=5)
    want = [model.generate([np.array(p)], max_new_tokens=8, temperature=0.0, eos_token_id=-1)[0][len(p):]
            for p in PROMPTS]
    eng = tpcore.Engine(model, max_batch=2, max_len=32, eos_token_id=-1)
    reqs = [eng.submit(p, 8) for p in PROMPTS]
    eng.step()
    eng.step()                                   # 0 and 1 run, 2 and 3 wait
    assert eng.cancel(reqs[1].id) and eng.cancel(reqs[2].id)
    assert not eng.cancel(reqs[1].id)            # once is enough
    assert eng.stats()["used_blocks"] > 0 and (eng.waiting, eng.running) == (2, 2)  # until the next step
    done = eng.step()
    assert [(r.id, r.finish_reason) for r in done] == [(1, "cancelled"), (2, "cancelled")]
    finished = {r.id: r for r in done}
    while eng.waiting or eng.running:
        finished.update({r.id: r for r in eng.step()})
    assert [finished[i].finish_reason for i in range(4)] == ["length", "cancelled", "cancelled", "length"]
    for i in (0, 3):
        np.testing.assert_array_equal(finished[i].tokens, want[i])
    assert len(finished[1].tokens) < 8 and len(finished[2].tokens) == 0
    s = eng.stats()
    assert (s["cancelled"], s["used_blocks"], s["tracked"]) == (2, 0, 0)
    assert not eng.cancel(reqs[0].id)            # finished already
    for bad, err in ((99, ValueError), (-1, ValueError), ("1", TypeError)):
        with pytest.raises(err, match="Engine.cancel: (request must|no request)"):
            eng.cancel(bad)
    if comm.size > 1:
        r = eng.submit(PROMPTS[0], 4)
        if comm.rank == 0:                       # a cancel on one rank only: refused on every rank
            eng.cancel(r.id)
        with pytest.raises(ValueError, match="submitted or cancelled requests differ"):
            eng.step()
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_cancel(world):
    assert all(run(_cancel_case, world))


def _sampling_case(comm):
    from tpcore.models.sampling import SamplingParams
    model = tpcore.models.TransformerLM(tpcore.Config(**LLAMA), comm, seed=5)
    kw = {k: v for k, v in SAMPLED.items() if k != "logprobs"}
    want = [model.generate([np.array(p)], max_new_tokens=6, eos_token_id=-1, **kw)[0][len(p):] for p in PROMPTS]
    eng = tpcore.Engine(model, max_batch=3, max_len=32, eos_token_id=-1)
    reqs = [eng.submit(p, 6, sampling=SamplingParams(**SAMPLED)) for p in PROMPTS]
    list(eng.run())
    for r, w in zip(reqs, want):
        np.testing.assert_array_equal(r.tokens, w)
        assert [lp.token for lp in r.logprobs] == r.tokens.tolist() and all(len(lp.top) == 3 for lp in r.logprobs)
    with pytest.raises(TypeError, match="either as sampling= or as keywords"):
        eng.submit(PROMPTS[0], 2, temperature=0.5, sampling=SamplingParams())
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        eng.submit(PROMPTS[0], 2, sampling={"temperature": 0.5})
    return [r.tokens.tolist() for r in reqs]


def test_sampling_same_at_world_1_and_2():
    assert run(_sampling_case, 1)[0] == run(_sampling_case, 2)[0]


def _exchange_case(comm):
    from tpcore.serve.driver import HEADER, Driver
    model = tpcore.models.TransformerLM(tpcore.Config(**LLAMA), comm, seed=5)
    d = Driver(comm, tpcore.Engine(model, max_batch=1, max_len=16))
    got = []
    for n in (0, 1, HEADER - 16, HEADER - 15, 100_000):
        body = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
        kind, out = d._exchange(7 if comm.rank == 0 else 0, body if comm.rank == 0 else b"")
        got.append((kind, out == body, len(out)))
    return got


def test_the_step_message_reaches_every_rank_whole():
    """One header broadcast carries a short message; a longer one goes in a second (every size around
    the edge, and 100 kB)."""
    from tpcore.serve.driver import HEADER
    want = [(7, True, n) for n in (0, 1, HEADER - 16, HEADER - 15, 100_000)]
    assert run(_exchange_case, 2) == [want, want]
