"""Serving benchmark over HTTP: a load generator against an OpenAI-compatible server.

    python -m tpcore.bench serve --http --checkpoint model.gguf --worlds 1,2 --concurrency 16
    python -m tpcore.bench serve --http --checkpoint model.gguf --rate 1,2,4 --requests 64
    python -m tpcore.bench serve --http --url http://127.0.0.1:8000 --concurrency 1,4,16 --json s.json

Without --url it starts tpcore's own server (``python -m tpcore.serve CHECKPOINT -n N``) for
each world size in --worlds, waits for GET /health, and stops it after its runs.  The load:
--requests completions (POST /v1/completions, "stream": true) whose prompts are English words
of mixed lengths (--prompt LO,HI words) and whose max_tokens are mixed too (--new LO,HI), all
drawn from --seed; greedy; ``ignore_eos`` asked (where a server refuses the field the run
says so and counts what it got).  Either a fixed concurrency (--concurrency C: C clients,
each sending its next request when the last one finished) or a request-rate sweep (--rate R:
Poisson arrivals at R requests/s, open loop).  Per run (per world size):

  req/s           completed requests / wall time (from the first request to the last byte)
  tok/s           output tokens (the server's usage, else the streamed chunks) / wall time
  TTFT p50/p99    from sending a request to its first streamed text (ms)
  ITL p50/p99     between consecutive streamed chunks of a request (ms), over all requests
  err             requests that failed (an HTTP error, a broken stream, a timeout)

Beside each tpcore run at a fixed concurrency, the same requests (prompt ids from the model's
tokenizer, each request's output length as the server gave it, EOS off) through an in-process
``tpcore.Engine`` at the same world size and max_batch = C: the "engine" rows, and the ratio
HTTP / engine throughput (the front end's cost).  With llama-cpp-python's server importable
(``pip install 'llama-cpp-python[server]'``) and a GGUF checkpoint, the same load against
``python -m llama_cpp.server --model FILE`` in the same run (one process; --threads or all
cores); otherwise a line says why it was skipped.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# prompt text: common English words, drawn with the seed (no file to ship, every tokenizer knows them)
_WORDS = ("the of and to in is was for on are with as his they be at one have this from or had by hot word but "
          "what some we can out other were all there when up use your how said an each she which do their time "
          "if will way about many then them write would like so these her long make thing see him two has look "
          "more day could go come did number sound no most people my over know water than call first who may "
          "down side been now find any new work part take get place made live where after back little only round "
          "man year came show every good me give our under name very through just form sentence great think say "
          "help low line differ turn cause much mean before move right boy old too same tell does set three want "
          "air well also play small end put home read hand port large spell add even land here must big high such "
          "follow act why ask men change went light kind off need house picture try us again animal point mother "
          "world near build self earth father head stand own page should country found answer school grow study "
          "still learn plant cover food sun four between state keep eye never last let thought city tree cross "
          "farm hard start might story saw far sea draw left late run while press close night real life few north"
          ).split()


def make_prompts(n: int, words: Tuple[int, int] = (8, 96), new: Tuple[int, int] = (16, 64),
                 seed: int = 0) -> List[Tuple[str, int]]:
    """The load's requests.

    Parameters
    ----------
    n : int
        How many requests.
    words : (int, int)
        Prompt length range in words, inclusive.
    new : (int, int)
        max_tokens range, inclusive.
    seed : int
        The draw's seed: the first k requests are the same for any n >= k.

    Returns
    -------
    list of (str, int)
        (prompt text, max_tokens) per request.
    """
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(g.integers(words[0], words[1] + 1))
        m = int(g.integers(new[0], new[1] + 1))
        text = " ".join(_WORDS[i] for i in g.integers(0, len(_WORDS), k))
        out.append((text[:1].upper() + text[1:], m))
    return out


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


# ---------------------------------------------------------------------------------------------- the client
async def _one(client, url: str, body: Dict[str, Any], headers: Dict[str, str], timeout: float) -> Dict[str, Any]:
    """One streamed completion: its times (perf_counter), chunks, usage, error."""
    t0 = time.perf_counter()
    res: Dict[str, Any] = {"start": t0, "first": None, "end": None, "chunk_times": [], "chunks": 0,
                           "completion_tokens": None, "prompt_tokens": None, "finish_reason": None, "error": None,
                           "text": "", "max_tokens": body.get("max_tokens")}
    pieces = []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers,
                                 timeout=timeout) as resp:
            if resp.status_code != 200:
                raw = (await resp.aread()).decode("utf-8", "replace")
                try:
                    msg = json.loads(raw)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    msg = raw[:200]
                res["error"] = f"HTTP {resp.status_code}: {msg}"
                res["end"] = time.perf_counter()
                return res
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                j = json.loads(data)
                if j.get("error"):
                    raise RuntimeError(f"error in the stream: {j['error']}")
                if j.get("usage"):
                    res["completion_tokens"] = j["usage"].get("completion_tokens")
                    res["prompt_tokens"] = j["usage"].get("prompt_tokens")
                for c in j.get("choices") or []:
                    if c.get("text"):
                        now = time.perf_counter()
                        res["first"] = res["first"] or now
                        res["chunk_times"].append(now)
                        res["chunks"] += 1
                        pieces.append(c["text"])
                    if c.get("finish_reason"):
                        res["finish_reason"] = c["finish_reason"]
            if not done:
                res["error"] = "the stream ended before data: [DONE]"
    except Exception as e:  # noqa: BLE001 -- any client-side failure is one failed request, counted and shown
        res["error"] = f"{type(e).__name__}: {e}"
    res["end"] = time.perf_counter()
    res["text"] = "".join(pieces)
    return res


async def _load(url: str, model: str, prompts: Sequence[Tuple[str, int]], concurrency: Optional[int],
                rate: Optional[float], seed: int, extra: Dict[str, Any], api_key: Optional[str],
                timeout: float) -> Tuple[List[Dict[str, Any]], float]:
    """Send every prompt, C at a time (concurrency) or at Poisson times (rate); returns the
    per-request results (in prompt order) and the wall time."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bodies = [dict(model=model, prompt=p, max_tokens=m, stream=True, temperature=0.0, **extra) for p, m in prompts]
    n_conn = concurrency or len(prompts)
    limits = httpx.Limits(max_connections=n_conn, max_keepalive_connections=n_conn)
    results: List[Optional[Dict[str, Any]]] = [None] * len(bodies)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        if concurrency:
            queue = list(range(len(bodies)))[::-1]

            async def worker():
                while queue:
                    i = queue.pop()
                    results[i] = await _one(client, url, bodies[i], headers, timeout)
            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        else:
            gaps = np.random.default_rng(seed + 1).exponential(1.0 / rate, len(bodies))
            at = np.cumsum(gaps) - gaps[0]   # the first request at t = 0

            async def later(i):
                await asyncio.sleep(max(0.0, t0 + float(at[i]) - time.perf_counter()))
                results[i] = await _one(client, url, bodies[i], headers, timeout)
            await asyncio.gather(*(later(i) for i in range(len(bodies))))
    ok = [r for r in results if r and not r["error"]]
    wall = (max(r["end"] for r in ok) if ok else time.perf_counter()) - t0
    return results, wall


def summarize(results: Sequence[Dict[str, Any]], wall: float) -> Dict[str, Any]:
    """One row of the table from a run's per-request results.

    Parameters
    ----------
    results : list of dict
        What the client recorded per request (start, first, chunk_times, completion_tokens, error).
    wall : float
        The run's wall time in seconds.

    Returns
    -------
    dict
        requests, completed, errors, first_error, wall_s, req_s, output_tokens, tok_s, prompt_tokens,
        TTFT and ITL p50/p99 (ms), tokens_from ("usage" or "chunks"), finish_reasons (counts); per
        completed request: completion_tokens, max_tokens, finish.
    """
    ok = [r for r in results if not r["error"]]
    bad = [r for r in results if r["error"]]
    from_usage = bool(ok) and all(r["completion_tokens"] is not None for r in ok)
    toks = [int(r["completion_tokens"]) if from_usage else r["chunks"] for r in ok]
    ttft = [r["first"] - r["start"] for r in ok if r["first"] is not None]
    itl = [float(d) for r in ok for d in np.diff(r["chunk_times"])]
    reasons: Dict[str, int] = {}
    for r in ok:
        reasons[str(r["finish_reason"])] = reasons.get(str(r["finish_reason"]), 0) + 1
    return {"requests": len(results), "completed": len(ok), "errors": len(bad),
            "first_error": bad[0]["error"] if bad else None, "wall_s": wall,
            "req_s": len(ok) / wall if wall > 0 else float("nan"), "output_tokens": int(sum(toks)),
            "tok_s": sum(toks) / wall if wall > 0 else float("nan"),
            "prompt_tokens": int(sum(r["prompt_tokens"] or 0 for r in ok)),
            "ttft_p50_ms": _pct(ttft, 50) * 1e3, "ttft_p99_ms": _pct(ttft, 99) * 1e3,
            "itl_p50_ms": _pct(itl, 50) * 1e3, "itl_p99_ms": _pct(itl, 99) * 1e3,
            "tokens_from": "usage" if from_usage else "chunks", "finish_reasons": reasons,
            "completion_tokens": toks, "max_tokens": [r["max_tokens"] for r in ok],
            "prompt_tokens_each": [r["prompt_tokens"] for r in ok],
            "finish": [r["finish_reason"] for r in ok]}


def probe(url: str, model: str, extra: Dict[str, Any], api_key: Optional[str], timeout: float,
          log=print) -> Dict[str, Any]:
    """The extra request fields (ignore_eos, stream_options) this server takes: one short request
    with all of them, then without each one it refuses (HTTP 400 naming it).

    Parameters
    ----------
    url, model : str
        The server and the model's id.
    extra : dict
        The fields to try.
    api_key : str or None
        Sent as a Bearer token.
    timeout : float
        Seconds per request.
    log : callable
        Where a refused field is reported.

    Returns
    -------
    dict
        The fields kept.
    """
    keep = dict(extra)
    for _ in range(len(extra) + 1):
        (r,), _w = asyncio.run(_load(url, model, [("Hello", 2)], 1, None, 0, keep, api_key, timeout))
        if not r["error"]:
            return keep
        named = [k for k in keep if k in r["error"]]
        if not (r["error"].startswith("HTTP 400") or r["error"].startswith("HTTP 422")) or not named:
            raise RuntimeError(f"{url}: a first request failed: {r['error']}")
        log(f"# {url} refuses {named[0]!r} ({r['error'][:120]}); sent without it")
        keep.pop(named[0])
    raise RuntimeError(f"{url}: a first request failed")


def models(url: str, api_key: Optional[str], timeout: float = 30.0) -> List[str]:
    """The model ids of GET /v1/models.

    Parameters
    ----------
    url : str
        The server's base URL.
    api_key : str or None
        Sent as a Bearer token.
    timeout : float
        Seconds.

    Returns
    -------
    list of str
    """
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise RuntimeError(f"{url}: GET /v1/models failed: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise RuntimeError(f"{url}: GET /v1/models: HTTP {r.status_code}: {r.text[:300]}")
    ids = [m["id"] for m in r.json().get("data") or []]
    if not ids:
        raise RuntimeError(f"{url}: GET /v1/models lists no model")
    return ids


# ---------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now.

    Parameters
    ----------
    None

    Returns
    -------
    int
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server started as a subprocess (its own process group), ready once GET /health (or
    /v1/models) answers 200; stop() ends the group.

    Parameters
    ----------
    argv : list of str
        The command.
    url : str
        Its base URL.
    name : str
        For messages.
    log : str, optional
        A file for its output (default: discarded).
    ready_timeout : float
        Seconds to wait for it.
    """

    def __init__(self, argv: List[str], url: str, name: str, log: Optional[str] = None,
                 ready_timeout: float = 300.0) -> None:
        import httpx
        self.url, self.name, self.log = url, name, log
        out = open(log, "wb") if log else subprocess.DEVNULL  # closed in stop()
        self._out = out if log else None
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{name} exited with status {self.proc.returncode} before it was ready"
                                   + (f": {self._tail()}" if log else f" ({' '.join(argv)})"))
            for path in ("/health", "/v1/models"):
                try:
                    if httpx.get(url + path, timeout=2.0).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} not ready after {ready_timeout:.0f} s" + (f": {self._tail()}" if log
                                                                                     else ""))
            time.sleep(0.5)

    def _tail(self) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-1500:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after 10 s).

        Parameters
        ----------
        None
        """
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._out:
            self._out.close()
            self._out = None


def start_tpcore(checkpoint: str, world: int, max_batch: int, threads: Optional[int] = None,
                 log: Optional[str] = None, api_key: Optional[str] = None) -> Server:
    """tpcore's server on `world` local ranks, on a free port of 127.0.0.1.

    Parameters
    ----------
    checkpoint : str
        A .gguf file or a safetensors folder.
    world : int
        Ranks (-n).
    max_batch : int
        --max-batch.
    threads : int, optional
        BLAS threads per rank (TPCORE_NUM_THREADS; default tpcore's).
    log : str, optional
        A file for its output.
    api_key : str, optional
        --api-key.

    Returns
    -------
    Server
    """
    port = free_port()
    argv = [sys.executable, "-m", "tpcore.serve", checkpoint, "-n", str(world), "--host", "127.0.0.1",
            "--port", str(port), "--max-batch", str(max_batch)] + (["--api-key", api_key] if api_key else [])
    env_threads = {"TPCORE_NUM_THREADS": str(threads)} if threads else {}
    old = {k: os.environ.get(k) for k in env_threads}
    os.environ.update(env_threads)
    try:
        return Server(argv, f"http://127.0.0.1:{port}", f"tpcore server ({world} rank{'s' if world > 1 else ''})",
                      log)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def llama_cpp_available(checkpoint: Optional[str]) -> Optional[str]:
    """Why llama.cpp's server cannot run here (None: it can).

    Parameters
    ----------
    checkpoint : str or None
        The model file.

    Returns
    -------
    str or None
    """
    if not checkpoint or not checkpoint.endswith(".gguf"):
        return "llama.cpp's server needs a GGUF checkpoint (--checkpoint FILE.gguf)"
    try:
        found = importlib.util.find_spec("llama_cpp") is not None and \
            importlib.util.find_spec("llama_cpp.server") is not None
    except ImportError:
        found = False
    if not found:
        return "llama_cpp.server is not importable (pip install 'llama-cpp-python[server]')"
    return None


def start_llama_cpp(checkpoint: str, threads: int, n_ctx: int = 2048, log: Optional[str] = None) -> Server:
    """llama-cpp-python's OpenAI server on the GGUF file, on a free port of 127.0.0.1.

    Parameters
    ----------
    checkpoint : str
        The .gguf file.
    threads : int
        --n_threads.
    n_ctx : int
        The context length.
    log : str, optional
        A file for its output.

    Returns
    -------
    Server
    """
    port = free_port()
    argv = [sys.executable, "-m", "llama_cpp.server", "--model", checkpoint, "--n_threads", str(threads),
            "--n_ctx", str(n_ctx), "--host", "127.0.0.1", "--port", str(port)]
    return Server(argv, f"http://127.0.0.1:{port}", "llama.cpp server (llama-cpp-python)", log)


# ---------------------------------------------------------------------------------------------- the engine baseline
def encoder(checkpoint: str):
    """A function text -> prompt ids, as tpcore's server tokenizes a completion's prompt.

    Parameters
    ----------
    checkpoint : str
        A .gguf file or a safetensors folder holding tokenizer.json.

    Returns
    -------
    callable
    """
    try:
        from tpcore.models.text import load_tokenizer  # the server's own tokenizer (issue 29)
    except ImportError:
        load_tokenizer = None
    if load_tokenizer is not None:
        tk = load_tokenizer(checkpoint)
        return lambda text: list(tk.encode(text))
    if checkpoint.endswith(".gguf"):
        from tpcore.models.gguf import tokenizer
        tok = tokenizer(checkpoint)
    else:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json"))
    return lambda text: tok.encode(text).ids


def _engine_rank(comm, checkpoint, concurrency, reqs, threads):
    """Every rank: the requests through an in-process Engine (max_batch = concurrency) as the
    HTTP clients send them: `concurrency` at t = 0 (after a warm-up), the next one each time
    one finishes (between steps: every rank the same); EOS off (each request makes exactly
    its tokens).  TTFT counts from each request's submission, as the client's from its send."""
    import tpcore
    from tpcore.serve.engine import Engine
    if threads:
        tpcore.set_num_threads(threads)
    model = tpcore.models.from_pretrained(checkpoint, comm, progress=False)
    max_len = max(len(p) + n for p, n in reqs)
    eng = Engine(model, max_batch=concurrency, max_len=max_len)
    for p, n in reqs[:concurrency]:   # warm-up: the largest prefill and decode batches once
        eng.submit(p, min(n, 2), eos_token_id=-1)
    for _ in eng.run():
        pass
    comm.barrier()
    t0 = time.perf_counter()
    hs = [eng.submit(p, n, eos_token_id=-1) for p, n in reqs[:concurrency]]
    while len(hs) < len(reqs) or eng.waiting or eng.running:
        for _ in eng.step():
            if len(hs) < len(reqs):
                hs.append(eng.submit(*reqs[len(hs)], eos_token_id=-1))
    ends = [h.token_times[-1] for h in hs if len(h.token_times)]
    wall = max(ends) - t0
    itl = [float(d) for h in hs for d in np.diff(np.asarray(h.token_times, np.float64))]
    ttft = [float(h.ttft) for h in hs if h.ttft is not None]
    return {"wall_s": wall, "output_tokens": int(sum(len(h.tokens) for h in hs)), "ttft_s": ttft, "itl_s": itl,
            "completed": sum(1 for h in hs if h.finish_reason in ("length", "stop", "eos"))}


def engine_baseline(checkpoint: str, world: int, concurrency: int, reqs: Sequence[Tuple[List[int], int]],
                    threads: Optional[int] = None, timeout: float = 1800.0) -> Dict[str, Any]:
    """The same load through tpcore.Engine directly, at `world` ranks (tpcore.spawn).

    Parameters
    ----------
    checkpoint : str
        The model.
    world : int
        Ranks.
    concurrency : int
        The engine's max_batch.
    reqs : list of (list of int, int)
        (prompt ids, tokens to generate) per request.
    threads : int, optional
        BLAS threads per rank.
    timeout : float
        Seconds for the whole run.

    Returns
    -------
    dict
        A row as `summarize` gives (the slowest rank's times).
    """
    import tpcore
    res = tpcore.spawn(_engine_rank, world, args=(checkpoint, concurrency, list(reqs), threads), deadline=timeout)
    wall = max(r["wall_s"] for r in res)
    r0 = max(res, key=lambda r: r["wall_s"])
    return {"requests": len(reqs), "completed": r0["completed"], "errors": len(reqs) - r0["completed"],
            "first_error": None, "wall_s": wall, "req_s": r0["completed"] / wall,
            "output_tokens": r0["output_tokens"], "tok_s": r0["output_tokens"] / wall,
            "prompt_tokens": int(sum(len(p) for p, _ in reqs)),
            "ttft_p50_ms": _pct(r0["ttft_s"], 50) * 1e3, "ttft_p99_ms": _pct(r0["ttft_s"], 99) * 1e3,
            "itl_p50_ms": _pct(r0["itl_s"], 50) * 1e3, "itl_p99_ms": _pct(r0["itl_s"], 99) * 1e3,
            "tokens_from": "engine", "finish_reasons": {"length": r0["completed"]}}


# ---------------------------------------------------------------------------------------------- the command
HEADER = (f"{'server':<10} {'ranks':>5} {'load':>9} {'reqs':>4} {'ok':>4} {'err':>3} {'wall s':>7} {'req/s':>6} "
          f"{'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")


def _line(row: Dict[str, Any]) -> str:
    ranks = str(row["world"]) if row.get("world") else "-"
    return (f"{row['server']:<10} {ranks:>5} {row['load']:>9} {row['requests']:>4} {row['completed']:>4} "
            f"{row['errors']:>3} {row['wall_s']:>7.2f} {row['req_s']:>6.2f} {row['tok_s']:>7.1f} "
            f"{row['ttft_p50_ms']:>7.1f}ms {row['ttft_p99_ms']:>7.1f}ms {row['itl_p50_ms']:>6.1f}ms "
            f"{row['itl_p99_ms']:>6.1f}ms")


def _loads(args) -> List[Tuple[str, Optional[int], Optional[float]]]:
    if args.rate:
        return [(f"{r:g}/s", None, float(r)) for r in args.rate]
    return [(f"c={c}", int(c), None) for c in args.concurrency]


def _serve_runs(url, model, server, world, args, prompts, extra, rows, log):
    """Every load of the sweep against one server; appends rows and returns them."""
    mine = []
    for label, conc, rate in _loads(args):
        warm = prompts[:conc or 4]   # warm-up: the first requests, 2 tokens each
        asyncio.run(_load(url, model, [(p, 2) for p, _ in warm], conc or 4, None, 0, extra, args.api_key,
                          args.request_timeout))
        results, wall = asyncio.run(_load(url, model, prompts, conc, rate, args.seed, extra, args.api_key,
                                          args.request_timeout))
        row = summarize(results, wall)
        row.update(server=server, world=world, load=label, concurrency=conc, rate=rate,
                   ignore_eos=bool(extra.get("ignore_eos")))
        row["_results"] = results
        log(_line(row))
        if row["first_error"]:
            log(f"#   first error: {row['first_error']}")
        rows.append(row)
        mine.append(row)
    return mine


def _baselines(args, targets, prompts, rows, notes, log):
    """The Engine-directly row beside each HTTP row at a fixed concurrency, and the ratio."""
    enc = encoder(args.checkpoint)
    ids = [enc(p) for p, _ in prompts]
    for world, mine in targets:
        for r in mine:
            if r["tokens_from"] != "usage" or r["errors"]:
                notes.append(f"engine baseline at {world} ranks, {r['load']}: skipped (the HTTP run has errors "
                             f"or no usage counts)")
                continue
            got = [int(v) for v in r["prompt_tokens_each"]]
            if got != [len(i) for i in ids]:
                notes.append(f"engine baseline, {r['load']}: the server counted other prompt lengths than this "
                             f"tokenizer ({sum(got)} vs {sum(len(i) for i in ids)} tokens)")
            reqs = [(i, max(1, int(k))) for i, k in zip(ids, r["completion_tokens"])]
            e = engine_baseline(args.checkpoint, world, r["concurrency"], reqs, args.threads, args.timeout)
            e.update(server="engine", world=world, load=r["load"], concurrency=r["concurrency"], rate=None)
            log(_line(e))
            rows.append(e)
            r["engine_ratio"] = ratio = r["tok_s"] / e["tok_s"]
            notes.append(f"{world} rank{'s' if world > 1 else ''}, {r['load']}: {r['server']} over HTTP / Engine "
                         f"directly: throughput {ratio:.3f} ({100 * (ratio - 1):+.1f}%)")


def _check_args(args) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    words = tuple(args.prompt or (8, 96))
    new = tuple(args.new or (16, 64))
    if len(words) != 2 or len(new) != 2 or not 1 <= words[0] <= words[1] or not 1 <= new[0] <= new[1]:
        raise SystemExit("--prompt (words) and --new (tokens) take LO,HI with 1 <= LO <= HI")
    if not args.url and not args.checkpoint:
        raise SystemExit("--http needs --url URL (a running server) or --checkpoint MODEL (tpcore's server is started)")
    if args.rate and min(args.rate) <= 0:
        raise SystemExit("--rate takes positive requests per second")
    if not args.rate and (not args.concurrency or min(args.concurrency) < 1):
        raise SystemExit("--concurrency takes positive integers")
    if not args.worlds or min(args.worlds) < 1:
        raise SystemExit("--worlds takes positive integers")
    if args.requests is not None and args.requests < 1:
        raise SystemExit("--requests must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise SystemExit("--threads must be >= 1")
    if args.url and not args.url.startswith(("http://", "https://")):
        raise SystemExit(f"--url must start with http:// or https://, got {args.url!r}")
    return words, new


def run_http(args) -> int:
    """``python -m tpcore.bench serve --http``: see the module's docstring.

    Parameters
    ----------
    args : argparse.Namespace
        The serve subcommand's arguments.

    Returns
    -------
    int
        0 when every request of every run completed, else 1.
    """
    words, new = _check_args(args)
    try:
        return _run(args, words, new)
    except RuntimeError as e:   # a server that did not start or refused the first request: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args, words, new) -> int:
    n_req = args.requests or max(16, 4 * max(args.concurrency if not args.rate else [4]))
    prompts = make_prompts(n_req, words, new, args.seed)
    cores = os.cpu_count() or 1
    log = print
    mode = (f"request rates {','.join(f'{r:g}' for r in args.rate)}/s (Poisson arrivals, seed {args.seed})"
            if args.rate else f"concurrency {','.join(map(str, args.concurrency))} (closed loop)")
    log(f"# tpcore serve --http benchmark; {cores} cores; {n_req} streamed completions per run, {mode}; prompts "
        f"{words[0]}-{words[1]} words, max_tokens {new[0]}-{new[1]}, greedy; seed {args.seed}")
    log(f"# server: {args.url or args.checkpoint}")
    want = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    rows: List[Dict[str, Any]] = []
    notes: List[str] = []
    log(HEADER)
    targets = []   # (world, the HTTP rows) to compare with the Engine directly
    if args.url:
        name = models(args.url, args.api_key)[0]
        extra = probe(args.url, name, want, args.api_key, args.request_timeout, log)
        mine = _serve_runs(args.url, name, "http", None, args, prompts, extra, rows, log)
        if args.checkpoint:
            targets.append((args.worlds[0], mine))
    else:
        for world in args.worlds:
            srv = start_tpcore(args.checkpoint, world, max(args.concurrency) if not args.rate else 64, args.threads,
                               log=args.server_log, api_key=args.api_key)
            try:
                name = models(srv.url, args.api_key)[0]
                extra = probe(srv.url, name, want, args.api_key, args.request_timeout, log)
                targets.append((world, _serve_runs(srv.url, name, "tpcore", world, args, prompts, extra, rows, log)))
            finally:
                srv.stop()
    if args.rate or args.no_engine:
        notes.append("engine baseline: skipped (" + ("--no-engine" if args.no_engine else
                     "it runs at a fixed --concurrency, not a --rate sweep") + ")")
    elif args.checkpoint:
        _baselines(args, targets, prompts, rows, notes, log)
    if args.checkpoint:
        why = llama_cpp_available(args.checkpoint) if not args.no_llama_cpp else "--no-llama-cpp"
        if why:
            notes.append(f"llama.cpp server: skipped: {why}")
        else:
            srv = start_llama_cpp(args.checkpoint, args.threads or cores, log=args.server_log)
            try:
                name = models(srv.url, None)[0]
                extra = probe(srv.url, name, want, None, args.request_timeout, log)
                _serve_runs(srv.url, name, "llama.cpp", None, args, prompts, extra, rows, log)
            finally:
                srv.stop()
    log("#")
    for srv_name in dict.fromkeys(r["server"] for r in rows if r["server"] != "engine" and not r.get("ignore_eos")):
        src = sorted({r["tokens_from"] for r in rows if r["server"] == srv_name})
        notes.append(f"{srv_name}: ignore_eos refused: requests may end early at EOS (tokens counted from "
                     f"{' and '.join(src)})")
    for n in notes:
        log(f"# {n}")
    ok = all(r["errors"] == 0 for r in rows)
    log(f"# every request of every run completed: {'yes' if ok else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server": args.url or args.checkpoint, "cores": cores, "prompt_words": list(words),
                       "new": list(new), "seed": args.seed, "requests": n_req, "notes": notes,
                       "rows": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]}, f, indent=1)
        log(f"# wrote {args.json}")
    if args.plot:
        _plot(args.plot, rows, args.url or os.path.basename(args.checkpoint), bool(args.rate))
    return 0 if ok else 1


def _plot(path, rows, title, by_rate):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("# --plot needs matplotlib (pip install 'tpcore[bench]')")
        return
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    series: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        key = r["server"] + (f" {r['world']} rank{'s' if r['world'] > 1 else ''}" if r.get("world") else "")
        series.setdefault(key, []).append(r)
    for i, (lab, mine) in enumerate(series.items()):
        xs = [r["rate"] if by_rate else r["concurrency"] for r in mine]
        col = f"C{i}"
        ax[0].plot(xs, [r["tok_s"] for r in mine], "o-", color=col, label=lab)
        ax[1].plot(xs, [r["ttft_p50_ms"] for r in mine], "o-", color=col, label=f"{lab} p50")
        ax[1].plot(xs, [r["ttft_p99_ms"] for r in mine], "x--", color=col, label=f"{lab} p99")
        ax[2].plot(xs, [r["itl_p50_ms"] for r in mine], "o-", color=col, label=f"{lab} p50")
        ax[2].plot(xs, [r["itl_p99_ms"] for r in mine], "x--", color=col, label=f"{lab} p99")
    for a, y in zip(ax, ["output tokens/s", "time to first token (ms)", "inter-token latency (ms)"]):
        a.set_xlabel("request rate (1/s)" if by_rate else "concurrency")
        if not by_rate:
            a.set_xscale("log", base=2)
            a.set_xticks(sorted({r["concurrency"] for r in rows}))
            a.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        a.set_ylabel(y)
        a.legend(fontsize=7)
    fig.suptitle(f"{title}: streamed completions over HTTP")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"# wrote {path}")
