"""One request of the engine: its tokens, sampling state, output text and timings (`Request`),
made by `tpcore.serve.Engine.submit`."""
from __future__ import annotations

import time
from typing import Any, List, Optional

import numpy as np

__all__ = ["Request"]


class Request:
    """One submitted request and what it got (made by `Engine.submit`, not by hand).

    Attributes
    ----------
    id : int
        The engine's number for it, in submission order.
    prompt : numpy.ndarray
        The prompt's ids (int64).
    max_new_tokens : int
        Generated ids at most.
    params : tpcore.models.sampling.SamplingParams
        Its sampling settings.
    stop : list of str
        Stop strings (the output ends before the first one; it is not in `text`).
    done : bool
        Whether it finished.
    finish_reason : {"stop", "length", "error", "cancelled"} or None
        Why it finished (None while it runs): "stop" an end-of-sequence id, one of
        stop_token_ids or a stop string; "length" max_new_tokens; "error" its logits held NaN
        or +inf, or were all -inf (`error` says at which step); "cancelled" `Engine.cancel`.
    error : ValueError or None
        Why it failed (finish_reason "error"); the tokens before that step stay in tokens.
    logprobs : list of TokenLogprob
        One per generated token when the sampling settings ask for logprobs (else empty).
    num_cached_tokens : int
        Prompt tokens served by the prefix cache at its (last) admission.
    preemptions : int
        Times it was evicted from the KV pool to make room, and recomputed later.
    submitted, first_token, finished : float or None
        time.perf_counter() times.
    token_times : list of float
        One time per generated token.
    tokens, text, ttft, latencies
        See the properties.
    """

    __slots__ = ("id", "prompt", "max_new_tokens", "eos", "params", "stop", "stop_ids", "sampler", "_out", "_all",
                 "computed", "logprobs", "done", "finish_reason", "error", "submitted", "first_token", "token_times",
                 "finished", "num_cached_tokens", "preemptions", "_detok", "_stopper", "_text", "running")

    def __init__(self, rid: int, prompt: np.ndarray, max_new_tokens: int, eos: List[int], params: Any, sampler: Any,
                 stop: List[str], stop_ids: List[int], detok: Any = None, stopper: Any = None) -> None:
        self.id, self.prompt, self.max_new_tokens, self.eos = rid, prompt, max_new_tokens, eos
        self.params, self.sampler, self.stop, self.stop_ids = params, sampler, stop, set(stop_ids) | set(eos)
        self._out: List[int] = []
        self._all: List[int] = prompt.tolist()   # prompt + output: what the KV cache must hold
        self.computed = 0                       # positions of _all whose keys/values are cached
        self.logprobs: List[Any] = []
        self.done, self.finish_reason = False, None
        self.error: Optional[ValueError] = None
        self.submitted, self.first_token, self.finished = time.perf_counter(), None, None
        self.token_times: List[float] = []
        self.num_cached_tokens = self.preemptions = 0
        self._detok, self._stopper, self._text = detok, stopper, ""
        self.running = False

    @property
    def tokens(self) -> np.ndarray:
        """The generated ids (int64), the end-of-sequence / stop id included when it stopped on one."""
        return np.array(self._out, np.int64)

    def tokens_since(self, start: int) -> List[int]:
        """The generated ids from index start on, as a list (a streaming front end's new ids).

        Parameters
        ----------
        start : int
            Ids already taken.
        """
        return self._out[start:]

    @property
    def text(self) -> Optional[str]:
        """The generated text so far (None when the model has no tokenizer): stop strings and
        special tokens left out; a character still being completed by the next token (UTF-8
        split over tokens) or text that may begin a stop string is held back until it is
        settled (all of it is here once the request is done)."""
        return None if self._detok is None else self._text

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from submit to the first generated token (None before it)."""
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def latencies(self) -> np.ndarray:
        """Seconds between consecutive generated tokens (len(tokens) - 1 gaps)."""
        return np.diff(np.array(self.token_times, np.float64))

    def _finish(self, reason: str, now: float) -> None:
        self.done, self.finish_reason, self.finished, self.running = True, reason, now, False
        if self._stopper is not None and reason != "stop":
            self._text += self._stopper.flush()

    def _push_text(self, t: int) -> bool:
        """Detokenize id t into text; True when a stop string appeared (text cut before it)."""
        if self._detok is None:
            return False
        piece = self._detok.push(t)
        if self._stopper is None:
            self._text += piece
            return False
        emit, hit = self._stopper.push(piece)
        self._text += emit
        return hit

    def __repr__(self) -> str:
        state = f"done ({self.finish_reason})" if self.done else ("running" if self.running else "waiting")
        return (f"Request(id={self.id}, prompt of {self.prompt.size} tokens, {len(self._out)}/{self.max_new_tokens} "
                f"generated, {state})")
