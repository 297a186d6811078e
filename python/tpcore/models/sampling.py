"""Sampling: one request's settings, its penalties and filters, and the draw of its next token.

    params = SamplingParams.make("generate", defaults=model.generation_config, temperature=0.7, top_p=0.9)
    s = Sampler(params, vocab_size, prompt_ids)
    tok, lp = s.pick(logits_row)          # the next id (and its logprobs when params.logprobs is set)
    s.accept(tok)                          # the caller appends tok: the penalties count it from now on

The settings are those both anchors accept (vLLM's SamplingParams, llama.cpp's server,
transformers' logits processors), applied in transformers' and vLLM's order:

1. repetition_penalty (transformers' RepetitionPenaltyLogitsProcessor, vLLM's): the logit of
   every token seen in the prompt or the output is divided by it when > 0, else multiplied;
2. presence_penalty and frequency_penalty (OpenAI's rule, over the generated tokens only):
   ``logit -= frequency * count + presence * (count > 0)``;
3. temperature (0: greedy, the argmax of the penalised logits; the filters below never drop the
   argmax, so they do not change it);
4. top_k (the k largest logits, ties with the k-th kept, as TopKLogitsWarper; > vocab: all);
5. top_p (nucleus: the smallest set of most probable tokens whose probability reaches top_p;
   always at least one, as TopPLogitsWarper);
6. min_p (tokens less probable than min_p times the most probable are dropped, as
   MinPLogitsWarper);
7. the draw: one uniform number from the request's ``np.random.Generator`` (seeded by
   ``seed``), inverted through the cumulative distribution in vocabulary order.

The arithmetic runs in float64.  Where only temperature, top_k and seed are given, the
probabilities and the draw are bit for bit those of tpcore's earlier ``sample`` (the same
tokens for the same seed).  Logprobs are the log-softmax of the raw logits (before penalties
and temperature), as vLLM returns them by default.

Imports nothing of tpcore but its argument checks.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from tpcore.utils.args import bool_arg, int_arg, is_int, real_arg, seed_arg, shown

__all__ = ["SamplingParams", "Sampler", "TokenLogprob", "sample_batch", "bad_logits", "logits_error", "draw",
           "filtered_probs", "MAX_LOGPROBS"]

MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's top_logprobs limit)
PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI, vLLM)
# the generation_config.json keys that give a default (transformers' names); do_sample=False: greedy
DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most probable tokens at its step.

    Parameters
    ----------
    token : int
        The id drawn.
    logprob : float
        Its log-probability under the log-softmax of the raw logits (before penalties and
        temperature; float64 arithmetic; -inf for a token whose logit is -inf).
    top : list of (int, float)
        The `logprobs` most probable ids and theirs, most probable first (ties: lower id
        first); empty when the request asked for logprobs=0.
    """
    token: int
    logprob: float
    top: List[Tuple[int, float]]


def _top_k_arg(v, who: str) -> int:
    if v is None:
        return 0
    k = int_arg(v, who, "top_k", lo=-1, expected="an integer >= 1 (0, -1 or None: no top-k filtering; larger "
                                                   "than the vocabulary: all tokens)")
    return max(k, 0)


def _field(name: str, v, who: str):
    """One field of SamplingParams checked (TypeError/ValueError naming it) and normalised."""
    if name == "temperature":
        return real_arg(v, who, name, lo=0)
    if name == "top_p":
        return real_arg(v, who, name, lo=0, lo_open=True, hi=1)
    if name == "top_k":
        return _top_k_arg(v, who)
    if name == "min_p":
        return real_arg(v, who, name, lo=0, hi=1)
    if name == "repetition_penalty":
        return real_arg(v, who, name, lo=0, lo_open=True)
    if name in ("presence_penalty", "frequency_penalty"):
        return real_arg(v, who, name, lo=-PENALTY_LIMIT, hi=PENALTY_LIMIT)
    if name == "seed":
        return 0 if v is None else seed_arg(v, who)
    if name == "logprobs":
        return None if v is None else int_arg(v, who, name, lo=0, hi=MAX_LOGPROBS,
                                              expected=f"an integer in [0, {MAX_LOGPROBS}] or None")
    raise AssertionError(name)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (validated and normalised on construction).

    Parameters
    ----------
    temperature : float, default 0.0
        0: greedy (the argmax of the penalised logits); > 0: the logits are divided by it
        before the softmax.  Finite, >= 0.
    top_p : float, default 1.0
        Nucleus sampling: draw from the smallest set of most probable tokens whose
        probability reaches top_p, in (0, 1] (1: off).
    top_k : int, default 0
        Draw from the k largest logits only (0, -1 or None: off; more than the vocabulary:
        all of it, as llama.cpp and transformers clamp it).
    min_p : float, default 0.0
        Drop tokens less probable than min_p times the most probable one, in [0, 1].
    repetition_penalty : float, default 1.0
        > 0: the logits of the tokens seen in the prompt or the output are divided by it when
        positive, multiplied by it when negative (1: off).
    presence_penalty : float, default 0.0
        In [-2, 2]: subtracted from the logit of every token generated at least once.
    frequency_penalty : float, default 0.0
        In [-2, 2]: subtracted from a token's logit once per time it was generated.
    seed : int, optional
        The request's random stream, an integer in [0, 2**64) (None: 0).
    logprobs : int, optional
        None: no logprobs; 0: the chosen token's; k in 1..20: also the k most probable.

    Raises
    ------
    TypeError, ValueError
        A field of the wrong kind or out of its range (NaN and infinities included), naming it.
    """
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    logprobs: Optional[int] = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _field(f.name, getattr(self, f.name), "SamplingParams"))

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax (temperature 0)."""
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @classmethod
    def make(cls, who: str, defaults: Optional[dict] = None, **kw) -> "SamplingParams":
        """The settings a caller gave (None: not given), the rest from a generation_config.

        Parameters
        ----------
        who : str
            The caller, for the messages ("generate", "Engine.submit", "request").
        defaults : dict, optional
            A generation_config.json's keys (transformers' names: temperature, top_p, top_k,
            min_p, repetition_penalty, do_sample; others are ignored): the value of a setting
            the caller left None.  do_sample=False makes the default greedy; do_sample=True
            without a temperature samples at 1.0 (transformers' default); without do_sample a
            temperature given applies, as vLLM reads the file.
        **kw
            The fields of SamplingParams; None: not given.

        Returns
        -------
        SamplingParams

        Raises
        ------
        TypeError
            An unknown setting, or a setting (or a default) of the wrong kind, named.
        ValueError
            A setting or a default out of its range, NaN or infinite, named.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(kw) - set(names))
        if unknown:
            raise TypeError(f"{who}: unknown sampling setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
                            f"(known: {', '.join(names)})")
        vals = {}
        for k in names:
            if kw.get(k) is not None:
                vals[k] = _field(k, kw[k], who)
        for k, v in _defaults(defaults, who).items():
            vals.setdefault(k, v)
        return cls(**vals)


def _defaults(gen: Optional[dict], who: str) -> dict:
    """The sampling defaults of a generation_config dict, checked (naming the file's key)."""
    if gen is None:
        return {}
    if not isinstance(gen, dict):
        raise TypeError(f"{who}: defaults must be a dict (a generation_config), got {shown(gen)}")
    src = f"{who}: generation_config"
    out = {k: _field(k, gen[k], src) for k in DEFAULT_KEYS if gen.get(k) is not None}
    do_sample = gen.get("do_sample")
    if do_sample is not None and not bool_arg(do_sample, src, "do_sample"):
        out["temperature"] = 0.0
    elif do_sample and "temperature" not in out:
        out["temperature"] = 1.0
    return out


# ------------------------------------------------------------------ logits no token can come from

_BAD_LOGITS = {-1: "hold NaN", -2: "hold +inf", -3: "are all -inf (no token can be drawn)"}


def bad_logits(logits) -> np.ndarray:
    """Per row of logits (n, vocab): 0 when a token can be picked from it, else -1 (it holds a
    NaN), -2 (+inf; no NaN) or -3 (every logit is -inf).  One max per row (NaN propagates
    through it); only the rows whose max is not finite are looked at again.

    Parameters
    ----------
    logits : numpy.ndarray
        (n, vocab) floating point.
    """
    hi = np.max(logits, axis=-1)
    codes = np.zeros(hi.shape, np.int64)
    for i in np.flatnonzero(~np.isfinite(hi)).tolist():
        codes[i] = -1 if np.isnan(hi[i]) else (-2 if hi[i] > 0 else -3)
    return codes


def logits_error(who: str, what: str, step: int, code: int) -> ValueError:
    """The error for logits that `bad_logits` gave code (< 0).

    Parameters
    ----------
    who : str
        The caller ("generate", "Engine").
    what : str
        Whose logits ("sequence 0", "request 5").
    step : int
        The index of the token being picked (0 for the first).
    code : int
        `bad_logits`'s code, < 0.
    """
    return ValueError(f"{who}: the logits of {what} at step {step} {_BAD_LOGITS[int(code)]} (the model's weights or "
                      f"inputs hold NaN/Inf?)")


# ------------------------------------------------------------------ the filters and the draw

def _top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """p (probabilities summing to 1) with the tokens outside the nucleus zeroed: a token stays
    when the tokens more probable than it (descending, ties by id) hold less than top_p.  Sorts
    only the m most probable (m = 64, 512, ... until they hold top_p), not the vocabulary: the
    tokens past them are dropped whatever their order."""
    idx = np.flatnonzero(p)
    ps = p[idx]
    m = 64
    while True:
        cand = np.argpartition(-ps, m - 1)[:m] if m < ps.size else np.arange(ps.size)
        order = cand[np.lexsort((cand, -ps[cand]))]  # (positions in idx follow the ids)
        mass = np.cumsum(ps[order])
        if mass[-1] >= top_p or m >= ps.size:
            break
        m *= 8
    n = max(int(np.count_nonzero(mass - ps[order] < top_p)), 1)  # the mass ahead of each token < top_p
    out = np.zeros_like(p)
    keep = idx[order[:n]]
    out[keep] = p[keep]
    return out


def filtered_probs(z: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution a token is drawn from: softmax(z / temperature) restricted by top_k,
    top_p and min_p in turn (each renormalised), float64.

    Parameters
    ----------
    z : numpy.ndarray
        The logits (after the penalties), 1-D; at least one finite, none NaN or +inf.
    temperature : float
        > 0.
    top_k : int
        0: off; else the top_k largest are kept (ties with the k-th too).
    top_p, min_p : float
        As SamplingParams (1.0, 0.0: off).
    """
    V = z.shape[-1]
    z = z.astype(np.float64) / temperature
    if 0 < top_k < V:
        kth = np.partition(z, V - top_k)[V - top_k]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if top_p < 1 or min_p > 0:
        if top_p < 1:
            p = _top_p(p, top_p)
        if min_p > 0:
            p = np.where(p >= min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def draw(z: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float, rng) -> int:
    """One id drawn from penalised logits z through `filtered_probs`: one uniform number u from
    rng, the first id whose cumulative probability (in vocabulary order) reaches u.

    Parameters
    ----------
    z : numpy.ndarray
        The logits (after the penalties), 1-D; at least one finite, none NaN or +inf.
    temperature, top_k, top_p, min_p
        As `filtered_probs`.
    rng : numpy.random.Generator
        One number is drawn from it (``rng.random()``).
    """
    p = filtered_probs(z, temperature, top_k, top_p, min_p)
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, rng.random(), side="left"))  # the first token whose cdf reaches u
    if i >= p.size or p[i] == 0:  # u past cdf[-1] by rounding, or u == 0: the nearest token that can be drawn
        nz = np.flatnonzero(p)
        i = int(nz[-1] if i >= p.size else nz[np.searchsorted(nz, i)])
    return i


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    z = rows.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _token_logprob(lp: np.ndarray, token: int, k: int) -> TokenLogprob:
    top = []
    if k:
        k = min(k, lp.size)
        cand = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
        # the k-th value may tie with ids outside cand: take every id tied with it, then the lowest ids
        kth = lp[cand].min()
        cand = np.union1d(cand[lp[cand] > kth], np.flatnonzero(lp == kth))
        cand = cand[np.lexsort((cand, -lp[cand]))][:k]
        top = [(int(i), float(lp[i])) for i in cand]
    return TokenLogprob(int(token), float(lp[token]), top)


# ------------------------------------------------------------------ one request

class Sampler:
    """One request's sampling state: its settings, its random stream, the token counts the
    penalties read.

    Parameters
    ----------
    params : SamplingParams
        The request's settings.
    vocab_size : int
        The width of the logits rows (top_k is clamped to it).
    prompt_ids : array_like of int, optional
        The prompt: repetition_penalty reads its tokens too.
    rng : numpy.random.Generator, optional
        The stream to draw from (default: ``np.random.default_rng(params.seed)``, made when
        the params sample).  ``generate`` gives the samplers of one batch a shared one, so that
        a batch draws as one stream, row after row.

    Notes
    -----
    `pick` does not count its token: the caller calls `accept` with the token it appends
    (the pad a finished row gets is never accepted; a request recomputed after preemption
    keeps its sampler and accepts nothing again).  A sampled pick draws exactly one number
    from the stream; a greedy one none.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: Any = (), rng=None):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"Sampler: params must be a SamplingParams, got {shown(params)}")
        self.params = params
        self.vocab_size = int_arg(vocab_size, "Sampler", "vocab_size", lo=1)
        self.top_k = params.top_k if params.top_k < self.vocab_size else 0
        if rng is not None and not isinstance(rng, np.random.Generator):
            raise TypeError(f"Sampler: rng must be a numpy.random.Generator or None, got {shown(rng)}")
        self.rng = rng if rng is not None or params.greedy else np.random.default_rng(params.seed)
        self.generated = 0
        self._counts: dict = {}  # generated id -> times, when a presence or frequency penalty reads it
        self._seen: set = set()  # prompt and generated ids, when a repetition penalty reads them
        self._seen_arr: Optional[np.ndarray] = None
        if params.repetition_penalty != 1:
            prompt = np.asarray(prompt_ids if prompt_ids is not None else (), dtype=np.int64).reshape(-1)
            if prompt.size and (prompt.min() < 0 or prompt.max() >= self.vocab_size):
                raise ValueError(f"Sampler: prompt_ids must be in [0, vocab_size={self.vocab_size}), got ids "
                                 f"{int(prompt.min())}..{int(prompt.max())}")
            self._seen = set(np.unique(prompt).tolist())

    def accept(self, token_id: int) -> None:
        """Count token_id as generated (the penalties read it from the next pick on).

        Parameters
        ----------
        token_id : int
            The id appended to the request's output.
        """
        if not is_int(token_id) or not 0 <= int(token_id) < self.vocab_size:
            raise ValueError(f"Sampler.accept: token_id must be an id in [0, vocab_size={self.vocab_size}), got "
                             f"{shown(token_id)}")
        t = int(token_id)
        self.generated += 1
        p = self.params
        if p.presence_penalty or p.frequency_penalty:
            self._counts[t] = self._counts.get(t, 0) + 1
        if p.repetition_penalty != 1 and t not in self._seen:
            self._seen.add(t)
            self._seen_arr = None

    def penalize(self, row: np.ndarray) -> np.ndarray:
        """row (1-D logits) with the penalties applied: row itself when none applies, else a
        float64 copy.

        Parameters
        ----------
        row : numpy.ndarray
            The raw logits, 1-D, vocab_size wide.
        """
        p = self.params
        if not p.penalized:
            return row
        z = row.astype(np.float64)
        if p.repetition_penalty != 1 and self._seen:
            if self._seen_arr is None:
                self._seen_arr = np.fromiter(self._seen, np.int64, len(self._seen))
            v = z[self._seen_arr]
            z[self._seen_arr] = np.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
        if self._counts:
            ids = np.fromiter(self._counts.keys(), np.int64, len(self._counts))
            cnt = np.fromiter(self._counts.values(), np.float64, len(self._counts))
            z[ids] -= p.frequency_penalty * cnt
            z[ids] -= p.presence_penalty
        return z

    def choose(self, row: np.ndarray) -> int:
        """The next id from a row no bad logits hold (`bad_logits` 0): the argmax of the penalised
        logits when greedy, else drawn (see the module).  Counts nothing (`accept`).

        Parameters
        ----------
        row : numpy.ndarray
            The raw logits, 1-D, vocab_size wide.
        """
        z = self.penalize(row)
        p = self.params
        if p.greedy:
            return int(np.argmax(z))
        return draw(z, p.temperature, self.top_k, p.top_p, p.min_p, self.rng)

    def probs(self, row: np.ndarray) -> np.ndarray:
        """The distribution the next id is drawn from (float64, vocab_size): the penalties, then
        `filtered_probs`; greedy: 1 at the argmax of the penalised logits.

        Parameters
        ----------
        row : numpy.ndarray
            The raw logits, 1-D, vocab_size wide, no bad logits (`bad_logits` 0).
        """
        z = self.penalize(row)
        p = self.params
        if p.greedy:
            out = np.zeros(z.shape, np.float64)
            out[int(np.argmax(z))] = 1.0
            return out
        return filtered_probs(z, p.temperature, self.top_k, p.top_p, p.min_p)

    def pick(self, logits_row) -> Tuple[int, Optional[TokenLogprob]]:
        """The next id of this request from its logits row, and its logprobs when asked.

        Parameters
        ----------
        logits_row : numpy.ndarray
            (vocab_size,) (or (1, vocab_size)) raw logits, float32 or float64.

        Returns
        -------
        (int, TokenLogprob or None)
            The id (not yet counted: call `accept` with the id appended) and, when
            params.logprobs is not None, its TokenLogprob.

        Raises
        ------
        ValueError
            A row of another width, or one no token can be drawn from (NaN, +inf, all -inf),
            naming the step (the number of tokens accepted so far).
        """
        row = np.asarray(logits_row)
        if row.ndim == 2 and row.shape[0] == 1:
            row = row[0]
        if row.shape != (self.vocab_size,) or row.dtype.kind != "f":
            raise ValueError(f"Sampler.pick: logits_row must be a float array of shape ({self.vocab_size},), got "
                             f"{row.dtype} {row.shape}")
        code = int(bad_logits(row[None])[0])
        if code:
            raise logits_error("Sampler.pick", "this request", self.generated, code)
        t = self.choose(row)
        lp = None
        if self.params.logprobs is not None:
            lp = _token_logprob(_log_softmax(row), t, self.params.logprobs)
        return t, lp


def sample_batch(logits, samplers: Sequence[Sampler]) -> Tuple[np.ndarray, List[Optional[TokenLogprob]]]:
    """The next id of every row of a batch, each with its request's sampler.

    Parameters
    ----------
    logits : numpy.ndarray
        (B, V) raw logits, float32 or float64, row b for samplers[b].
    samplers : sequence of Sampler
        One per row, in row order (rows that draw do so in this order: samplers sharing one
        random stream draw as that stream's consecutive numbers).

    Returns
    -------
    (numpy.ndarray, list)
        The ids, (B,) int64 (not yet counted: `Sampler.accept`); a row no token can be drawn
        from (NaN, +inf, all -inf) gets `bad_logits`'s negative code instead, draws nothing,
        and its caller fails that request alone (`logits_error`).  And per row its
        TokenLogprob, or None (not asked, or a bad row).  The argmax of every row at once
        when every sampler is greedy without penalties.
    """
    logits = np.asarray(logits)
    if logits.ndim != 2 or len(samplers) != logits.shape[0] or logits.dtype.kind != "f":
        raise ValueError(f"sample_batch: logits must be a (B, V) float array with B = len(samplers) = "
                         f"{len(samplers)}, got {logits.dtype} {logits.shape}")
    if any(s.vocab_size != logits.shape[1] for s in samplers):
        raise ValueError(f"sample_batch: the samplers' vocab_size ({sorted({s.vocab_size for s in samplers})}) "
                         f"differs from the logits' width {logits.shape[1]}")
    codes = bad_logits(logits)
    if all(s.params.greedy and not s.params.penalized for s in samplers):
        ids = logits.argmax(-1).astype(np.int64)
    else:
        ids = np.zeros(len(samplers), np.int64)
        for i, s in enumerate(samplers):
            if not codes[i]:
                ids[i] = s.choose(logits[i])
    ids = np.where(codes < 0, codes, ids)
    lps: List[Optional[TokenLogprob]] = [None] * len(samplers)
    want = [i for i, s in enumerate(samplers) if s.params.logprobs is not None and not codes[i]]
    if want:
        lsm = _log_softmax(logits[want])
        for j, i in enumerate(want):
            lps[i] = _token_logprob(lsm[j], int(ids[i]), samplers[i].params.logprobs)
    return ids, lps
