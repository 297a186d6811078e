"""python -m tpcore.serve with a tiny Llama (tests/fixtures/llama and a character tokenizer), at
world 1, 2 and 3: the `openai` client gets generate()'s tokens (chat and completions, streamed
and not); 32 concurrent streaming clients each get their own right text; stop strings end the
text where they start (never sent, matched across tokens and chunks); logprobs (chat and
completions forms) equal the float64 log-softmax of the model's own logits of the sequence;
every sampling setting reaches the engine: a seeded sampled request gets generate()'s tokens
with the same settings (the same at every world size)."""
import threading

import numpy as np
import pytest

import tpcore
from openai_server_common import TEMPLATE, Server, reference, render, tiny_model

openai = pytest.importorskip("openai")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

NAME = "tiny"
NEW = 20
TEXTS = ["Hello", "The sky is", "abc", "1 2 3", "x = ", "Once upon", "q", "Tokens!"]
CHATS = [[{"role": "user", "content": "Hi!"}], [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Why?"}]]


@pytest.fixture(scope="module", params=[1, 2, pytest.param(3, marks=pytest.mark.slow)])
def tiny(request, tmp_path_factory):
    from tokenizers import Tokenizer
    world = request.param
    path = tiny_model(str(tmp_path_factory.mktemp("tiny")))
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    text_ids = [tok.encode(t).ids for t in TEXTS]
    chat_ids = [tok.encode(render(TEMPLATE, c), add_special_tokens=False).ids for c in CHATS]
    ref = reference(path, text_ids + chat_ids, NEW, world)
    server = Server(path, "--served-model-name", NAME, "--max-batch", "4", n=world)
    dec = [(tok.decode(t), f, len(t), t) for t, f in ref]
    yield dict(server=server, world=world, path=path, tok=tok, ref_text=dec[:len(TEXTS)], ref_chat=dec[len(TEXTS):],
               text_ids=text_ids, chat_ids=chat_ids)
    server.close()


def _client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_tokens_are_generates(tiny):
    c = _client(tiny["server"])
    for i in range(3):
        want, finish, n, _ = tiny["ref_text"][i]
        r = c.completions.create(model=NAME, prompt=TEXTS[i], max_tokens=NEW, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (want, finish, n)
        assert r.usage.prompt_tokens == len(tiny["text_ids"][i])
        got = "".join(ch.choices[0].text for ch in c.completions.create(
            model=NAME, prompt=TEXTS[i], max_tokens=NEW, temperature=0, stream=True))
        assert got == want
    # without max_tokens: the rest of the context (64 tokens)
    r = c.completions.create(model=NAME, prompt="y" * 61, temperature=0, extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.choices[0].finish_reason) == (61, 3, "length")
    # a prompt of token ids is taken as it is
    r = c.completions.create(model=NAME, prompt=tiny["text_ids"][0], max_tokens=NEW, temperature=0)
    assert r.choices[0].text == tiny["ref_text"][0][0]
    for i, msgs in enumerate(CHATS):
        want, finish, n, _ = tiny["ref_chat"][i]
        r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=NEW, temperature=0)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, finish)
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tiny["chat_ids"][i]), n)
        chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=NEW, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        assert chunks[-1].usage.total_tokens == len(tiny["chat_ids"][i]) + n
    tiny["server"].wait_idle()


def test_32_concurrent_streams(tiny):
    s, got, errors = tiny["server"], {}, []

    def one(i):
        try:
            got[i] = "".join(ch.choices[0].text for ch in _client(s).completions.create(
                model=NAME, prompt=TEXTS[i % len(TEXTS)], max_tokens=NEW, temperature=0, stream=True))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert [got.get(i) for i in range(32)] == [tiny["ref_text"][i % len(TEXTS)][0] for i in range(32)]
    e = s.wait_idle()["engine"]
    assert e["peak_running"] == 4 and e["used_blocks"] == 0


def test_stop_strings(tiny):
    c = _client(tiny["server"])
    for i in range(len(TEXTS)):
        want = tiny["ref_text"][i][0]
        if len(want) >= 8:
            break
    stop = want[4:6]  # two characters: two tokens, matched across them
    cut = want[:want.find(stop)]
    r = c.completions.create(model=NAME, prompt=TEXTS[i], max_tokens=NEW, temperature=0, stop=[stop, "@@@@"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    got = "".join(ch.choices[0].text for ch in c.completions.create(
        model=NAME, prompt=TEXTS[i], max_tokens=NEW, temperature=0, stop=stop, stream=True))
    assert got == cut
    tiny["server"].wait_idle()


SAMPLED = dict(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.5,
               frequency_penalty=0.3, seed=1234)


def test_sampling_settings_are_generates(tiny):
    c = _client(tiny["server"])
    ref = reference(tiny["path"], tiny["text_ids"][:2], NEW, 1, SAMPLED)  # at world 1: the same at every size
    for i in range(2):
        want = tiny["tok"].decode(ref[i][0])
        extra = {k: SAMPLED[k] for k in ("top_k", "min_p", "repetition_penalty")}
        kw = {k: v for k, v in SAMPLED.items() if k not in extra}
        r = c.completions.create(model=NAME, prompt=TEXTS[i], max_tokens=NEW, extra_body=extra, **kw)
        assert r.choices[0].text == want, i
        got = "".join(ch.choices[0].text for ch in c.completions.create(
            model=NAME, prompt=TEXTS[i], max_tokens=NEW, extra_body=extra, stream=True, **kw))
        assert got == want
    # another seed, other tokens (the seed reaches the sampler)
    r = c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=NEW, temperature=1.5, seed=99)
    r2 = c.completions.create(model=NAME, prompt=TEXTS[0], max_tokens=NEW, temperature=1.5, seed=98)
    assert r.choices[0].text != r2.choices[0].text
    tiny["server"].wait_idle()


def _logsoftmax(comm, path, seq):
    m = tpcore.models.from_pretrained(path, comm, progress=False)
    x = m.logits(np.array([seq], np.int64))[0].astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_logprobs(tiny):
    if tiny["world"] != 1:
        pytest.skip("the tokens are checked at every world size; logprobs at one")
    c, tok = _client(tiny["server"]), tiny["tok"]
    ids, (_, _, n, gen) = tiny["text_ids"][1], tiny["ref_text"][1]
    lp = tpcore.spawn(_logsoftmax, 1, args=(tiny["path"], ids + gen))[0][len(ids) - 1:len(ids) - 1 + n]
    r = c.completions.create(model=NAME, prompt=TEXTS[1], max_tokens=NEW, temperature=0, logprobs=3)
    got = r.choices[0].logprobs
    assert len(got.tokens) == n and got.tokens == [tok.decode([t], skip_special_tokens=False) for t in gen]
    np.testing.assert_allclose(got.token_logprobs, lp[np.arange(n), gen], atol=2e-4)
    for j, top in enumerate(got.top_logprobs):
        want = np.argsort(-lp[j], kind="stable")[:3]
        assert list(top) == [tok.decode([int(t)], skip_special_tokens=False) for t in want]
        np.testing.assert_allclose(list(top.values()), lp[j, want], atol=2e-4)
    assert got.text_offset[0] == 0
    r = c.chat.completions.create(model=NAME, messages=CHATS[0], max_tokens=4, temperature=0, logprobs=True,
                                  top_logprobs=2)
    content = r.choices[0].logprobs.content
    cids = tiny["chat_ids"][0]
    cgen = tiny["ref_chat"][0][3][:4]
    clp = tpcore.spawn(_logsoftmax, 1, args=(tiny["path"], cids + cgen))[0][len(cids) - 1:]
    for j, e in enumerate(content):
        assert e.token == tok.decode([cgen[j]], skip_special_tokens=False)
        assert abs(e.logprob - clp[j, cgen[j]]) < 2e-4 and len(e.top_logprobs) == 2
        assert e.bytes == list(e.token.encode())
    tiny["server"].wait_idle()
