"""Continuous batching over one tensor-parallel model (iteration-level scheduling, as vLLM and
llama.cpp's server do).

    engine = tpcore.Engine(model, max_batch=16)            # a pool of 16 KV-cache slots
    r = engine.submit(prompt_ids, max_new_tokens=32)       # any time between steps
    for done in engine.run():                              # until nothing waits or runs
        print(done.id, done.tokens, done.ttft, done.finish_reason)

The engine owns the model's KV cache: ``max_batch`` cache sequences (slots) of ``max_len``
tokens each.  Every ``step()`` (1) admits waiting requests into free slots, first come first
served; (2) prefills the newly admitted ones together, one forward over their prompts (right
padded, each in its own slot), which gives each its first token; (3) decodes every running
request together, one forward of one token per request (each at its own position, in its own
slot).  A request that reaches ``max_new_tokens`` or emits an end-of-sequence id is finished
in that step and its slot is free for the next waiting request at the next step.  Every
request gets the tokens ``model.generate([prompt], max_new_tokens)`` gives it alone (greedy;
sampling with the request's seed draws as generate does with that seed).  A request whose
logits no token can be picked from (NaN, +inf, or all -inf: the model's weights or activations
went bad) fails alone: it finishes with ``finish_reason == "error"`` and ``error`` the
ValueError generate() would raise for it (naming the request and the step), its slot is freed,
and the other requests go on.

SPMD: every rank of the model's communicator runs the same engine, submitting the same
requests in the same order and calling step() together (the logits are gathered on every
rank, so every rank picks the same tokens).  Each step agrees a running fingerprint of the
submitted requests with one all-gather of two int64: ranks that submitted different requests
get a ValueError on every rank instead of a hang or garbage.

Limits: one model forward per phase (a long prompt is not split into chunks; a prefill
waits for the whole batch of new prompts); no preemption (a request keeps its slot until it
finishes, so max_len must hold prompt + max_new_tokens); calling the model's generate() or
cache() while requests run reallocates the cache under them (the next step refuses to go on).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Deque, Dict, Iterator, List, Optional

import numpy as np

from tpcore import _C
from tpcore.distributed.agree import agree, fingerprint
from tpcore.utils.args import int_arg, is_int, real_arg, seed_arg, shown
from tpcore.utils.arrays import int_array
from tpcore.models.generate import eos_ids_arg, logits_error
from tpcore.models.sampling import Sampler, SamplingParams, TokenLogprob, sample_batch

__all__ = ["Engine", "Request"]

_MAX_LEN_CAP = 2048  # the default cache length when the model allows longer (rotary positions)


class Request:
    """One submitted request and what it got (made by `Engine.submit`, not by hand).

    Attributes
    ----------
    id : int
        The engine's number for it, in submission order.
    prompt : numpy.ndarray
        The prompt's ids (int64).
    done : bool
        Whether it finished.
    finish_reason : {"length", "eos", "error", "cancelled"} or None
        Why it finished (None while running).
    error : ValueError or None
        Why it failed (finish_reason "error"): its logits held NaN or +inf, or were all
        -inf, at the step named; the tokens before that step stay in tokens.
    submitted, first_token, finished : float or None
        time.perf_counter() times.
    token_times : list of float
        One time per generated token.
    sampling : SamplingParams
        How it picks its tokens.
    logprobs : list of TokenLogprob or None
        One per generated token when its sampling asked for logprobs (else None).
    tokens, ttft, latencies
        See the properties.
    """

    __slots__ = ("id", "prompt", "max_new_tokens", "eos", "sampling", "sampler", "_out",
                 "done", "finish_reason", "error", "submitted", "first_token", "token_times", "finished", "slot",
                 "logprobs", "cancelled")

    def __init__(self, rid, prompt, max_new_tokens, eos, sampling, vocab_size):
        self.id, self.prompt, self.max_new_tokens, self.eos = rid, prompt, max_new_tokens, eos
        self.sampling = sampling
        self.sampler = Sampler(sampling, vocab_size, prompt)
        self._out: List[int] = []
        self.done, self.finish_reason = False, None
        self.error: Optional[ValueError] = None
        self.submitted, self.first_token, self.finished = time.perf_counter(), None, None
        self.token_times: List[float] = []
        self.slot: Optional[int] = None  # the KV-cache slot while it runs
        self.logprobs: Optional[List[TokenLogprob]] = None if sampling.logprobs is None else []
        self.cancelled = False           # engine.cancel asked for it: it finishes at the next step

    @property
    def tokens(self) -> np.ndarray:
        """The generated ids (int64), the EOS id included when it stopped on one."""
        return np.array(self._out, np.int64)

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from submit to the first generated token (None before it)."""
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def latencies(self) -> np.ndarray:
        """Seconds between consecutive generated tokens (len(tokens) - 1 gaps)."""
        return np.diff(np.array(self.token_times, np.float64))

    def __repr__(self):
        state = f"done ({self.finish_reason})" if self.done else ("running" if self.slot is not None else "waiting")
        return (f"Request(id={self.id}, prompt of {self.prompt.size} tokens, {len(self._out)}/{self.max_new_tokens} "
                f"generated, {state})")


class Engine:
    """Continuous batching (serving) over a tensor-parallel causal TransformerLM.

    Requests come and go (`submit`, `step`, `run`); each runs in a KV-cache slot of a pool,
    decoded together with the others.  Every rank of the model's communicator runs the same
    engine with the same requests.

    Parameters
    ----------
    model : tpcore.models.TransformerLM
        A causal model, the whole model on each rank of its communicator (not a pipeline
        stage).  Its KV cache is (re)allocated for the pool.
    max_batch : int, default 16
        KV-cache slots (requests decoded together), >= 1.
    max_len : int, optional
        Tokens per slot: prompt + max_new_tokens of any request.  Default None: the model's
        max_positions, at most 2048, and its sliding window.
    eos_token_id : int or list of int, optional
        The requests' default end-of-sequence id(s).  Default None: the model's
        generation_config, as generate().
    pad_token_id : int, optional
        Right-pads the shorter prompts of a batched prefill (never attended to: any id of
        the vocabulary).  Default None: 0.
    max_prefill_tokens : int, optional
        At most this many (padded) prompt tokens prefilled per step, so that admitting
        requests stalls the running ones' next token less.  Default None: every admitted
        request at once (a request longer than the budget is prefilled alone).

    Raises
    ------
    TypeError
        model not a TransformerLM, an argument of the wrong type.
    ValueError
        An encoder or a pipeline stage, max_len past max_positions / sliding_window, an
        argument out of range.

    Notes
    -----
    Collectives: in `step` only (see there).
    """

    def __init__(self, model: Any, max_batch: int = 16, max_len: Optional[int] = None, eos_token_id: Any = None,
                 pad_token_id: Optional[int] = None, max_prefill_tokens: Optional[int] = None) -> None:
        from tpcore.models.lm import TransformerLM
        who = "Engine"
        if not isinstance(model, TransformerLM):
            raise TypeError(f"{who}: model must be a tpcore.TransformerLM, got {type(model).__name__}")
        cfg = model.config
        if not cfg.causal:
            raise ValueError(f"{who}: needs a causal (decoder) model")
        if not (model._first and model._last):
            raise ValueError(f"{who}: needs a whole model on each rank (not a pipeline stage)")
        self.model, self.comm = model, model.comm
        self.max_batch = int_arg(max_batch, who, "max_batch", lo=1, hi=2 ** 31 - 1)
        limit = cfg.max_positions if cfg.positions == "learned" else None
        if cfg.sliding_window:
            limit = cfg.sliding_window if limit is None else min(limit, cfg.sliding_window)
        if max_len is None:
            max_len = min(_MAX_LEN_CAP, cfg.max_positions if limit is None else limit)
        self.max_len = int_arg(max_len, who, "max_len", lo=2, hi=2 ** 31 - 1)
        if limit is not None and self.max_len > limit:
            why = "max_positions" if cfg.positions == "learned" and limit == cfg.max_positions else "sliding_window"
            raise ValueError(f"{who}: max_len={self.max_len} is past the model's {why} ({limit})")
        self.eos = self._eos(eos_token_id if eos_token_id is not None else
                             (getattr(model, "generation_config", {}) or {}).get("eos_token_id"), who)
        self.pad = 0 if pad_token_id is None else int_arg(pad_token_id, who, "pad_token_id", lo=0,
                                                          hi=cfg.vocab_size - 1)
        self.max_prefill_tokens = None if max_prefill_tokens is None else \
            int_arg(max_prefill_tokens, who, "max_prefill_tokens", lo=1, hi=2 ** 62)
        model.cache(self.max_batch, self.max_len)
        self._cache_ref = model.blocks[0]._filled if model.blocks else None  # the cache this engine made
        self._free: List[int] = list(range(self.max_batch))  # kept sorted: the lowest free slot first
        self._waiting: Deque[Request] = collections.deque()
        self._running: List[Request] = []
        self._next_id = 0
        self._by_id: Dict[int, Request] = {}  # the requests waiting or running, by id (for cancel)
        self._fp = 0          # running fingerprint of every submitted request, in order
        self._broken: Optional[str] = None
        self._broken_type: type = ValueError  # what a step raises once the engine is broken
        self._st = dict(steps=0, prefills=0, decodes=0, prefill_tokens=0, prefill_padded_max=0, generated_tokens=0,
                        finished=0, failed=0, cancelled=0, peak_running=0, prefill_s=0.0, decode_s=0.0, agree_s=0.0)

    # ------------------------------------------------------------------ requests
    def _eos(self, eos_token_id, who) -> List[int]:
        return eos_ids_arg(eos_token_id, self.model.config.vocab_size, who)

    def submit(self, prompt: Any, max_new_tokens: int, eos_token_id: Any = None, temperature: float = 0.0,
               top_k: Optional[int] = None, seed: int = 0, *, sampling: Optional[SamplingParams] = None) -> Request:
        """Queue a request (served by the next steps).

        Parameters
        ----------
        prompt : array_like of int, shape (n,)
            A non-empty 1-D sequence of token ids in [0, vocab_size).
        max_new_tokens : int
            Generated ids at most, >= 1 (prompt + max_new_tokens <= max_len).
        eos_token_id : int or list of int, optional
            Stop early at it (default None: the engine's; -1: never).
        temperature : float, default 0.0
            0: greedy; > 0: sampling, as generate() with that seed does.
        top_k : int, optional
            Sample from the k largest logits only.
        seed : int, default 0
            The request's sampling stream.
        sampling : SamplingParams, optional
            Every sampling setting (temperature, top_p, top_k, min_p, the penalties, seed,
            logprobs: `Request.logprobs`); given, temperature, top_k and seed must be left
            at their defaults.

        Returns
        -------
        Request
            Filled in as it runs.

        Raises
        ------
        TypeError, ValueError
            A bad prompt (empty, not 1-D, an id out of range), too long for max_len, or a
            bad sampling argument.

        Notes
        -----
        No collective: every rank must submit the same requests in the same order (checked
        at the next `step`).
        """
        who, cfg = "Engine.submit", self.model.config
        if isinstance(prompt, (str, bytes)) or prompt is None or is_int(prompt):
            raise TypeError(f"{who}: prompt must be a 1-D sequence of token ids, got {shown(prompt)}")
        p = int_array(prompt, who, "prompt")
        if p.ndim != 1:
            raise ValueError(f"{who}: prompt must be a 1-D sequence of token ids, got shape {p.shape}")
        if p.size == 0:
            raise ValueError(f"{who}: the prompt needs at least one token")
        lo, hi = int(p.min()), int(p.max())
        if lo < 0 or hi >= cfg.vocab_size:
            i = int(np.argmax((p < 0) | (p >= cfg.vocab_size)))
            raise ValueError(f"{who}: prompt holds {int(p[i])} at index {i}, out of range [0, vocab_size="
                             f"{cfg.vocab_size})")
        n = int_arg(max_new_tokens, who, "max_new_tokens", lo=1, hi=2 ** 31 - 1)
        if p.size > self.max_len - n:
            raise ValueError(f"{who}: a prompt of {p.size} tokens plus max_new_tokens={n} does not fit the engine's "
                             f"max_len={self.max_len} tokens per slot (prompts up to max_len - max_new_tokens = "
                             f"{self.max_len - n} tokens)")
        eos = self.eos if eos_token_id is None else self._eos(eos_token_id, who)
        if sampling is None:
            temp = real_arg(temperature, who, "temperature", lo=0)
            k = 0 if top_k is None else int_arg(top_k, who, "top_k", lo=0, hi=cfg.vocab_size)
            sampling = SamplingParams(temperature=temp, top_k=k, seed=seed_arg(seed, who))
        elif not isinstance(sampling, SamplingParams):
            raise TypeError(f"{who}: sampling must be a SamplingParams or None, got {shown(sampling)}")
        elif (temperature, top_k, seed) != (0.0, None, 0):
            raise ValueError(f"{who}: give temperature, top_k and seed in sampling, not beside it (got temperature="
                             f"{temperature!r}, top_k={top_k!r}, seed={seed!r})")
        r = Request(self._next_id, p.copy(), n, eos, sampling, cfg.vocab_size)
        self._next_id += 1
        sp = sampling
        sd = 0 if sp.seed is None else sp.seed
        self._fp = fingerprint(self._fp, p, n, np.array(eos, np.int64), sp.temperature, sp.top_k, sp.top_p, sp.min_p,
                               sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty,
                               sd - 2 ** 64 if sd >= 2 ** 63 else sd, -1 if sp.logprobs is None else sp.logprobs)
        self._by_id[r.id] = r
        self._waiting.append(r)
        return r

    def cancel(self, request_id: int) -> bool:
        """Cancel a request: it finishes with finish_reason "cancelled" at the next `step`
        (returned by it), its slot freed there.

        Parameters
        ----------
        request_id : int
            `Request.id` of a request of this engine.

        Returns
        -------
        bool
            True when it was waiting or running (it will finish cancelled); False when it had
            finished already (nothing to do).

        Raises
        ------
        TypeError
            request_id not an int.
        ValueError
            No request of this engine has that id.

        Notes
        -----
        No collective: every rank must cancel the same requests in the same order, between
        the same steps (checked at the next `step`).
        """
        rid = int_arg(request_id, "Engine.cancel", "request_id", lo=0, hi=2 ** 62)
        if rid >= self._next_id:
            raise ValueError(f"Engine.cancel: no request has id {rid} (ids so far: 0 to {self._next_id - 1})")
        r = self._by_id.get(rid)
        if r is None or r.done or r.cancelled:
            return False
        r.cancelled = True
        self._fp = fingerprint(self._fp, -1 - rid)
        return True

    def _finish_cancelled(self, now: float) -> List[Request]:
        """The cancelled requests leave the queue and the running set (their slots freed)."""
        out = [r for r in self._waiting if r.cancelled] + [r for r in self._running if r.cancelled]
        if not out:
            return out
        self._waiting = collections.deque(r for r in self._waiting if not r.cancelled)
        self._running = [r for r in self._running if not r.cancelled]
        for r in out:
            r.done, r.finish_reason, r.finished = True, "cancelled", now
            if r.slot is not None:
                self._free.append(r.slot)
                r.slot = None
            self._by_id.pop(r.id, None)
        self._free.sort()
        self._st["cancelled"] += len(out)
        return out

    # ------------------------------------------------------------------ stepping
    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests holding a KV-cache slot."""
        return len(self._running)

    def _agree(self):
        """Every rank submitted the same requests in the same order (one all-gather of two
        int64); a ValueError on every rank if not."""
        if self._broken:
            raise self._broken_type(self._broken)
        t = time.perf_counter()
        try:
            agree(self.comm, "Engine.step", [("the number of submitted requests differs", self._next_id, str),
                                             ("the submitted requests differ", (self._fp,), None)])
        except ValueError as e:
            self._broken = (f"{e} (every rank must submit the same requests in the same order; this engine "
                            f"cannot go on: make a new one)")
            raise ValueError(self._broken) from None
        finally:
            self._st["agree_s"] += time.perf_counter() - t
        m = self.model
        if m.blocks and m.blocks[0]._filled is not self._cache_ref:
            if self._running:
                self._broken = ("Engine.step: the model's KV cache was reallocated (generate() or cache() ran) "
                                "while requests were running: their cached tokens are gone; make a new engine")
                self._broken_type = RuntimeError
                raise RuntimeError(self._broken)
            m.cache(self.max_batch, self.max_len)  # nothing running: take the cache back
            self._cache_ref = m.blocks[0]._filled

    def _next_tokens(self, reqs: List[Request], last) -> np.ndarray:
        """The next id of each request from the hidden states `last` (B, hidden) of its last row;
        `bad_logits`'s code (< 0) for a request whose logits no token can be picked from (the
        logits are the same on every rank: every rank fails the same requests)."""
        m = self.model
        logits = m.gather_logits(m.logits_shard(last if m._kdev is not None else np.ascontiguousarray(last)))
        ids, lps = sample_batch(logits, [r.sampler for r in reqs])
        for r, lp in zip(reqs, lps):
            if lp is not None:
                r.logprobs.append(lp)
        return ids

    def _emit(self, reqs: List[Request], nxt: np.ndarray, now: float) -> List[Request]:
        """Append each request's new id; the ones that finish (or fail: no id, `_next_tokens`)
        leave the running set and free their slots.  Returns those."""
        done = []
        for r, t in zip(reqs, nxt.tolist()):
            if t < 0:  # this request alone fails; its slot is prefilled afresh by the next one
                r.error = logits_error("Engine", f"request {r.id}", len(r._out), t)
                r.done, r.finish_reason, r.finished = True, "error", now
                done.append(r)
                continue
            self._st["generated_tokens"] += 1
            r._out.append(t)
            r.sampler.accept(t)
            r.token_times.append(now)
            if r.first_token is None:
                r.first_token = now
            if t in r.eos or len(r._out) >= r.max_new_tokens:
                r.done, r.finish_reason, r.finished = True, ("eos" if t in r.eos else "length"), now
                done.append(r)
        if done:
            for r in done:
                self._free.append(r.slot)
                r.slot = None
                self._by_id.pop(r.id, None)
            self._free.sort()
            self._running = [r for r in self._running if not r.done]
            self._st["finished"] += len(done)
            self._st["failed"] += sum(r.error is not None for r in done)
        return done

    def step(self) -> List[Request]:
        """One iteration: admit waiting requests, prefill them, decode the running ones.

        Returns
        -------
        list of Request
            The requests that finished in it (in the order they were admitted), those that
            failed included (finish_reason "error", `Request.error` says why).

        Raises
        ------
        ValueError
            The ranks submitted different requests (every later step raises it too).
        RuntimeError
            An earlier step failed part-way (an interrupt, a communication error, memory),
            leaving requests without their tokens or cache rows.
        CommError, CommTimeout
            A collective failed.

        Notes
        -----
        Collective (every rank): one small all-gather that checks the requests agree, then
        the model's forwards (prefill, one decode of the running batch).
        """
        self._agree()
        try:
            return self._finish_cancelled(time.perf_counter()) + self._step()
        except BaseException as e:
            self._broken = (f"Engine.step: an earlier step failed part-way ({type(e).__name__}: {e}); its requests' "
                            f"KV-cache rows are incomplete, so this engine cannot go on: make a new one")
            self._broken_type = RuntimeError
            raise

    def _step(self) -> List[Request]:
        m, st, C = self.model, self._st, self.model.config.hidden
        st["steps"] += 1
        finished: List[Request] = []
        new: List[Request] = []
        longest, budget = 0, self.max_prefill_tokens
        while self._waiting and self._free:
            n = self._waiting[0].prompt.size
            if budget is not None and new and (len(new) + 1) * max(longest, n) > budget:
                break  # the rest waits for the next step (first come, first served)
            r = self._waiting.popleft()
            r.slot = self._free.pop(0)
            new.append(r)
            longest = max(longest, n)
        self._running.extend(new)
        st["peak_running"] = max(st["peak_running"], len(self._running))
        if new:  # one forward over the new prompts, right padded, each into its slot from position 0
            t0 = time.perf_counter()
            B, lens = len(new), np.array([r.prompt.size for r in new], np.int64)
            Tp = int(lens.max())
            padded = np.full((B, Tp), self.pad, np.int64)
            for b, r in enumerate(new):
                padded[b, :r.prompt.size] = r.prompt
            slots = np.array([r.slot for r in new], np.int64)
            h = m._forward(padded, pos0=np.zeros(B, np.int64), use_cache=True, _agreed=True, slots=slots)
            if m._kdev is not None:  # each prompt's last row, gathered where h lives (an embedding lookup)
                rows = np.ascontiguousarray(np.arange(B) * Tp + lens - 1, dtype=np.int64)
                from tpcore.models.lm import on_device
                last = _C.embedding_forward(on_device(rows, m._kdev), m._dev(h, (B * Tp, C)))
            else:
                last = h[np.arange(B), lens - 1]
            nxt = self._next_tokens(new, last)
            finished += self._emit(new, nxt, time.perf_counter())
            st["prefills"] += 1
            st["prefill_tokens"] += int(lens.sum())
            st["prefill_padded_max"] = max(st["prefill_padded_max"], B * Tp)
            st["prefill_s"] += time.perf_counter() - t0
        if self._running:  # one token of every running request, each at its own position and slot
            t0 = time.perf_counter()
            reqs = list(self._running)
            B = len(reqs)
            tok = np.array([r._out[-1] for r in reqs], np.int64).reshape(B, 1)
            pos0 = np.array([r.prompt.size + len(r._out) - 1 for r in reqs], np.int64)
            slots = np.array([r.slot for r in reqs], np.int64)
            h = m._forward(tok, pos0=pos0, use_cache=True, _agreed=True, slots=slots)
            last = m._dev(h, (B, C)) if m._kdev is not None else h[:, 0]
            nxt = self._next_tokens(reqs, last)
            finished += self._emit(reqs, nxt, time.perf_counter())
            st["decodes"] += 1
            st["decode_s"] += time.perf_counter() - t0
        finished.sort(key=lambda r: r.id)
        return finished

    def run(self) -> Iterator[Request]:
        """Step until no request waits or runs, yielding each request as it finishes.

        Requests submitted meanwhile (e.g. from the loop's body) are served too.

        Yields
        ------
        Request
            Each finished request.

        Raises
        ------
        ValueError, RuntimeError, CommError, CommTimeout
            As `step`.
        """
        while self._waiting or self._running:
            for r in self.step():
                yield r

    def stats(self) -> Dict[str, object]:
        """This rank's counters (no collective).

        Returns
        -------
        dict
            steps, prefill and decode forwards, prompt tokens prefilled (and the largest
            padded prefill, B x T), tokens generated, requests submitted / waiting /
            running / finished (failed: those of them finished by an error), the most
            requests running at once, seconds in prefill,
            decode and the per-step agreement, and the pool's shape.
        """
        s = dict(self._st)
        s.update(submitted=self._next_id, waiting=len(self._waiting), running=len(self._running),
                 tracked=len(self._by_id), max_batch=self.max_batch, max_len=self.max_len, free_slots=len(self._free))
        return s

    def __repr__(self):
        return (f"Engine({self.max_batch} slots of {self.max_len} tokens; {len(self._running)} running, "
                f"{len(self._waiting)} waiting; rank {self.comm.rank} of {self.comm.size})")
