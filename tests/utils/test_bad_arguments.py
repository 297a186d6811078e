"""Careless calls get clear errors: each bad argument raises
TypeError (wrong kind) or ValueError (bad value) naming the argument, what was expected and
what came; bool never passes as an int; arguments that differ across ranks (generate's
prompts and settings, pos0) make every rank raise a ValueError, and the communicator keeps
working afterwards."""
import numpy as np
import pytest

import tpcore
from conftest import run

TINY = dict(vocab_size=50, hidden=16, layers=2, heads=2, ffn_hidden=24, max_positions=32)


class JunkDevice:
    """A producer whose __dlpack_device__ is not a pair of ints."""

    def __dlpack__(self, **kw):
        raise BufferError("never reached")

    def __dlpack_device__(self):
        return ("cpu", "zero")


def _check(cases):
    problems = []
    for i, (call, etype, words) in enumerate(cases):
        try:
            call()
            problems.append(f"case {i} {words}: no error")
        except etype as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                problems.append(f"case {i}: {type(e).__name__}({e}) lacks {missing}")
        except Exception as e:  # noqa: BLE001 - the error's type and text are what the test checks
            problems.append(f"case {i} {words}: {type(e).__name__} instead of {etype.__name__}: {e}")
    return problems


def _usable(comm):
    y = np.full(3, comm.rank + 1, np.int64)
    comm.all_reduce(y)
    return int(y[0]) == comm.size * (comm.size + 1) // 2


def _local_cases(comm):
    cfg = tpcore.Config(**TINY)
    model = tpcore.models.TransformerLM(cfg, comm)
    blk = model.blocks[0]
    tok = np.array([[1, 2, 3, 4]])
    x = np.ones(8, np.float32)
    lg = np.zeros((3, 5), np.float32)
    mutated = tpcore.Config(**TINY)
    mutated.eps = -1.0  # a Config is mutable: the layers check it again
    cases = [
        # item 11: unclear messages
        (lambda: comm.all_reduce(JunkDevice()), TypeError, ["x", "__dlpack_device__", "pair of integers", "'cpu'"]),
        (lambda: tpcore.Config(**dict(TINY, max_positions=-1)), ValueError, ["max_positions", ">= 1", "-1"]),
        (lambda: model.forward(tok, pos0=[0, 1]), ValueError, ["pos0", "(1,)", "(2,)"]),
        (lambda: blk(np.ones((1, 4, 16), np.float32), pos0=[0, 1, 2]), ValueError, ["pos0", "(1,)", "(3,)"]),
        (lambda: model.forward(tok, attention_mask=np.ones((1, 3))), ValueError,
         ["attention_mask", "(1, 4)", "(1, 3)"]),
        (lambda: blk(np.ones((1, 4, 16), np.float32), key_mask=np.ones(5)), ValueError, ["key_mask", "(1, 4)", "(5,)"]),
        (lambda: model.generate(tok, max_new_tokens=-1), ValueError, ["max_new_tokens", "[0, 2147483647]", "-1"]),
        (lambda: model.generate(tok, max_new_tokens=2, temperature=1.0, top_k=-2), ValueError,
         ["top_k", "an integer >= 1 (0, -1 or None: no top-k filtering", "-2"]),
        (lambda: model.generate(tok, max_new_tokens=2, temperature=1.0, top_p=1.5), ValueError,
         ["top_p", "> 0 and <= 1", "1.5"]),
        (lambda: model.generate(tok, max_new_tokens=2, repetition_penalty=0.0), ValueError,
         ["repetition_penalty", "> 0", "0.0"]),
        (lambda: model.cache(-1, 4), ValueError, ["TransformerLM.cache", "batch", "[1, 2147483647]", "-1"]),
        (lambda: model.cache(0, 4), ValueError, ["TransformerLM.cache", "batch", "[1, 2147483647]", "0"]),
        (lambda: model.cache(1, -4), ValueError, ["TransformerLM.cache", "max_len", "[1, 2147483647]", "-4"]),
        (lambda: tpcore.models.TransformerLM(cfg, comm, seed=-1), ValueError, ["seed", "[0, 2**64)", "-1"]),
        (lambda: tpcore.models.TransformerLM(cfg, comm, seed=1.5), TypeError, ["seed", "[0, 2**64)", "1.5"]),
        (lambda: model.generate(tok, seed=2 ** 64), ValueError, ["seed", "[0, 2**64)"]),
        # item 12: silently accepted before
        (lambda: tpcore.Config(**dict(TINY, eps=-1e-5)), ValueError, ["eps", ">= 0", "-1e-05"]),
        (lambda: tpcore.Config(**dict(TINY, eps=float("nan"))), ValueError, ["eps", "nan"]),
        (lambda: comm.all_gather(x, axis=True), TypeError, ["axis", "True", "bool"]),
        (lambda: comm.all_gather(x, axis=False), TypeError, ["axis", "False", "bool"]),
        (lambda: comm.reduce_scatter(np.ones(2 * comm.size, np.float32), axis=False), TypeError, ["axis", "bool"]),
        (lambda: comm.broadcast(x, root=True), TypeError, ["root", "bool"]),
        (lambda: comm.all_gather(x[:1], sizes=[True] * comm.size), TypeError, ["sizes", "True"]),
        # beyond the list: wrong kinds, NaN, bad shapes and flags
        (lambda: comm.all_gather(np.ones((2, 3), np.float32), axis=1,
                                 out=np.frombuffer(bytes(24 * comm.size), np.float32).reshape(2, 3 * comm.size)),
         ValueError, ["out", "read-only"]),
        (lambda: comm.all_gather(np.ones((2, 3), np.float32), axis=1, out=np.ones((2, 3 * comm.size))), TypeError,
         ["out", "float64", "float32"]),
        (lambda: comm.alloc(2.5), TypeError, ["shape", "2.5"]),
        (lambda: comm.alloc(True), TypeError, ["shape", "bool"]),
        (lambda: setattr(comm, "timeout", "soon"), TypeError, ["timeout", "'soon'"]),
        (lambda: tpcore.partition(True, 2), TypeError, ["n", "bool"]),
        (lambda: tpcore.partition(4, 2, weights="ab"), TypeError, ["weights"]),
        (lambda: tpcore.set_num_threads(2.5), TypeError, ["n", "2.5"]),
        (lambda: tpcore.ColumnParallelLinear(4, 4 * comm.size, comm, bias="no"), TypeError, ["bias", "'no'"]),
        (lambda: tpcore.ColumnParallelLinear(4, 4, comm, partition=[(1, 4)] + [(5, 0)] * (comm.size - 1)),
         ValueError, ["partition", "offset"]),
        (lambda: tpcore.VocabParallelCrossEntropy(comm, ignore_index=None), TypeError, ["ignore_index", "None"]),
        (lambda: tpcore.vocab_parallel_cross_entropy(lg, np.zeros(3, np.int64), comm, vocab_offset=True),
         TypeError, ["vocab_offset", "bool"]),
        (lambda: tpcore.VocabParallelEmbedding(50, 4, comm)(np.array([2 ** 63 + 5], np.uint64)), ValueError,
         ["tokens", "int64"]),
        (lambda: tpcore.optim.AdamW(model, lr=float("nan")), ValueError, ["lr", "nan"]),
        (lambda: tpcore.optim.AdamW(model, betas=0.9), TypeError, ["betas", "0.9"]),
        (lambda: tpcore.optim.SGD(model, momentum=float("nan")), ValueError, ["momentum", "nan"]),
        (lambda: tpcore.optim.SGD([model.wte, model.wte]), ValueError, ["same array"]),
        (lambda: tpcore.Config(**dict(TINY, hidden=16.0)), TypeError, ["hidden", "16.0"]),
        (lambda: tpcore.Config(**dict(TINY, heads=0)), ValueError, ["heads", ">= 1", "0"]),
        (lambda: tpcore.Config(**dict(TINY, causal="no")), TypeError, ["causal", "True or False"]),
        (lambda: tpcore.models.TransformerLM(dict(TINY), comm), TypeError, ["config", "dict"]),
        (lambda: model.forward(tok, pos0=[1.5]), TypeError, ["pos0", "float64"]),
        (lambda: model.forward(tok, pos0=[-1]), ValueError, ["pos0", ">= 0", "-1"]),
        (lambda: model.forward(tok, token_type_ids=np.zeros((1, 4), np.int64)), ValueError,
         ["token_type_ids", "type_vocab_size=0"]),
        (lambda: model.generate(np.array([[1.0, 2.0]])), TypeError, ["prompts", "float64"]),
        (lambda: model.generate(np.ones((1, 2, 2), np.int64)), ValueError, ["prompts", "(1, 2, 2)"]),
        (lambda: model.generate("hello"), TypeError, ["prompts", "'hello'"]),
        (lambda: model.generate([[1, 2], [60]]), ValueError, ["prompt 1", "60", "vocab_size=50"]),
        (lambda: model.generate(tok, max_new_tokens=1.5), TypeError, ["max_new_tokens", "1.5"]),
        (lambda: model.generate(tok, max_new_tokens=True), TypeError, ["max_new_tokens", "bool"]),
        (lambda: model.generate(tok, temperature=float("nan")), ValueError, ["temperature", "nan"]),
        (lambda: model.generate(tok, temperature=-1.0), ValueError, ["temperature", ">= 0"]),
        (lambda: model.generate(tok, temperature=1.0, seed="1"), TypeError, ["seed", "'1'"]),
        (lambda: model.generate(tok, top_k=True), TypeError, ["top_k", "bool"]),
        (lambda: model.generate(tok, eos_token_id=1.5), TypeError, ["eos_token_id", "1.5"]),
        (lambda: model.generate(tok, eos_token_id=3, pad_token_id=-5), ValueError, ["pad_token_id", "-5"]),
        (lambda: model.loss(tok, np.ones((1, 4))), TypeError, ["targets", "float64"]),
        (lambda: model.forward(tok, attention_mask=np.array([["a"] * 4])), TypeError, ["attention_mask", "dtype"]),
        (lambda: tpcore.ColumnParallelLinear(True, 4, comm), TypeError, ["in_features", "bool"]),
        (lambda: tpcore.ParallelMLP(8, 16, comm, activation=None), TypeError, ["activation", "None"]),
        (lambda: tpcore.TransformerBlock(mutated, comm), ValueError, ["eps", "-1"]),
        (lambda: tpcore.init(spin_us=-5), ValueError, ["spin_us", "-5"]),
        (lambda: tpcore.init(timeout="soon"), TypeError, ["timeout", "'soon'"]),
    ]
    if comm.size > 1:
        cases.append((lambda: comm.recv(np.frombuffer(bytes(16), np.float32), (comm.rank + 1) % comm.size),
                      ValueError, ["recv", "read-only"]))
    problems = _check(cases)
    model.cache(1, 8)
    problems += _check([(lambda: model.forward(tok, pos0=[3], use_cache=True), ValueError,
                         ["pos0[0] = 3", "0 tokens cached"])])
    model.loss(tok, np.array([[2, 3, 4, 5]]))
    problems += _check([(lambda: model.backward("a"), TypeError, ["dloss", "'a'"]),
                        (lambda: model.backward(float("inf")), ValueError, ["dloss", "inf"])])
    if not _usable(comm):
        problems.append("communicator unusable after the bad calls")
    # and the model still works: greedy generation equals the reference of a fresh model
    got = model.generate(tok, max_new_tokens=3)
    want = tpcore.models.TransformerLM(cfg, comm).generate(tok, max_new_tokens=3)
    if not np.array_equal(got, want):
        problems.append(f"generate after the errors gave {got}, expected {want}")
    return problems


@pytest.mark.parametrize("world", [1, 2])
def test_bad_arguments_name_argument_expected_and_got(world):
    for r, problems in enumerate(run(_local_cases, world)):
        assert not problems, f"rank {r}: " + "; ".join(problems)


def test_spawn_arguments_checked_before_any_rank_starts():
    with pytest.raises(ValueError, match="world_size.*True"):
        tpcore.spawn(_usable, True)
    with pytest.raises(ValueError, match="timeout.*-1"):
        tpcore.spawn(_usable, 1, timeout=-1)
    with pytest.raises(TypeError, match="args"):
        tpcore.spawn(_usable, 1, args=5)


# ------------------------------------------------------------------ across ranks

def _differing(comm):
    """Every rank must raise ValueError naming what differs; the comm keeps working."""
    cfg = tpcore.Config(**TINY)
    model = tpcore.models.TransformerLM(cfg, comm)
    last = comm.rank == comm.size - 1
    tok = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    out = {}

    def attempt(key, call):
        try:
            call()
            out[key] = "no error"
        except ValueError as e:
            out[key] = str(e)
        out[key + " usable"] = _usable(comm)

    attempt("prompts", lambda: model.generate(tok + (1 if last else 0), max_new_tokens=2))
    attempt("lengths", lambda: model.generate([[1, 2, 3]] if last else [[1, 2]], max_new_tokens=2))
    attempt("max_new_tokens", lambda: model.generate(tok, max_new_tokens=3 if last else 2))
    attempt("temperature", lambda: model.generate(tok, max_new_tokens=2, temperature=0.7 if last else 0.8))
    attempt("seed", lambda: model.generate(tok, max_new_tokens=2, temperature=1.0, seed=2 if last else 1))
    attempt("top_k", lambda: model.generate(tok, max_new_tokens=2, temperature=1.0, top_k=1000 if last else 5))
    attempt("top_p", lambda: model.generate(tok, max_new_tokens=2, temperature=1.0, top_p=1.5 if last else 0.9))
    model.cache(2, 8)
    model.forward(tok, use_cache=True)
    attempt("pos0", lambda: model.forward(tok[:, :1], pos0=[4, 3] if last else [4, 4], use_cache=True))
    attempt("decode tokens", lambda: model.forward(tok[:, :1] + (1 if last else 0), pos0=[4, 4], use_cache=True))
    blk = tpcore.TransformerBlock(cfg, comm)
    blk.cache(2, 8)
    blk(np.ones((2, 2, 16), np.float32), use_cache=True, need_backward=False)
    x = np.ones((2, 1, 16), np.float32)
    attempt("block pos0", lambda: blk(x, pos0=[2, 1] if last else [2, 2], use_cache=True,
                                        need_backward=False))
    # afterwards the same model generates the same tokens as a fresh one
    out["after"] = model.generate(tok, max_new_tokens=3).tolist()
    out["fresh"] = tpcore.models.TransformerLM(cfg, comm).generate(tok, max_new_tokens=3).tolist()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_arguments_that_differ_across_ranks_fail_every_rank(world):
    last = world - 1
    expect = {
        "prompts": ["generate: the prompts differ across ranks", f"rank 0 and rank {last}"],
        "lengths": ["generate: the prompts differ across ranks"],
        "max_new_tokens": ["max_new_tokens differs across ranks", f"rank 0 passed 2, rank {last} passed 3"],
        "temperature": ["temperature differs across ranks"],
        "seed": ["seed differs across ranks", f"rank 0 passed 1, rank {last} passed 2"],
        "top_k": ["top_k differs across ranks", f"rank 0 passed 5, rank {last} passed 1000"],  # (clamped later)
        "top_p": [],  # the last rank: its own error; the others: that it refused its arguments
        "pos0": ["pos0 differs across ranks", f"rank 0 and rank {last}"],
        "decode tokens": ["the tokens differ across ranks"],
        "block pos0": ["pos0 differs across ranks"],
    }
    results = run(_differing, world)
    for r, out in enumerate(results):
        for key, words in expect.items():
            assert out[key + " usable"], f"rank {r}: communicator unusable after {key}"
            msg = out[key]
            if key == "top_p":
                words = ["top_p", "1.5"] if r == last else [f"rank {last} refused its arguments"]
            for w in words:
                assert w in msg, f"rank {r}, {key}: {w!r} not in {msg!r}"
        assert out["after"] == out["fresh"], f"rank {r}: generation after the errors differs"
    assert len({str(o["after"]) for o in results}) == 1


def _decode_agrees(comm):
    """The same arguments on every rank pass the check (and decode at world N equals world 1)."""
    model = tpcore.models.TransformerLM(tpcore.Config(**TINY), comm)
    return model.generate([[1, 2, 3], [4, 5]], max_new_tokens=4, temperature=0.9, top_k=7, seed=5)


def test_same_arguments_pass_and_sample_alike():
    one = run(_decode_agrees, 1)[0]
    for got in run(_decode_agrees, 2):
        assert [g.tolist() for g in got] == [g.tolist() for g in one]


def _block_masks_differ(comm):
    cfg = tpcore.Config(vocab_size=11, hidden=8, layers=1, heads=2, max_positions=8)
    blk = tpcore.TransformerBlock(cfg, comm, seed=1)
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    mask = np.ones((2, 3), np.uint8)
    mask[1, comm.rank % 3] = 0  # a different padding mask on each rank
    try:
        blk.forward(x, pos0=[0, 0], key_mask=mask)
        return "no error"
    except ValueError as e:
        return str(e)


def test_block_key_masks_differing_across_ranks_fail_every_rank():
    for r, err in enumerate(run(_block_masks_differ, 2)):
        assert "key_mask differs across ranks" in err, (r, err)


def test_hand_set_job_ids_settle_and_random_ones_do_not():
    from tpcore.distributed import env as _env
    base = {"RANK": "0", "WORLD_SIZE": "2", "TPCORE_JOB_ID": "mine"}
    assert not _env.detect(base).unique
    assert _env.detect(dict(base, TPCORE_JOB_RANDOM="1")).unique
