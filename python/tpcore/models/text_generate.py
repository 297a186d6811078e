"""Text generation for people: `TransformerLM.chat` and `generate("a string")`, whole or streamed,
with stop strings.

    reply = model.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=64)
    for piece in model.chat(messages, stream=True): print(piece, end="", flush=True)
    text = model.generate("Once upon a time", max_new_tokens=32, stop=["\\n\\n"])

On top of `TransformerLM.iter_generate` (one prompt, token by token): the
prompt encoded by the model's tokenizer (`tpcore.models.text`), or a conversation rendered
by its chat template first; each token's text from an `IncrementalDetokenizer` (no half
characters), passed through a `StopMatcher` (a stop string split over tokens is never sent;
generation ends where one is found).  SPMD: every rank calls with the same arguments (they
are checked to agree) and, when streaming, consumes the whole stream: every rank runs the
same steps, and a stop string ends them on every rank at the same token.
"""
from __future__ import annotations

from typing import Any, Iterator, List, Optional, Union

import numpy as np

from tpcore.distributed.agree import agree
from tpcore.models.text import IncrementalDetokenizer, StopMatcher, Tokenizer
from tpcore.utils.args import shown

__all__ = ["generate_text", "chat", "SAMPLING_ARGS"]

SAMPLING_ARGS = ("temperature", "top_k", "seed", "eos_token_id", "pad_token_id", "top_p", "min_p",
                 "repetition_penalty", "presence_penalty", "frequency_penalty", "sampling")
CHAT_MAX_NEW_TOKENS = 512


class _TextMixin:
    """`TransformerLM.chat`; the ``tokenizer`` attribute (None until a loader sets it)."""

    tokenizer: Optional[Tokenizer] = None

    def chat(self, messages: Any, stream: bool = False, max_new_tokens: int = CHAT_MAX_NEW_TOKENS,
             stop: Any = None, chat_template: Optional[str] = None, **sampling: Any) -> Union[str, Iterator[str]]:
        """The model's reply to a conversation, through its chat template and tokenizer.

        Parameters
        ----------
        messages : list of dict
            The conversation, {"role": "system" | "user" | "assistant", "content": str} each.
        stream : bool, default False
            Return an iterator of the reply's pieces as they are generated (each piece whole
            characters) instead of the reply.
        max_new_tokens : int, default 512
            At most this many tokens in the reply.
        stop : str or list of str, optional
            The reply ends before the first of these strings (not included).
        chat_template : str, optional
            A Jinja chat template instead of the checkpoint's.
        **sampling
            temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
            frequency_penalty, seed, eos_token_id, pad_token_id or sampling (a SamplingParams)
            as `generate` takes them (default: the checkpoint's generation_config, else greedy);
            the reply ends at the tokenizer's and generation_config's eos ids.

        Returns
        -------
        str or iterator of str

        Raises
        ------
        ValueError
            The model has no tokenizer, or no chat template (the message names
            ``--chat-template``); a bad argument (TypeError for a wrong kind), named.

        Notes
        -----
        Collective, as `generate`: every rank calls it alike and, streaming, reads every piece.
        """
        return chat(self, messages, stream, max_new_tokens, stop, chat_template, **sampling)


def _tokenizer(model, who: str) -> Tokenizer:
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError(f"{who}: text needs the model's tokenizer, and this model has none (load a GGUF file that "
                         f"carries one, or a folder with tokenizer.json; or set model.tokenizer = "
                         f"tpcore.models.text.load_tokenizer(PATH)); pass token ids instead")
    return tok


def _stops(stop, who: str) -> List[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise TypeError(f"{who}: stop must be a string or a list of strings, got {shown(stop)}")
    if any(not s for s in stops):
        raise ValueError(f"{who}: stop strings must not be empty")
    return list(stops)


def _start(model, ids: List[int], max_new_tokens, who: str, stops: List[str], eos_default, sampling: dict):
    """The token stream (`TransformerLM.iter_generate`: the arguments checked and agreed across
    ranks there), then the stop strings agreed too."""
    unknown = sorted(set(sampling) - set(SAMPLING_ARGS))
    if unknown:
        raise TypeError(f"{who}: unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (the "
                        f"sampling arguments are {', '.join(SAMPLING_ARGS)})")
    kw = {"eos_token_id": eos_default, **sampling}
    stream = model.iter_generate([np.asarray(ids, np.int64)], max_new_tokens, **kw)
    if model.comm.size > 1:
        blob = np.frombuffer("\0".join(stops).encode("utf-8"), np.uint8)
        agree(model.comm, who, [("the stop strings differ", (np.array(len(stops)), blob), None)])
    return stream


def _tokens(stream) -> Iterator[int]:
    """The generated ids one by one, ending before an eos id (the stream closed at the end)."""
    try:
        for ids in stream:
            t = int(ids[0])
            if stream.done[0] and t in stream.eos_ids:
                return
            yield t
    finally:
        stream.close()


def _pieces(tok: Tokenizer, prompt_ids: List[int], tokens: Iterator[int], stops: List[str]) -> Iterator[str]:
    """The text of tokens, piece by piece: whole characters, stop strings cut (the token loop is
    closed at the first one)."""
    det, sm = IncrementalDetokenizer(tok, prompt_ids), StopMatcher(stops)
    try:
        for t in tokens:
            out, stopped = sm.push(det.push(t))
            if out:
                yield out
            if stopped:
                return
        out, stopped = sm.push(det.flush())
        out += "" if stopped else sm.flush()
        if out:
            yield out
    finally:
        tokens.close()


def _run(model, tok, ids, max_new_tokens, stream, stop, who, eos_default, sampling):
    if not isinstance(stream, bool):
        raise TypeError(f"{who}: stream must be True or False, got {shown(stream)}")
    stops = _stops(stop, who)
    pieces = _pieces(tok, ids, _tokens(_start(model, ids, max_new_tokens, who, stops, eos_default, sampling)), stops)
    return pieces if stream else "".join(pieces)


def generate_text(model, prompt: str, max_new_tokens: int = 16, stream: bool = False, stop: Any = None,
                  **sampling: Any) -> Union[str, Iterator[str]]:
    """`TransformerLM.generate` with a string prompt, or stream / stop: the text generated
    after the prompt (whole, or an iterator of pieces with stream=True).

    Parameters
    ----------
    model : TransformerLM
        A causal model with a tokenizer.
    prompt : str
        The prompt, encoded as the tokenizer does (its BOS token where it adds one).
    max_new_tokens : int, default 16
        At most this many tokens.
    stream : bool, default False
        An iterator of pieces instead of the text.
    stop : str or list of str, optional
        Generation ends before the first of these strings (not included).
    **sampling
        The sampling settings as `generate` takes them (temperature, top_k, top_p, ...).

    Returns
    -------
    str or iterator of str
    """
    who = "generate"
    if not isinstance(prompt, str):
        raise TypeError(f"{who}: stream and stop need a string prompt (text out), got {shown(prompt)}; pass the "
                        f"prompt as text, or leave stream / stop out for token ids")
    if getattr(model, "tokenizer", None) is None:   # a string where this model takes only token ids
        raise TypeError(f"{who}: prompts must be token ids for this model (it has no tokenizer to read text), got "
                        f"{shown(prompt)}; load a checkpoint that carries one or set model.tokenizer")
    tok = _tokenizer(model, who)
    return _run(model, tok, tok.encode(prompt), max_new_tokens, stream, stop, who, None, sampling)


def chat(model, messages: Any, stream: bool = False, max_new_tokens: int = CHAT_MAX_NEW_TOKENS, stop: Any = None,
         chat_template: Optional[str] = None, **sampling: Any) -> Union[str, Iterator[str]]:
    """`TransformerLM.chat` (see there): the conversation rendered by the chat template,
    encoded without added special tokens (the template writes them), the reply generated.

    Parameters
    ----------
    model : TransformerLM
        A causal model with a tokenizer.
    messages : list of dict
        The conversation.
    stream : bool, default False
        An iterator of pieces instead of the reply.
    max_new_tokens : int, default 512
        At most this many tokens.
    stop : str or list of str, optional
        Stop strings.
    chat_template : str, optional
        A template instead of the checkpoint's.
    **sampling
        As `generate_text`.
    """
    who = "chat"
    tok = _tokenizer(model, who)
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"{who}: chat_template must be a str (Jinja) or None, got {shown(chat_template)}")
    ids = tok.encode_chat(messages, chat_template=chat_template)
    gen = (getattr(model, "generation_config", None) or {}).get("eos_token_id")
    gen = [] if gen is None else list(gen) if isinstance(gen, (list, tuple)) else [gen]
    eos = list(dict.fromkeys(gen + tok.eos_token_ids))
    return _run(model, tok, ids, max_new_tokens, stream, stop, who, eos or None, sampling)
