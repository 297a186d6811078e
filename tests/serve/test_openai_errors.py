"""The OpenAI server's refusals and bounds (a tiny Llama at world 1, with --api-key): every bad
input gets the right HTTP status and OpenAI's error JSON naming the field; 401 without the key;
404 an unknown model or path; 413 a body over --max-body; 400 a prompt longer than the context
(both numbers said); 503 when --max-queue requests are in the server; 1,000 connections that send
nothing do not stop the others being served and are closed after --header-timeout; nothing leaks
(resident memory, threads, the engine's slots) after many requests; --help exits 0 silently."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from openai_server_common import Server, tiny_model

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

KEY = "sk-test-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_LEN, MAX_QUEUE, MAX_BODY = 8192, 4, 2_000_000  # a long context: requests that run for seconds


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path = tiny_model(str(tmp_path_factory.mktemp("tiny")))
    s = Server(path, "--served-model-name", "tiny", "--api-key", KEY, "--max-len", str(MAX_LEN), "--max-batch", "4",
               "--max-queue", str(MAX_QUEUE), "--header-timeout", "2", "--max-body", str(MAX_BODY))
    yield s
    s.close()


def _post(s, path, body, headers=AUTH, raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(s.url + path, content=data, headers=dict(headers, **{"Content-Type": "application/json"}),
                      timeout=30)


def _err(r, status, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    assert e["param"] == param, e
    return e


C = {"model": "tiny", "prompt": "Hi", "max_tokens": 4}
CH = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
BAD = [  # (path, body, param)
    ("/v1/completions", dict(C, prompt=5), "prompt"),
    ("/v1/completions", dict(C, prompt=[]), "prompt"),
    ("/v1/completions", dict(C, prompt=["a", "b"]), "prompt"),
    ("/v1/completions", dict(C, prompt=[1, -3]), "prompt"),
    ("/v1/completions", dict(C, prompt=[1, 500]), "prompt"),
    ("/v1/completions", dict(C, max_tokens="4"), "max_tokens"),
    ("/v1/completions", dict(C, max_tokens=0), "max_tokens"),
    ("/v1/completions", dict(C, max_tokens=10 ** 9), "max_tokens"),
    ("/v1/completions", dict(C, max_tokens=True), "max_tokens"),
    ("/v1/completions", dict(C, temperature="hot"), "temperature"),
    ("/v1/completions", dict(C, temperature=2.5), "temperature"),
    ("/v1/completions", dict(C, temperature=True), "temperature"),
    ("/v1/completions", dict(C, top_p=0), "top_p"),
    ("/v1/completions", dict(C, top_k=-2), "top_k"),
    ("/v1/completions", dict(C, seed=1.5), "seed"),
    ("/v1/completions", dict(C, stream="yes"), "stream"),
    ("/v1/completions", dict(C, stream_options={"include_usage": True}), "stream_options"),
    ("/v1/completions", dict(C, stop=5), "stop"),
    ("/v1/completions", dict(C, stop=[""]), "stop[0]"),
    ("/v1/completions", dict(C, stop=["a"] * 17), "stop"),
    ("/v1/completions", dict(C, stop=["x" * (1 << 20)]), "stop"),   # 1 MB of stop string
    ("/v1/completions", dict(C, stop_token_ids=[1, "2"]), "stop_token_ids[1]"),
    ("/v1/completions", dict(C, logprobs=21), "logprobs"),
    ("/v1/completions", dict(C, n=2), "n"),
    ("/v1/completions", dict(C, echo=True), "echo"),
    ("/v1/completions", dict(C, frobnicate=1), "frobnicate"),
    ("/v1/completions", dict(C, messages=[]), "messages"),
    ("/v1/completions", {"prompt": "Hi"}, "model"),
    ("/v1/chat/completions", dict(CH, messages="Hi"), "messages"),
    ("/v1/chat/completions", dict(CH, messages=[]), "messages"),
    ("/v1/chat/completions", dict(CH, messages=[{"role": "wizard", "content": "x"}]), "messages[0].role"),
    ("/v1/chat/completions", dict(CH, messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    ("/v1/chat/completions", dict(CH, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     "messages[0].content[0]"),
    ("/v1/chat/completions", dict(CH, messages=[{"role": "user", "content": "x", "mood": 1}]), "messages[0].mood"),
    ("/v1/chat/completions", dict(CH, top_logprobs=2), "top_logprobs"),
    ("/v1/chat/completions", dict(CH, logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/chat/completions", dict(CH, prompt="x"), "prompt"),
    ("/v1/chat/completions", dict(CH, tools=[{"type": "function"}]), "tools"),
    ("/v1/chat/completions", dict(CH, response_format={"type": "json_object"}), "response_format"),
    ("/v1/chat/completions", dict(CH, max_completion_tokens=0), "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p[4:]}-{b}" for p, _, b in BAD])
def test_bad_field_is_400_naming_it(srv, path, body, param):
    e = _err(_post(srv, path, body), 400, param)
    assert e["type"] == "invalid_request_error"


def test_malformed_bodies(srv):
    for raw in (b"{not json", b'{"model": "tiny", "prompt": "a", "temperature": NaN}', b"[1, 2]", b"\xff\xfe",
                b'{"model": "tiny", "prompt": "a", "max_tokens": Infinity}'):
        _err(_post(srv, "/v1/completions", None, raw=raw), 400)


def test_context_and_sizes(srv):
    e = _err(_post(srv, "/v1/completions", dict(C, prompt="y" * 9000)), 400, "prompt")
    assert "8192" in e["message"] and "9000" in e["message"] and e["code"] == "context_length_exceeded"
    e = _err(_post(srv, "/v1/completions", dict(C, prompt="y" * 8000, max_tokens=200)), 400, "max_tokens")
    assert all(str(v) in e["message"] for v in (8192, 8200, 8000, 200))
    e = _err(_post(srv, "/v1/completions", dict(C, stop=["x" * 1000] * 3000)), 413)
    assert str(MAX_BODY) in e["message"]


def test_key_model_and_paths(srv):
    for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        e = _err(_post(srv, "/v1/completions", C, headers=h), 401)
        assert e["code"] == "invalid_api_key"
        _err(httpx.get(srv.url + "/v1/models", headers=h), 401)
    assert httpx.get(srv.url + "/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
    assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
    e = _err(_post(srv, "/v1/chat/completions", dict(CH, model="gpt-4")), 404, "model")
    assert e["code"] == "model_not_found"
    _err(httpx.get(srv.url + "/v1/nothing"), 404)
    _err(httpx.get(srv.url + "/v1/completions"), 405)
    r = _post(srv, "/v1/chat/completions", CH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_chat_page(srv):
    import tpcore.serve
    page = os.path.join(os.path.dirname(tpcore.serve.__file__), "static", "index.html")
    r = httpx.get(srv.url + "/")
    if os.path.isfile(page):
        with open(page, "rb") as f:
            assert (r.status_code, r.content) == (200, f.read()) and r.headers["content-type"].startswith("text/html")
    else:
        assert "index.html" in _err(r, 404)["message"]


def test_content_parts_are_joined(srv):
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    a = _post(srv, "/v1/chat/completions", dict(CH, messages=[{"role": "user", "content": parts}], temperature=0))
    b = _post(srv, "/v1/chat/completions", dict(CH, messages=[{"role": "user", "content": "Hi\nthere"}], temperature=0))
    assert a.status_code == 200 and a.json()["choices"] == b.json()["choices"]
    assert a.json()["usage"] == b.json()["usage"]


def test_queue_full_is_503_and_closing_cancels(srv):
    e0 = srv.wait_idle()["engine"]
    clients, streams, lines = [], [], []  # the line iterators too: one dropped closes its stream
    body = dict(C, max_tokens=MAX_LEN - 2, stream=True, temperature=0, ignore_eos=True)
    try:
        for _ in range(MAX_QUEUE):
            c = httpx.Client(timeout=30)
            clients.append(c)
            s = c.send(c.build_request("POST", srv.url + "/v1/completions", json=body, headers=AUTH), stream=True)
            streams.append(s)
            assert s.status_code == 200
            lines.append(s.iter_lines())
            first = next(lines[-1])  # it runs
            assert first.startswith("data: {") and "error" not in first, first
        e = _err(_post(srv, "/v1/completions", C), 503)
        assert e["code"] == "queue_full" and str(MAX_QUEUE) in e["message"]
    finally:
        for s in streams:
            s.close()
        for c in clients:
            c.close()
    e = srv.wait_idle()["engine"]
    assert e["finished"] - e0["finished"] == MAX_QUEUE and e["cancelled"] > e0["cancelled"]
    assert e["used_blocks"] == 0
    assert _post(srv, "/v1/completions", C).status_code == 200  # served again


def test_idle_connections_are_bounded(srv):
    socks = []
    try:
        for i in range(1000):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
            socks.append(s)
        t0 = time.monotonic()
        r = _post(srv, "/v1/completions", C)
        assert r.status_code == 200 and time.monotonic() - t0 < 10
        time.sleep(2.5)  # --header-timeout 2: every one of them is closed by the server
        open_ = 0
        for s in socks:
            s.settimeout(5)
            try:
                open_ += s.recv(1) != b""
            except ConnectionResetError:
                pass
            except socket.timeout:
                open_ += 1
        assert open_ == 0
    finally:
        for s in socks:
            s.close()
    assert _post(srv, "/v1/completions", C).status_code == 200


def _status(pid):
    with open(f"/proc/{pid}/status") as f:
        d = dict(line.split(":", 1) for line in f if ":" in line)
    return int(d["VmRSS"].split()[0]) * 1024, int(d["Threads"])


def _many(srv, n, workers=MAX_QUEUE, longest=5):
    bodies = [dict(C, max_tokens=1 + i % longest, temperature=0, stream=bool(i % 2), prompt=f"p{i}")
              for i in range(n)]
    errors = []

    def work(k):
        with httpx.Client(timeout=60, headers=AUTH) as c:
            for b in bodies[k::workers]:
                r = c.post(srv.url + "/v1/completions", json=b)
                if r.status_code != 200 or (b["stream"] and not r.text.endswith("data: [DONE]\n\n")):
                    errors.append((r.status_code, r.text[:200]))
    ts = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:3]


def _leak_check(srv, n, rss_bound, workers=MAX_QUEUE, longest=5):
    _many(srv, 100, workers, longest)  # warm: the allocator's pools, the tokenizer's caches
    e0 = srv.wait_idle()["engine"]
    rss0, threads0 = _status(srv.proc.pid)
    _many(srv, n, workers, longest)
    e = srv.wait_idle()["engine"]
    rss, threads = _status(srv.proc.pid)
    assert e["finished"] - e0["finished"] == n
    assert (e["running"], e["waiting"], e["tracked"], e["used_blocks"]) == (0, 0, 0, 0)
    assert threads == threads0, (threads0, threads)
    print(f"{n} requests: resident memory {rss0 / 2 ** 20:.1f} -> {rss / 2 ** 20:.1f} MiB, threads {threads}")
    assert rss - rss0 < rss_bound, f"resident memory grew {(rss - rss0) / 2 ** 20:.1f} MiB over {n} requests"
    return rss - rss0


def test_no_leak_after_many_requests(srv):
    _leak_check(srv, 200, 16 << 20)


@pytest.mark.slow  # test_no_leak_after_many_requests: the same path, 200 requests
def test_no_leak_after_10000_requests(tmp_path):
    """10,000 requests (streamed and not, 1 or 2 tokens each) from 32 clients at once into a server of
    32 running requests: RSS, threads, requests and KV blocks back where they were."""
    s = Server(tiny_model(str(tmp_path)), "--served-model-name", "tiny", "--api-key", KEY, "--max-batch", "32",
               "--max-queue", "64")
    try:
        _leak_check(s, 10_000, 32 << 20, workers=32, longest=2)
    finally:
        s.close()


def test_idle_ranks_outlive_the_comm_timeout(tmp_path):
    """Two ranks idle for 3x the communicator's timeout: the heartbeat keeps them, and a request then
    gets served; SIGTERM stops both (Server.close checks nothing is left)."""
    s = Server(tiny_model(str(tmp_path)), "--served-model-name", "tiny", n=2, env={"TPCORE_TIMEOUT": "1.5"})
    try:
        time.sleep(4.5)
        r = _post(s, "/v1/completions", C, headers={})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        s.close()


def test_sigterm_with_requests_in_flight(tmp_path):
    """SIGTERM while two ranks stream: the server stops within its graceful timeout with the
    launcher's status for a signal (128 + 15), nothing left (Server.close), the client's stream ends."""
    s = Server(tiny_model(str(tmp_path)), "--served-model-name", "tiny", "--max-len", "8192", n=2)
    try:
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", s.url + "/v1/completions", json=dict(C, max_tokens=8000, stream=True,
                                                                        ignore_eos=True)) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                os.killpg(s.proc.pid, signal.SIGTERM)
                t0 = time.monotonic()
                with pytest.raises(httpx.HTTPError):
                    for _ in lines:  # the stream is cut when the server stops (after its grace time)
                        pass
                    raise httpx.ReadError("the stream ended")
        assert s.proc.wait(30) == 128 + signal.SIGTERM and time.monotonic() - t0 < 20, s.output()
    finally:
        s.close()


def test_help_is_silent():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-W", "error", "-m", "tpcore.serve", "--help"], capture_output=True,
                       text=True, timeout=60, env=env)
    assert (r.returncode, r.stderr) == (0, "") and "--api-key" in r.stdout
    r = subprocess.run([sys.executable, "-m", "tpcore.serve", "/no/such/model"], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2 and "neither a folder nor a file" in r.stderr

