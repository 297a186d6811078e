"""The OpenAI API's request bodies, checked (as OpenAI and vLLM's protocol models check them),
and its response objects.

`parse_chat` / `parse_completion` take a decoded JSON body and give a `Spec` (the request's
settings, each checked) or raise `APIError` (HTTP status, OpenAI error JSON naming the field).
`chat_response`, `completion_response`, `chunk` build what the server sends back.

Imports: nothing of tpcore.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

__all__ = ["APIError", "Spec", "parse_chat", "parse_completion", "MAX_STOPS", "MAX_STOP_CHARS", "MAX_LOGPROBS",
           "SAMPLING"]

MAX_STOPS = 16          # stop strings per request (OpenAI: 4)
MAX_STOP_CHARS = 1024   # characters per stop string
MAX_LOGPROBS = 20       # top_logprobs (chat) / logprobs (completions), as OpenAI's and vLLM's bound
MAX_STOP_TOKEN_IDS = 256
_ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """An HTTP error in the OpenAI error JSON.

    Parameters
    ----------
    status : int
        The HTTP status (400, 401, 404, 413, 503...).
    message : str
        What was wrong, naming the field and what was expected.
    param : str, optional
        The field (OpenAI's ``param``).
    code : str, optional
        OpenAI's ``code`` (e.g. "model_not_found", "invalid_api_key").
    type : str, optional
        OpenAI's ``type``; default: "invalid_request_error" below 500, else "server_error".
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> Dict[str, Any]:
        """The OpenAI error JSON: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Spec:
    """One request's settings, checked (`parse_chat`, `parse_completion`)."""
    kind: str                              # "chat" or "completion"
    model: str
    messages: Optional[List[Dict[str, Any]]] = None
    prompt: Any = None                     # str or list of int (completions)
    stream: bool = False
    include_usage: bool = False
    max_tokens: Optional[int] = None       # None: the rest of the context
    temperature: Optional[float] = None    # the sampling settings: None when the body did not set them
    top_p: Optional[float] = None          # (the model's generation_config then gives them)
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    stop_token_ids: List[int] = field(default_factory=list)
    logprobs: Optional[int] = None         # None: none; k: the chosen token's and the top k
    echo: bool = False
    ignore_eos: bool = False               # vLLM's: generate past the end-of-sequence ids


def _bad(name: str, want: str, got: Any) -> APIError:
    shown = repr(got) if not isinstance(got, (dict, list)) else type(got).__name__
    if isinstance(got, str) and len(got) > 40:
        shown = repr(got[:40]) + "..."
    return APIError(400, f"'{name}' must be {want}, got {shown}", param=name)


def _int(body, name, lo, hi, default=None):
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and lo <= v <= hi:
            return int(v)
        raise _bad(name, f"an integer in [{lo}, {hi}]", v)
    if not lo <= v <= hi:
        raise _bad(name, f"an integer in [{lo}, {hi}]", v)
    return v


def _num(body, name, lo, hi, default):
    v = body.get(name, None)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"a number in [{lo}, {hi}]", v)
    if not lo <= v <= hi:
        raise _bad(name, f"a number in [{lo}, {hi}]", v)
    return float(v)


def _bool(body, name, default=False):
    v = body.get(name, None)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, "true or false", v)
    return v


def _stops(body) -> List[str]:
    v = body.get("stop", None)
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise _bad("stop", "a string or a list of strings", v)
    if len(v) > MAX_STOPS:
        raise APIError(400, f"'stop' may hold at most {MAX_STOPS} strings, got {len(v)}", param="stop")
    for i, s in enumerate(v):
        if not isinstance(s, str) or not s:
            raise _bad(f"stop[{i}]", "a non-empty string", s)
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"'stop[{i}]' may be at most {MAX_STOP_CHARS} characters long, got {len(s)}",
                           param="stop")
    return list(v)


def _stop_ids(body) -> List[int]:
    v = body.get("stop_token_ids", None)
    if v is None:
        return []
    if not isinstance(v, list) or len(v) > MAX_STOP_TOKEN_IDS:
        raise _bad("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} token ids", v)
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise _bad(f"stop_token_ids[{i}]", "a token id (an integer >= 0)", t)
    return list(v)


# Fields OpenAI knows that this server takes only at their no-op values: name -> (allowed, what)
_NOOPS = {
    "n": ((None, 1), "1 (one choice per request)"),
    "best_of": ((None, 1), "1"),
    "user": None, "metadata": None, "store": ((None, False), "false"), "service_tier": None,
    "logit_bias": ((None, {}), "null or {} (logit_bias is not supported)"),
    "tools": ((None, []), "null or [] (tools are not supported)"),
    "tool_choice": ((None, "none", "auto"), "'none' (tools are not supported)"),
    "parallel_tool_calls": None,
    "response_format": (({"type": "text"}, None), "{'type': 'text'} (structured output is not supported)"),
    "suffix": ((None, ""), "null (suffix is not supported)"),
}
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "seed")
_COMMON = {"model", "stream", "stream_options", "max_tokens", "stop", "stop_token_ids", "logprobs",
           "ignore_eos"} | set(SAMPLING)
_CHAT = _COMMON | {"messages", "top_logprobs", "max_completion_tokens"} | set(_NOOPS) - {"best_of", "suffix"}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix", "user", "logit_bias", "n", "metadata", "store",
                         "service_tier"}


def _common(body: Dict[str, Any], kind: str, allowed: set) -> Spec:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for k in body:
        if k not in allowed:
            raise APIError(400, f"Unrecognized request argument supplied: {k}", param=k)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "a model name (a non-empty string; GET /v1/models lists them)", model)
    for name, rule in _NOOPS.items():
        if rule is not None and name in body and body[name] not in rule[0]:
            raise _bad(name, rule[1], body[name])
    s = Spec(kind=kind, model=model, stream=_bool(body, "stream"))
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or set(so) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", "an object {'include_usage': bool}", so)
        if not s.stream:
            raise APIError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
        s.include_usage = _bool(so, "include_usage")
    s.temperature = _num(body, "temperature", 0.0, 2.0, None)
    s.top_p = _num(body, "top_p", 0.0, 1.0, None)
    if s.top_p == 0.0:
        raise _bad("top_p", "a number in (0, 1]", body["top_p"])
    s.top_k = _int(body, "top_k", -1, 2 ** 31 - 1, None)
    s.top_k = 0 if s.top_k == -1 else s.top_k
    s.min_p = _num(body, "min_p", 0.0, 1.0, None)
    s.presence_penalty = _num(body, "presence_penalty", -2.0, 2.0, None)
    s.frequency_penalty = _num(body, "frequency_penalty", -2.0, 2.0, None)
    s.repetition_penalty = _num(body, "repetition_penalty", 0.0, 1e6, None)
    if s.repetition_penalty == 0.0:
        raise _bad("repetition_penalty", "a number > 0", 0.0)
    s.seed = _int(body, "seed", -2 ** 63, 2 ** 64 - 1)
    s.max_tokens = _int(body, "max_tokens", 1, 2 ** 62)
    s.stop = _stops(body)
    s.stop_token_ids = _stop_ids(body)
    s.ignore_eos = _bool(body, "ignore_eos")
    return s


def _content(m: Dict[str, Any], i: int) -> Any:
    c = m.get("content")
    where = f"messages[{i}].content"
    if c is None:
        if m["role"] == "assistant":
            return None
        raise _bad(where, "a string or a list of text parts", c)
    if isinstance(c, str):
        return c
    if not isinstance(c, list):
        raise _bad(where, "a string or a list of text parts", c)
    parts = []
    for j, p in enumerate(c):
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str) or \
                set(p) - {"type", "text"}:
            raise _bad(f"{where}[{j}]", "a text part {'type': 'text', 'text': str} (only text is supported)", p)
        parts.append(p["text"])
    return "\n".join(parts)  # as vLLM gives a template that expects a string


def parse_chat(body: Any) -> Spec:
    """A POST /v1/chat/completions body, checked.

    Parameters
    ----------
    body : object
        The decoded JSON.

    Returns
    -------
    Spec

    Raises
    ------
    APIError
        400 naming the first bad field.
    """
    s = _common(body, "chat", _CHAT)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", "a non-empty list of messages", msgs)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", "an object {'role', 'content'}", m)
        if m.get("role") not in _ROLES:
            raise _bad(f"messages[{i}].role", f"one of {list(_ROLES)}", m.get("role"))
        extra = set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"}
        if extra:
            raise APIError(400, f"Unrecognized argument in messages[{i}]: {sorted(extra)[0]}",
                           param=f"messages[{i}].{sorted(extra)[0]}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise _bad(f"messages[{i}].name", "a string", m["name"])
        if m.get("tool_calls") not in (None, []):
            raise _bad(f"messages[{i}].tool_calls", "absent (tools are not supported)", m["tool_calls"])
        msg = {"role": m["role"], "content": _content(m, i)}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        out.append(msg)
    s.messages = out
    mct = _int(body, "max_completion_tokens", 1, 2 ** 62)
    if mct is not None:
        s.max_tokens = mct
    want = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    s.logprobs = (top or 0) if want else None
    return s


def parse_completion(body: Any) -> Spec:
    """A POST /v1/completions body, checked.

    Parameters
    ----------
    body : object
        The decoded JSON.

    Returns
    -------
    Spec

    Raises
    ------
    APIError
        400 naming the first bad field.
    """
    s = _common(body, "completion", _COMPLETION)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list: as OpenAI takes it
    if isinstance(p, str):
        if not p:
            raise _bad("prompt", "a non-empty string or list of token ids", p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if min(p) < 0:
            raise _bad("prompt", "token ids >= 0", min(p))
    else:
        raise _bad("prompt", "a non-empty string or list of token ids (one prompt per request)", p)
    s.prompt = p
    s.logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    s.echo = _bool(body, "echo")
    if s.echo:
        raise _bad("echo", "false (echo is not supported)", True)
    return s


def usage(prompt: int, completion: int, cached: int = 0) -> Dict[str, Any]:
    """OpenAI's usage object.

    Parameters
    ----------
    prompt, completion : int
        Token counts.
    cached : int, default 0
        Prompt tokens served from the prefix cache.
    """
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_logprobs(entries: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The chat form: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}.

    Parameters
    ----------
    entries : list of dict
        Per token: token (str), logprob (float), top (list of (str, float)).
    """
    def one(t, lp):
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [dict(one(e["token"], e["logprob"]),
                             top_logprobs=[one(t, lp) for t, lp in e["top"]]) for e in entries]}


def completion_logprobs(entries: List[Dict[str, Any]], offset0: int) -> Dict[str, Any]:
    """The completions form: tokens, token_logprobs, top_logprobs (dicts), text_offset.

    Parameters
    ----------
    entries : list of dict
        Per token: token (str), logprob (float), top (list of (str, float)).
    offset0 : int
        The text offset of the first token.
    """
    offs, o = [], offset0
    for e in entries:
        offs.append(o)
        o += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [dict(e["top"]) for e in entries], "text_offset": offs}


def response(spec: Spec, rid: str, created: int, text: str, finish: Optional[str], use: Dict[str, Any],
             logprobs: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A whole (non-streamed) chat.completion or text_completion object.

    Parameters
    ----------
    spec : Spec
    rid : str
        The response id.
    created : int
        Unix time.
    text : str
        The generated text.
    finish : str or None
        "stop" or "length".
    use : dict
        `usage`.
    logprobs : dict or None
        `chat_logprobs` / `completion_logprobs`.
    """
    if spec.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                  "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": spec.model, "choices": [choice], "usage": use}


def chunk(spec: Spec, rid: str, created: int, text: Optional[str], finish: Optional[str] = None,
          logprobs: Optional[Dict[str, Any]] = None, role: bool = False,
          use: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """One streamed chunk (chat.completion.chunk or text_completion).

    Parameters
    ----------
    spec : Spec
    rid : str
    created : int
    text : str or None
        The new text (None: a chunk without a choice, for the final usage).
    finish : str, optional
        The finish reason (the last choice chunk).
    logprobs : dict, optional
        This chunk's tokens' logprobs.
    role : bool, default False
        The first chat chunk: delta carries role "assistant".
    use : dict, optional
        The usage (the final chunk when stream_options.include_usage; null on the others).
    """
    if spec.kind == "chat":
        obj = "chat.completion.chunk"
        delta: Dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choices = [] if text is None else [{"index": 0, "delta": delta, "logprobs": logprobs,
                                            "finish_reason": finish}]
    else:
        obj = "text_completion"
        choices = [] if text is None else [{"index": 0, "text": text, "logprobs": logprobs,
                                            "finish_reason": finish}]
    out = {"id": rid, "object": obj, "created": created, "model": spec.model, "choices": choices}
    if spec.include_usage:
        out["usage"] = use
    return out


def now() -> int:
    """Unix time in whole seconds (the objects' ``created``)."""
    return int(time.time())
