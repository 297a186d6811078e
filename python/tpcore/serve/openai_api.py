"""The OpenAI-compatible HTTP front end (a Starlette app, served by uvicorn on rank 0).

    POST /v1/chat/completions   chat (the model's chat template), streamed or not
    POST /v1/completions        text completion, streamed or not
    GET  /v1/models             the one model served
    GET  /health                {"status": "ok", ...} with the engine's counters
    GET  /                      the chat page (static/index.html) when it is there

Streams are server-sent events as OpenAI sends them (``data: {chunk}`` lines, the last
``data: [DONE]``; ``stream_options.include_usage`` adds a final chunk with the usage).  Errors are
OpenAI's error JSON ``{"error": {"message", "type", "param", "code"}}``: 400 naming the bad field
(`tpcore.serve.openai_protocol`), 401 without the right ``Authorization: Bearer`` key when the
server has one, 404 an unknown model or path, 413 a body over the bound, 400 a prompt longer than
the context (both numbers said), 503 when the server holds --max-queue requests.  A client that
goes away mid-request has its request cancelled at the next engine step.

Imports: tpcore.models (SamplingParams; the Tokenizer's chat template), tpcore.serve (driver,
openai_protocol); starlette (the serve extra).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import os
from typing import Any, Dict, List, Optional

from tpcore.models.sampling import SamplingParams
from tpcore.serve import openai_protocol as proto
from tpcore.serve.openai_protocol import APIError, Spec

__all__ = ["ServerState", "make_app"]

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


class ServerState:
    """What the HTTP handlers need (rank 0).

    Parameters
    ----------
    driver : tpcore.serve.driver.Driver
        The loop that feeds the engine.
    model_name : str
        The name clients give as ``model``.
    tokenizer : tpcore.models.Tokenizer
        The model's tokenizer (its chat template, special tokens).
    max_len : int
        Tokens per request: prompt + completion.
    vocab_size : int
    eos : list of int
        The engine's end-of-sequence ids.
    chat_template : str, optional
        A Jinja chat template in place of the tokenizer's (--chat-template).
    defaults : dict, optional
        The model's generation_config: the sampling settings a request leaves out.
    api_key : str, optional
        Clients must send ``Authorization: Bearer <api_key>``.
    max_body : int, default 8 MiB
        Request bodies longer than this get 413.
    world_size : int, default 1
    """

    def __init__(self, driver, model_name: str, tokenizer, max_len: int, vocab_size: int, eos: List[int],
                 chat_template: Optional[str] = None, defaults: Optional[Dict[str, Any]] = None,
                 api_key: Optional[str] = None, max_body: int = 8 << 20, world_size: int = 1) -> None:
        self.driver, self.model_name, self.tok = driver, model_name, tokenizer
        self.max_len, self.vocab_size, self.eos = max_len, vocab_size, list(eos)
        self.chat_template = chat_template
        self.defaults = dict(defaults or {})
        self.api_key, self.max_body, self.world_size = api_key, max_body, world_size
        self.created = proto.now()
        self._ids = 0

    def next_id(self, kind: str) -> str:
        """A response id ("chatcmpl-..." / "cmpl-...").

        Parameters
        ----------
        kind : str
            "chat" or "completion".
        """
        self._ids += 1
        return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{os.getpid():x}{self._ids:08x}"


# ---------------------------------------------------------------------------- requests in
def _reject_constant(name):
    raise ValueError(f"{name} is not valid JSON")


async def _body(request, state: ServerState) -> Any:
    """The decoded JSON body, read up to the bound (413 past it; 400 malformed)."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > state.max_body:
        raise APIError(413, f"the request body is {int(cl)} bytes, more than this server takes "
                            f"({state.max_body} bytes)", code="request_too_large")
    data, n = [], 0
    async for c in request.stream():
        n += len(c)
        if n > state.max_body:
            raise APIError(413, f"the request body is more than this server takes ({state.max_body} bytes)",
                           code="request_too_large")
        data.append(c)
    try:
        return json.loads(b"".join(data).decode("utf-8"), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


def _check_auth(request, state: ServerState) -> None:
    if state.api_key is None:
        return
    got = request.headers.get("authorization", "")
    want = f"Bearer {state.api_key}"
    if not hmac.compare_digest(got.encode("utf-8", "replace"), want.encode()):
        raise APIError(401, "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' with the "
                            "key this server was started with (--api-key)",
                       code="invalid_api_key", type="authentication_error")


def _prompt_ids(spec: Spec, state: ServerState) -> List[int]:
    if spec.kind == "chat":
        if (state.chat_template or state.tok.chat_template) is None:
            raise APIError(400, "this model has no chat template: start the server with --chat-template FILE (a "
                                "Jinja template) or use /v1/completions", param="messages", code="no_chat_template")
        try:
            text = state.tok.apply_chat_template(spec.messages, chat_template=state.chat_template)
        except (TypeError, ValueError) as e:  # the template's raise_exception, or it failed on these messages
            raise APIError(400, f"the chat template refused the messages: {e}", param="messages") from None
        return state.tok.encode(text, add_special_tokens=False)
    if isinstance(spec.prompt, str):
        return state.tok.encode(spec.prompt)
    if max(spec.prompt) >= state.vocab_size:
        raise APIError(400, f"'prompt' holds the token id {max(spec.prompt)}, past the vocabulary "
                            f"({state.vocab_size} ids)", param="prompt")
    return list(spec.prompt)


def _payload(spec: Spec, ids: List[int], state: ServerState) -> Dict[str, Any]:
    """The engine's settings for the request (checked against the context)."""
    n, where = len(ids), "messages" if spec.kind == "chat" else "prompt"
    if n == 0:
        raise APIError(400, f"the {where} gave no tokens", param=where)
    if n >= state.max_len:
        raise APIError(400, f"This model's maximum context length is {state.max_len} tokens. However, your "
                            f"{where} has {n} tokens (at most {state.max_len - 1}, to leave room for one "
                            f"generated token)", param=where, code="context_length_exceeded")
    new = state.max_len - n if spec.max_tokens is None else spec.max_tokens
    if n + new > state.max_len:
        raise APIError(400, f"This model's maximum context length is {state.max_len} tokens. However, you "
                            f"requested {n + new} tokens ({n} in the {where}, {new} in the completion). Please "
                            f"reduce the length of the {where} or of max_tokens", param="max_tokens",
                       code="context_length_exceeded")
    bad = [t for t in spec.stop_token_ids if t >= state.vocab_size]
    if bad:
        raise APIError(400, f"'stop_token_ids' holds {bad[0]}, past the vocabulary ({state.vocab_size} ids)",
                       param="stop_token_ids")
    kw = {k: getattr(spec, k) for k in proto.SAMPLING}
    kw["seed"] = None if spec.seed is None else spec.seed % 2 ** 64
    try:
        sp = SamplingParams.make("request", state.defaults, logprobs=spec.logprobs, **kw)
    except (TypeError, ValueError) as e:  # a setting the protocol let through, or a bad generation_config
        raise APIError(400, str(e)) from None
    eos = ([] if spec.ignore_eos else state.eos) + spec.stop_token_ids
    return {"p": ids, "n": new, "eos": eos or -1, "sp": dataclasses.asdict(sp)}


# ---------------------------------------------------------------------------- responses out
def _error(e: APIError):
    from starlette.responses import JSONResponse
    return JSONResponse(e.body(), status_code=e.status)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _logprobs(spec: Spec, entries, offset: int):
    if spec.logprobs is None:
        return None
    return proto.chat_logprobs(entries) if spec.kind == "chat" else proto.completion_logprobs(entries, offset)


async def _wait_disconnect(request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _collect(request, state: ServerState, spec: Spec, h, prompt_len: int):
    """The whole response (non-streamed), or None when the client went away (cancelled)."""
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    text, entries = [], []
    try:
        while True:
            get = asyncio.ensure_future(h.queue.get())
            await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                state.driver.cancel(h.uid)
                return None
            for ev in get.result():
                if ev[0] == "text":
                    text.append(ev[1])
                    entries += ev[2] or []
                elif ev[0] == "error":
                    raise APIError(ev[1], ev[2])
                else:
                    body = proto.response(spec, state.next_id(spec.kind), proto.now(), "".join(text), ev[1],
                                          proto.usage(prompt_len, ev[2]), _logprobs(spec, entries, 0))
                    from starlette.responses import JSONResponse
                    return JSONResponse(body)
    finally:
        watcher.cancel()


async def _stream(state: ServerState, spec: Spec, h, prompt_len: int):
    """The server-sent events of one streamed response; cancels the request when the client
    goes away (the generator is closed while it waits)."""
    rid, created, offset, finished = state.next_id(spec.kind), proto.now(), 0, False
    try:
        if spec.kind == "chat":
            yield _sse(proto.chunk(spec, rid, created, "", role=True))
        while True:
            for ev in await h.queue.get():
                if ev[0] == "text":
                    yield _sse(proto.chunk(spec, rid, created, ev[1], logprobs=_logprobs(spec, ev[2] or [], offset)))
                    offset += len(ev[1])
                elif ev[0] == "error":
                    finished = True
                    yield _sse(APIError(ev[1], ev[2]).body())
                    yield "data: [DONE]\n\n"
                    return
                else:
                    finished = True
                    yield _sse(proto.chunk(spec, rid, created, "", finish=ev[1]))
                    if spec.include_usage:
                        yield _sse(proto.chunk(spec, rid, created, None, use=proto.usage(prompt_len, ev[2])))
                    yield "data: [DONE]\n\n"
                    return
    finally:
        if not finished:
            state.driver.cancel(h.uid)


async def _generate(request, state: ServerState, parse):
    from starlette.responses import StreamingResponse
    try:
        _check_auth(request, state)
        spec = parse(await _body(request, state))
        if spec.model != state.model_name:
            raise APIError(404, f"The model `{spec.model}` does not exist (this server has `{state.model_name}`)",
                           param="model", code="model_not_found")
        ids = _prompt_ids(spec, state)
        payload = _payload(spec, ids, state)
        queue = asyncio.Queue()
        try:
            h = state.driver.submit(payload, asyncio.get_running_loop(), queue, spec.stop)
        except OverflowError as e:
            raise APIError(503, str(e), code="queue_full") from None
        except RuntimeError as e:
            raise APIError(503, str(e), code="unavailable") from None
        if spec.stream:
            return StreamingResponse(_stream(state, spec, h, len(ids)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        resp = await _collect(request, state, spec, h, len(ids))
        if resp is None:
            from starlette.responses import Response
            return Response(status_code=499)
        return resp
    except APIError as e:
        return _error(e)


def make_app(state: ServerState):
    """The Starlette app of the module doc.

    Parameters
    ----------
    state : ServerState

    Returns
    -------
    starlette.applications.Starlette
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import FileResponse, JSONResponse
    from starlette.routing import Route

    async def chat(request):
        return await _generate(request, state, proto.parse_chat)

    async def completions(request):
        return await _generate(request, state, proto.parse_completion)

    async def models(request):
        try:
            _check_auth(request, state)
        except APIError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tpcore",
             "max_model_len": state.max_len}]})

    async def health(request):
        d = state.driver
        ok = d.failed is None
        return JSONResponse({"status": "ok" if ok else "failed", "model": state.model_name,
                             "world_size": state.world_size, "in_server": d.in_server, "engine": d.snapshot,
                             **({} if ok else {"error": d.failed})}, status_code=200 if ok else 503)

    async def index(request):
        page = os.path.join(STATIC, "index.html")
        if not os.path.isfile(page):
            return _error(APIError(404, "no chat page here (tpcore/serve/static/index.html is not installed)"))
        return FileResponse(page, media_type="text/html")

    async def http_error(request, exc):
        return _error(APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                               code="not_found" if exc.status_code == 404 else None))

    routes = [Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/", index, methods=["GET"])]
    async def server_error(request, exc):
        import traceback
        traceback.print_exception(exc)
        return _error(APIError(500, f"the server failed on this request: {type(exc).__name__}: {exc}"))

    return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
