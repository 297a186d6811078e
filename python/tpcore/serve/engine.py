"""Continuous batching over one tensor-parallel model with a paged KV cache (iteration-level
scheduling, chunked prefill, prefix caching and preemption, as vLLM and llama.cpp's server do).

    engine = tpcore.Engine(model, max_batch=16)            # up to 16 requests decoded together
    r = engine.submit(prompt_ids, max_new_tokens=32, sampling=SamplingParams(temperature=0.7))
    for done in engine.run():                              # until nothing waits or runs
        print(done.id, done.tokens, done.text, done.ttft, done.finish_reason)

The KV cache is one pool of fixed-size blocks (`block_size` positions each) on every rank; a
request holds the blocks its tokens fill so far, listed in its block table
(`tpcore.serve.kv_pool.BlockPool`), instead of a whole max_len slot from the start.  Every
``step()``:

1. applies the cancellations (`cancel`) made since the last step;
2. schedules: each running request that decodes needs one more position, each one still
   prefilling gets a chunk of its remaining prompt, and waiting requests are admitted first
   come first served while there are fewer than ``max_batch`` running, all prompt chunks of
   the step within the token budget ``max_prefill_tokens`` (a long prompt is split over
   steps, so that a newcomer does not stall the requests that decode).  An admitted request
   first takes the blocks of the longest prefix of its tokens that an earlier request left
   in the pool (prefix caching: a shared system prompt or chat history is computed once);
3. when the pool has no block for a running request, the most recently admitted request is
   preempted: its blocks go back (cached blocks stay findable) and it waits at the head of
   the queue, to be recomputed (prompt + the tokens it generated) when it is admitted again;
   a request is never failed for want of blocks;
4. runs one forward over the prompt chunks (right padded) and one over the decodes (one
   token per request, each at its own position through its block table); a request whose
   prompt is complete gets its next token from its last row's logits (`sample_batch`).

A request finishes on an end-of-sequence id, one of its stop_token_ids or stop strings
("stop"), at max_new_tokens ("length"), when cancelled, or when its logits hold NaN / +inf or
are all -inf ("error", `Request.error` names the step; the others go on).  Greedy requests get
the tokens ``model.generate`` gives each alone; a sampled request draws from its own seeded
stream, the same at every world size.

SPMD: every rank of the model's communicator runs the same engine, submitting (and
cancelling) the same requests in the same order and calling step() together; the scheduler is
deterministic, so every rank makes the same plan and the same block tables without a message
(the logits are gathered on every rank, so every rank picks the same tokens).  Each step agrees
a running fingerprint of the submissions and cancellations with one all-gather of two int64:
ranks that diverged get a ValueError on every rank instead of a hang or garbage.
`tpcore.serve.driver` feeds a server's requests to every rank this way.

Limits: prompt chunks and decodes are two forwards of a step (not one ragged batch); sliding
window layers keep every block of a request (the window masks the keys; blocks that fell out
of it are not given back early); a LongRoPE model (Phi-3) keeps the scaling of its first
forward past original_max_position_embeddings only as generate() does when a request is
prefilled again (preemption): requests that cross that length in decode keep their short
factors; calling the model's generate() or cache() while requests run reallocates the cache
under them (the next step refuses to go on).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Deque, Dict, Iterator, List, Optional

import numpy as np

from tpcore import _C
from tpcore.distributed.agree import agree, fingerprint
from tpcore.models.generate import eos_ids_arg
from tpcore.models.sampling import Sampler, SamplingParams, bad_logits, logits_error, sample_batch
from tpcore.serve.kv_pool import BlockPool
from tpcore.serve.request import Request
from tpcore.utils.args import int_arg, is_int, shown
from tpcore.utils.arrays import int_array

__all__ = ["Engine", "Request"]

_MAX_LEN_CAP = 2048   # the default context per request when the model allows longer (rotary positions)
_MAX_STOPS, _MAX_STOP_CHARS = 64, 4096
MAX_AUTO_PREFILL_TOKENS = 2048   # the adaptive budget when nothing decodes (activations of one forward)
MIN_AUTO_PREFILL_TOKENS = 8      # ... and its floor while requests decode: the decode kernels' rows (GEMV)


class _StepTimes:
    """Recent forward times, for the adaptive prefill budget: decode steps (seconds, by batch)
    and prefill forwards fitted as t = a + b x tokens (least squares over the last 32)."""

    def __init__(self) -> None:
        self.dec: Deque[tuple] = collections.deque(maxlen=32)
        self.pre: Deque[tuple] = collections.deque(maxlen=32)

    def decode(self, batch: int, seconds: float) -> None:
        self.dec.append((batch, seconds))

    def prefill(self, tokens: int, seconds: float) -> None:
        self.pre.append((tokens, seconds))

    def chunk(self, decoding: int) -> int:
        """Prompt tokens whose forward takes about one decode step of `decoding` requests.

        Two regimes: up to MIN_AUTO_PREFILL_TOKENS rows a forward runs the decode kernels (GEMV:
        quantized and 16-bit weights read in place, as a decode step reads them), past it the
        GEMM kernels, whose fixed cost (quantized weights dequantized into panels) can exceed a
        whole decode step.  Until a GEMM-regime forward was seen to take no longer than a decode
        step, chunks are decode-sized; then the line t = a + b x tokens fitted to those forwards
        gives the chunk, growing at most a quarter past the largest seen to fit.
        """
        if not self.dec:
            return MIN_AUTO_PREFILL_TOKENS
        near = [t for b, t in self.dec if b >= decoding] or [t for _, t in self.dec]
        t_dec = float(np.median(near))
        big = [(n, t) for n, t in self.pre if n > MIN_AUTO_PREFILL_TOKENS]
        fits = [n for n, t in big if t <= t_dec]
        if not fits:   # no GEMM-regime forward seen within a decode step: decode-sized chunks
            return MIN_AUTO_PREFILL_TOKENS
        n, t = np.array([p[0] for p in big], np.float64), np.array([p[1] for p in big], np.float64)
        a, b = 0.0, float(np.median(t / n))   # no fixed cost: the per-token cost it implies is an upper bound
        if np.ptp(n) > 0:
            slope, icpt = np.polyfit(n, t, 1)
            if slope > 0 and icpt >= 0:   # a line that holds (noise can tilt it): use it, else the bound
                a, b = float(icpt), float(slope)
        want = int((t_dec - a) / b) if b > 0 and t_dec > a else 0
        grow = int(max(fits) * 1.25) + 1      # past what was seen to fit, a quarter at a time
        return int(min(max(min(want, grow), max(fits)), MAX_AUTO_PREFILL_TOKENS))


class Engine:
    """Continuous batching (serving) over a tensor-parallel causal TransformerLM, with a paged
    KV cache, chunked prefill, prefix caching and preemption (see the module docstring).

    Parameters
    ----------
    model : tpcore.models.TransformerLM
        A causal model, the whole model on each rank of its communicator (not a pipeline
        stage).  Its KV cache is (re)allocated as the engine's block pool.
    max_batch : int, default 16
        Requests running (decoded together) at most, >= 1.
    max_len : int, optional
        Tokens per request at most: prompt + max_new_tokens.  Default None: the model's
        max_positions, at most 2048.
    eos_token_id : int or list of int, optional
        The requests' default end-of-sequence id(s).  Default None: the model's
        generation_config, as generate().
    pad_token_id : int, optional
        Right-pads the shorter prompt chunks of a step (never attended to).  Default None: 0.
    max_prefill_tokens : int, optional
        Prompt tokens computed per step at most (the chunked-prefill budget, >= 1).  Default
        None: adaptive (`auto_budget`): while requests decode, the chunk whose forward is
        predicted to take about as long as a decode step (so a newcomer at most doubles the
        others' time between tokens), from a line fitted to the step times measured so far;
        `max_auto_prefill_tokens` when nothing decodes.
    block_size : int, default 16
        Positions per KV block, >= 1.
    num_blocks : int, optional
        Blocks in the pool.  Default None: max_batch x ceil(max_len / block_size) (every
        request can hold max_len tokens at once: preemption only when that is smaller).
        At least ceil(max_len / block_size) (one request of max_len tokens).
    prefix_caching : bool, default True
        Reuse the cached blocks of equal prompt prefixes.

    Raises
    ------
    TypeError
        model not a TransformerLM, an argument of the wrong type.
    ValueError
        An encoder or a pipeline stage, max_len past max_positions, an argument out of range.

    Notes
    -----
    Collectives: in `step` only (see there).
    """

    def __init__(self, model: Any, max_batch: int = 16, max_len: Optional[int] = None, eos_token_id: Any = None,
                 pad_token_id: Optional[int] = None, max_prefill_tokens: Optional[int] = None, block_size: int = 16,
                 num_blocks: Optional[int] = None, prefix_caching: bool = True) -> None:
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
        if max_len is None:
            max_len = min(_MAX_LEN_CAP, cfg.max_positions)
        self.max_len = int_arg(max_len, who, "max_len", lo=2, hi=2 ** 31 - 1)
        if limit is not None and self.max_len > limit:
            raise ValueError(f"{who}: max_len={self.max_len} is past the model's max_positions ({limit})")
        self.eos = self._eos(eos_token_id if eos_token_id is not None else
                             (getattr(model, "generation_config", {}) or {}).get("eos_token_id"), who)
        self.pad = 0 if pad_token_id is None else int_arg(pad_token_id, who, "pad_token_id", lo=0,
                                                          hi=cfg.vocab_size - 1)
        self.max_prefill_tokens = None if max_prefill_tokens is None else \
            int_arg(max_prefill_tokens, who, "max_prefill_tokens", lo=1, hi=2 ** 31 - 1)
        self._timing = _StepTimes()
        self.block_size = int_arg(block_size, who, "block_size", lo=1, hi=2 ** 20)
        per_req = -(-self.max_len // self.block_size)
        if num_blocks is None:
            num_blocks = self.max_batch * per_req
        self.num_blocks = int_arg(num_blocks, who, "num_blocks", lo=per_req, hi=2 ** 31 - 1)
        if not isinstance(prefix_caching, (bool, np.bool_)):
            raise TypeError(f"{who}: prefix_caching must be a bool, got {shown(prefix_caching)}")
        self.pool = BlockPool(self.num_blocks, self.block_size, bool(prefix_caching))
        model.cache_paged(self.num_blocks, self.block_size)
        self._cache_ref = self._cache_id()
        self._waiting: Deque[Request] = collections.deque()
        self._running: List[Request] = []   # in admission order (the last admitted is preempted first)
        self._by_id: Dict[int, Request] = {}
        self._cancels: List[int] = []
        self._next_id = 0
        self._fp = 0          # running fingerprint of every submission and cancellation, in order
        self._broken: Optional[str] = None
        self._broken_type: type = ValueError  # what a step raises once the engine is broken
        self._st = dict(steps=0, prefills=0, decodes=0, prefill_tokens=0, prefill_padded_max=0, prefill_step_max=0,
                        generated_tokens=0,
                        finished=0, failed=0, cancelled=0, preempted=0, peak_running=0, prefill_s=0.0, decode_s=0.0,
                        agree_s=0.0)

    def _cache_id(self):
        m = self.model
        return m.blocks[0]._filled if m.blocks else None

    # ------------------------------------------------------------------ requests
    def _eos(self, eos_token_id, who) -> List[int]:
        return eos_ids_arg(eos_token_id, self.model.config.vocab_size, who)

    def _prompt(self, prompt, who) -> np.ndarray:
        cfg = self.model.config
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
        return p.copy()

    def _stops(self, stop, who) -> List[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"{who}: stop must be a string or a list of strings, got {shown(stop)}")
        if len(stop) > _MAX_STOPS or any(not s or len(s) > _MAX_STOP_CHARS for s in stop):
            raise ValueError(f"{who}: stop takes at most {_MAX_STOPS} non-empty strings of at most "
                             f"{_MAX_STOP_CHARS} characters each, got {len(stop)} (longest "
                             f"{max((len(s) for s in stop), default=0)})")
        if stop and getattr(self.model, "tokenizer", None) is None:
            raise ValueError(f"{who}: stop strings need the model's tokenizer (this model has none: pass "
                             f"stop_token_ids instead)")
        return list(stop)

    def _stop_ids(self, ids, who) -> List[int]:
        if ids is None:
            return []
        if is_int(ids):
            ids = [ids]
        if not isinstance(ids, (list, tuple, np.ndarray)) or not all(is_int(i) for i in np.asarray(ids).reshape(-1)) \
                or np.asarray(ids).ndim > 1:
            raise TypeError(f"{who}: stop_token_ids must be a list of token ids, got {shown(ids)}")
        out = [int(i) for i in np.asarray(ids, np.int64).reshape(-1)]
        V = self.model.config.vocab_size
        bad = [i for i in out if not 0 <= i < V]
        if bad or len(out) > 1024:
            raise ValueError(f"{who}: stop_token_ids must hold at most 1024 ids in [0, vocab_size={V}), got "
                             f"{len(out)} ids{f', {bad[0]} among them' if bad else ''}")
        return out

    def submit(self, prompt: Any, max_new_tokens: int, eos_token_id: Any = None, temperature: Optional[float] = None,
               top_k: Optional[int] = None, seed: Optional[int] = None, *, sampling: Optional[SamplingParams] = None,
               stop: Any = None, stop_token_ids: Any = None, **sampling_kw: Any) -> Request:
        """Queue a request (served by the next steps).

        Parameters
        ----------
        prompt : array_like of int, shape (n,)
            A non-empty 1-D sequence of token ids in [0, vocab_size).
        max_new_tokens : int
            Generated ids at most, >= 1 (prompt + max_new_tokens <= max_len).
        eos_token_id : int or list of int, optional
            Stop at it (default None: the engine's; -1: never).
        temperature, top_k, seed : optional
            Shorthands of the sampling settings (as generate() takes them); a setting not
            given comes from the model's generation_config, as in generate().
        sampling : tpcore.models.sampling.SamplingParams, optional
            Every sampling setting at once (not with the shorthands or sampling_kw).
        stop : str or list of str, optional
            Stop strings (at most 64 of at most 4096 characters; needs the model's tokenizer):
            the output text ends before the first, matched across token boundaries.
        stop_token_ids : list of int, optional
            Ids that end the request like an end-of-sequence id.
        **sampling_kw
            Other SamplingParams fields (top_p, min_p, repetition_penalty, presence_penalty,
            frequency_penalty, logprobs).

        Returns
        -------
        Request
            Filled in as it runs.

        Raises
        ------
        TypeError, ValueError
            A bad prompt (empty, not 1-D, an id out of range), too long for max_len, or a
            bad sampling argument (naming it).

        Notes
        -----
        No collective: every rank must submit the same requests in the same order (checked
        at the next `step`).
        """
        who, cfg = "Engine.submit", self.model.config
        p = self._prompt(prompt, who)
        n = int_arg(max_new_tokens, who, "max_new_tokens", lo=1, hi=2 ** 31 - 1)
        if p.size > self.max_len - n:
            raise ValueError(f"{who}: a prompt of {p.size} tokens plus max_new_tokens={n} does not fit the engine's "
                             f"max_len={self.max_len} tokens per request (prompts up to max_len - max_new_tokens = "
                             f"{max(self.max_len - n, 0)} tokens)")
        eos = self.eos if eos_token_id is None else self._eos(eos_token_id, who)
        short = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("seed", seed)) if v is not None}
        short.update(sampling_kw)
        if sampling is not None:
            if not isinstance(sampling, SamplingParams):
                raise TypeError(f"{who}: sampling must be a SamplingParams, got {shown(sampling)}")
            if short:
                raise TypeError(f"{who}: give the sampling settings either as sampling= or as keywords "
                                f"({', '.join(sorted(short))}), not both")
            params = sampling
        else:
            params = SamplingParams.make(who, defaults=getattr(self.model, "generation_config", None), **short)
        stops = self._stops(stop, who)
        stop_ids = self._stop_ids(stop_token_ids, who)
        tk = getattr(self.model, "tokenizer", None)
        detok = stopper = None
        if tk is not None:
            from tpcore.models.text import IncrementalDetokenizer, StopMatcher
            detok = IncrementalDetokenizer(tk, p.tolist())
            stopper = StopMatcher(stops) if stops else None
        r = Request(self._next_id, p, n, eos, params, Sampler(params, cfg.vocab_size, p), stops, stop_ids,
                    detok, stopper)
        self._next_id += 1
        self._fp = fingerprint(self._fp, p, n, np.array(eos, np.int64), np.array(stop_ids, np.int64),
                               np.frombuffer(repr((params, stops)).encode(), np.uint8))
        self._waiting.append(r)
        self._by_id[r.id] = r
        return r

    def cancel(self, request: Any) -> bool:
        """Cancel a request (its KV blocks are freed at the next step).

        Parameters
        ----------
        request : Request or int
            The request or its id.

        Returns
        -------
        bool
            False when it had finished already or was cancelled since the last step (nothing
            to do).

        Raises
        ------
        TypeError, ValueError
            Not a request of this engine.

        Notes
        -----
        No collective: every rank must cancel the same requests in the same order, between
        the same steps (checked at the next `step`).
        """
        rid = request.id if isinstance(request, Request) else request
        if not is_int(rid):
            raise TypeError(f"Engine.cancel: request must be a Request or its id, got {shown(request)}")
        rid = int(rid)
        if not 0 <= rid < self._next_id:
            raise ValueError(f"Engine.cancel: no request {rid} was submitted to this engine")
        self._fp = fingerprint(self._fp, -1, rid)
        r = self._by_id.get(rid)
        if r is None or r.done or rid in self._cancels:
            return False
        self._cancels.append(rid)
        return True

    # ------------------------------------------------------------------ stepping
    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted (preempted ones included)."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests holding KV blocks (prefilling or decoding)."""
        return len(self._running)

    def _agree(self):
        """Every rank submitted and cancelled the same requests in the same order (one all-gather
        of two int64); a ValueError on every rank if not."""
        if self._broken:
            raise self._broken_type(self._broken)
        t = time.perf_counter()
        try:
            agree(self.comm, "Engine.step", [("the number of submitted requests differs", self._next_id, str),
                                             ("the submitted or cancelled requests differ", (self._fp,), None)])
        except ValueError as e:
            self._broken = (f"{e} (every rank must submit and cancel the same requests in the same order; this "
                            f"engine cannot go on: make a new one)")
            raise ValueError(self._broken) from None
        finally:
            self._st["agree_s"] += time.perf_counter() - t
        if self._cache_id() is not self._cache_ref:
            if self._running:
                self._broken = ("Engine.step: the model's KV cache was reallocated (generate() or cache() ran) "
                                "while requests were running: their cached tokens are gone; make a new engine")
                self._broken_type = RuntimeError
                raise RuntimeError(self._broken)
            self.model.cache_paged(self.num_blocks, self.block_size)  # nothing running: take the cache back
            self.pool.reset_cache()                                    # (its cached prefixes are gone)
            self._cache_ref = self._cache_id()

    def _release(self, r: Request) -> None:
        self.pool.release(r.id)
        r.running = False
        r.computed = 0

    def _finish(self, r: Request, reason: str, now: float, out: List[Request]) -> None:
        r._finish(reason, now)
        self._release(r)
        self._by_id.pop(r.id, None)
        self._st["finished"] += 1
        self._st["failed"] += reason == "error"
        self._st["cancelled"] += reason == "cancelled"
        out.append(r)

    def _preempt(self) -> Request:
        """Evict the most recently admitted running request: its blocks go back, it waits at the
        head of the queue and is recomputed (prompt + its tokens) when admitted again."""
        v = self._running.pop()
        self._release(v)
        v.preemptions += 1
        self._st["preempted"] += 1
        self._waiting.appendleft(v)
        return v

    def _schedule(self):
        """This step's decodes (requests) and prompt chunks ((request, tokens)), every block
        they write taken from the pool (preempting when it runs out)."""
        pool = self.pool
        decodes: List[Request] = []
        chunks: List[tuple] = []
        budget = self._budget()
        i = 0
        while i < len(self._running):
            r = self._running[i]
            left = len(r._all) - r.computed
            n = 1 if left == 1 else min(left, budget)
            if n <= 0:   # a prompt still prefilling, and no budget left this step
                i += 1
                continue
            while not pool.grow(r.id, r.computed + n):
                if self._preempt() is r:  # r was the last admitted: the ones before it are scheduled
                    return decodes, chunks
            if left == 1:
                decodes.append(r)
            else:
                chunks.append((r, n))
                budget -= n
            i += 1
        while self._waiting and len(self._running) < self.max_batch and budget > 0:
            r = self._waiting[0]
            cached = pool.admit(r.id, r._all)
            n = min(len(r._all) - cached, budget)
            if not pool.grow(r.id, cached + n):
                pool.release(r.id)
                break
            self._waiting.popleft()
            r.computed, r.num_cached_tokens, r.running = cached, cached, True
            self._running.append(r)
            if len(r._all) - cached == 1:
                decodes.append(r)
            else:
                chunks.append((r, n))
                budget -= n
        return decodes, chunks

    def _budget(self) -> int:
        """This step's prompt-token budget: the fixed one, or the adaptive one, agreed across the
        ranks (the smallest: each rank measured its own times) when it is not the maximum."""
        if self.max_prefill_tokens is not None:
            return self.max_prefill_tokens
        decoding = sum(len(r._all) - r.computed == 1 for r in self._running)
        prefilling = len(self._waiting) + len(self._running) - decoding
        if not decoding or not prefilling:
            return MAX_AUTO_PREFILL_TOKENS
        n = self._timing.chunk(decoding)
        if self.comm.size > 1:
            n = int(self.comm.all_reduce(np.array([n], np.int64), op="min")[0])
        return n

    def _table(self, reqs: List[Request], reach: int = 0) -> np.ndarray:
        """The requests' block tables (B, cols), -1 past each one's blocks; cols cover `reach`
        positions at least (a padded row's positions past its own blocks write nowhere)."""
        tabs = [self.pool.tables[r.id] for r in reqs]
        out = np.full((len(reqs), max(max(len(t) for t in tabs), self.pool.blocks_for(reach))), -1, np.int64)
        for b, t in enumerate(tabs):
            out[b, :len(t)] = t
        return out

    def _last_rows(self, h, n: int, rows: np.ndarray):
        """Hidden states of the given rows of h (n rows of hidden, flattened), where the model's
        head runs."""
        m, C = self.model, self.model.config.hidden
        if m._kdev is not None:  # gathered where h lives (an embedding lookup)
            from tpcore.models.lm import on_device
            return _C.embedding_forward(on_device(np.ascontiguousarray(rows, np.int64), m._kdev), m._dev(h, (n, C)))
        return np.ascontiguousarray(h.reshape(n, C)[rows])

    def _next_tokens(self, reqs: List[Request], last):
        """The next id of each request from the hidden states `last` (B, hidden) of its last row
        (`bad_logits`'s code < 0 where no token can be picked), and their logprobs."""
        m = self.model
        logits = m.gather_logits(m.logits_shard(last if m._kdev is not None else np.ascontiguousarray(last)))
        codes = bad_logits(logits)
        ok = [i for i in range(len(reqs)) if not codes[i]]
        ids = np.array(codes, np.int64)
        lps: List[Any] = [None] * len(reqs)
        if ok:
            got, lp = sample_batch(logits[ok], [reqs[i].sampler for i in ok])
            for j, i in enumerate(ok):
                ids[i], lps[i] = int(got[j]), lp[j]
        return ids, lps

    def _emit(self, reqs: List[Request], ids: np.ndarray, lps: List[Any], now: float, out: List[Request]) -> None:
        for r, t, lp in zip(reqs, ids.tolist(), lps):
            if t < 0:  # this request alone fails
                r.error = logits_error("Engine", f"request {r.id}", len(r._out), t)
                self._finish(r, "error", now, out)
                continue
            self._st["generated_tokens"] += 1
            r._out.append(t)
            r._all.append(t)
            r.sampler.accept(t)
            r.token_times.append(now)
            if lp is not None:
                r.logprobs.append(lp)
            if r.first_token is None:
                r.first_token = now
            if t in r.stop_ids:
                self._finish(r, "stop", now, out)
            elif r._push_text(t):
                self._finish(r, "stop", now, out)
            elif len(r._out) >= r.max_new_tokens:
                self._finish(r, "length", now, out)
        self._running = [r for r in self._running if r.running]

    def step(self) -> List[Request]:
        """One iteration: cancellations, scheduling, a forward over the prompt chunks, one over
        the decodes.

        Returns
        -------
        list of Request
            The requests that finished in it, by id (failed and cancelled ones included).

        Raises
        ------
        ValueError
            The ranks submitted or cancelled different requests (every later step raises it too).
        RuntimeError
            An earlier step failed part-way (an interrupt, a communication error, memory),
            leaving requests without their tokens or cache rows.
        CommError, CommTimeout
            A collective failed.

        Notes
        -----
        Collective (every rank): one small all-gather that checks the requests agree, then
        the model's forwards.
        """
        self._agree()
        try:
            return self._step()
        except BaseException as e:
            self._broken = (f"Engine.step: an earlier step failed part-way ({type(e).__name__}: {e}); its requests' "
                            f"KV-cache rows are incomplete, so this engine cannot go on: make a new one")
            self._broken_type = RuntimeError
            raise

    def _cancel_pending(self, finished: List[Request]) -> None:
        now = time.perf_counter()
        for rid in self._cancels:
            r = self._by_id.get(rid)
            if r is None or r.done:
                continue
            if r in self._waiting:
                self._waiting.remove(r)
            self._finish(r, "cancelled", now, finished)
        self._cancels.clear()
        self._running = [r for r in self._running if r.running]

    def _step(self) -> List[Request]:
        m, st = self.model, self._st
        st["steps"] += 1
        finished: List[Request] = []
        self._cancel_pending(finished)
        decodes, chunks = self._schedule()
        st["peak_running"] = max(st["peak_running"], len(self._running))
        if chunks:  # one forward over the prompt chunks, right padded, each at its computed position
            t0 = time.perf_counter()
            reqs = [r for r, _ in chunks]
            lens = np.array([n for _, n in chunks], np.int64)
            B, T = len(reqs), int(lens.max())
            toks = np.full((B, T), self.pad, np.int64)
            for b, (r, n) in enumerate(chunks):
                toks[b, :n] = r._all[r.computed:r.computed + n]
            pos0 = np.array([r.computed for r in reqs], np.int64)
            table = self._table(reqs, int(pos0.max()) + T)
            for b, (r, n) in enumerate(chunks):   # padding rows write nowhere past the row's own blocks
                table[b, self.pool.blocks_for(r.computed + n):] = -1
            h = m._forward(toks, pos0=pos0, use_cache=True, _agreed=True, block_table=table)
            done_rows = []
            for b, (r, n) in enumerate(chunks):
                r.computed += n
                self.pool.commit(r.id, r._all, r.computed)
                if r.computed == len(r._all):
                    done_rows.append(b)
            if done_rows:
                sel = [reqs[b] for b in done_rows]
                last = self._last_rows(h, B * T, np.array([b * T + int(lens[b]) - 1 for b in done_rows], np.int64))
                ids, lps = self._next_tokens(sel, last)
                self._emit(sel, ids, lps, time.perf_counter(), finished)
            st["prefills"] += 1
            st["prefill_tokens"] += int(lens.sum())
            st["prefill_padded_max"] = max(st["prefill_padded_max"], B * T)
            st["prefill_step_max"] = max(st["prefill_step_max"], int(lens.sum()))
            st["prefill_s"] += time.perf_counter() - t0
            self._timing.prefill(B * T, time.perf_counter() - t0)
        decodes = [r for r in decodes if r.running]
        if decodes:  # one token of every decoding request, each at its own position
            t0 = time.perf_counter()
            B = len(decodes)
            tok = np.array([r._all[-1] for r in decodes], np.int64).reshape(B, 1)
            pos0 = np.array([r.computed for r in decodes], np.int64)
            h = m._forward(tok, pos0=pos0, use_cache=True, _agreed=True, block_table=self._table(decodes))
            for r in decodes:
                r.computed += 1
                self.pool.commit(r.id, r._all, r.computed)
            last = m._dev(h, (B, m.config.hidden)) if m._kdev is not None else np.ascontiguousarray(h[:, 0])
            ids, lps = self._next_tokens(decodes, last)
            self._emit(decodes, ids, lps, time.perf_counter(), finished)
            st["decodes"] += 1
            st["decode_s"] += time.perf_counter() - t0
            self._timing.decode(B, time.perf_counter() - t0)
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
        while self._waiting or self._running or self._cancels:
            for r in self.step():
                yield r

    def stats(self) -> Dict[str, object]:
        """This rank's counters (no collective).

        Returns
        -------
        dict
            steps, prefill and decode forwards, prompt tokens computed (and the largest padded
            prefill, B x T), tokens generated, requests submitted / waiting / running /
            finished (failed and cancelled: those of them finished by an error or a cancel),
            tracked (submitted and not finished),
            preemptions, the most requests running at once, seconds in prefill, decode and the
            per-step agreement, and the KV pool's blocks and prefix-cache counters.
        """
        s: Dict[str, object] = dict(self._st)
        s.update(submitted=self._next_id, waiting=len(self._waiting), running=len(self._running),
                 tracked=len(self._by_id), max_batch=self.max_batch, max_len=self.max_len,
                 max_prefill_tokens=self.max_prefill_tokens or "auto")
        s.update(self.pool.stats())
        return s

    def __repr__(self) -> str:
        return (f"Engine({self.num_blocks} KV blocks of {self.block_size} tokens, up to {self.max_batch} requests of "
                f"{self.max_len} tokens; {len(self._running)} running, {len(self._waiting)} waiting; rank "
                f"{self.comm.rank} of {self.comm.size})")
