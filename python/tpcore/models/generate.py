"""Generation: prompts, sampling settings, eos handling and the KV-cache decode loop.

    out = model.generate(prompts, max_new_tokens=16, temperature=0.7, top_p=0.9)
    for ids in model.iter_generate(prompts, 64):    # one (B,) array of new ids per step
        ...

`generate_args` checks `TransformerLM.generate`'s arguments against a model's config (and
its checkpoint's generation_config: the sampling defaults, eos and pad), `agree_generate`
checks that every rank passed the same, `GenerationStream` runs the batched prefill and the
decode steps through the model's KV cache, one step per ``next``, each row's next token
picked by its `tpcore.models.sampling.Sampler` (`sample_batch`: penalties, temperature,
top-k, top-p, min-p, the seeded draw), refusing logits no token can be drawn from
(`bad_logits`, `logits_error`: NaN, +inf, or every logit -inf; NumPy's argmax would pick the
first NaN, the softmax would give NaN probabilities, and either would return tokens
silently).  `sample` is the temperature / top-k pick of the Engine and PipelineLM before
SamplingParams (the same draws).  `tpcore.PipelineLM` (its stages) and `tpcore.Engine` (its
requests) reuse the argument checks, the agreement and the sampling.

`TransformerLM` takes its `generate` and `iter_generate` methods from `_GenerationMixin`.  The
decode loop drives the model through its methods (`_forward` with the KV cache, which leaves
the hidden states on the model's device, `logits_shard`, `gather_logits`, `cache`); this module
does not import the model (models.lm imports it).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from tpcore import _C
from tpcore.distributed.agree import agree
from tpcore.distributed.comm import Comm
from tpcore.models.norm import on_device
from tpcore.models.sampling import SamplingParams, Sampler, bad_logits, draw, logits_error, sample_batch
from tpcore.utils.args import int_arg, is_int, minmax, shown
from tpcore.utils.arrays import int_array

__all__ = ["generate_args", "sampling_args", "batch_samplers", "GenerationStream", "sample", "agree_generate",
           "eos_ids_arg", "generate_result", "check_vocab", "bad_logits", "logits_error"]


_SAMPLING_DOC = """temperature : float, optional
            0: greedy (the same tokens at every world size); > 0: sampling.  None: the
            checkpoint's generation_config (do_sample=False: greedy), else 0.
        top_k : int, optional
            Sample only from the k largest logits (0 or -1: from all; more than the
            vocabulary: all of it).  None: generation_config's, else off.
        seed : int, optional
            The sampling stream, an integer in [0, 2**64) (None: 0).  The same seed gives the
            same tokens at every world size (every rank draws from the same gathered logits).
        eos_token_id : int or list of int, optional
            A sequence that emits it is finished (default None: the checkpoint's
            generation_config.json, as in Hugging Face; -1: never stop).
        pad_token_id : int, optional
            Fills a finished sequence's rest (default None: generation_config's, else the
            first eos id, else 0).
        top_p : float, optional
            Nucleus sampling, in (0, 1] (None: generation_config's, else 1: off).
        min_p : float, optional
            Drop tokens less probable than min_p times the most probable, in [0, 1] (None:
            generation_config's, else 0: off).
        repetition_penalty : float, optional
            > 0; the logits of tokens in the prompt or generated are divided by it (multiplied
            when negative), transformers' rule (None: generation_config's, else 1: off).
        presence_penalty, frequency_penalty : float, optional
            In [-2, 2]: OpenAI's penalties over the generated tokens (None: 0).
        sampling : SamplingParams, optional
            All the settings at once (then temperature, top_k, seed, top_p, min_p and the
            penalties must be None)."""


class _GenerationMixin:
    """`TransformerLM.generate` and `iter_generate`: the arguments checked and agreed, then the
    decode loop (`GenerationStream`)."""

    def generate(self, prompts: Any, max_new_tokens: int = 16, temperature: Optional[float] = None,
                 top_k: Optional[int] = None, seed: Optional[int] = None, eos_token_id: Any = None,
                 pad_token_id: Optional[int] = None, *, top_p: Optional[float] = None, min_p: Optional[float] = None,
                 repetition_penalty: Optional[float] = None, presence_penalty: Optional[float] = None,
                 frequency_penalty: Optional[float] = None, sampling: Optional[SamplingParams] = None,
                 stream: bool = False, stop: Any = None) -> Any:
        """Batched prefill, then KV-cache decoding (causal models).

        Parameters
        ----------
        prompts : array_like of int, shape (B, T), or list of 1-D sequences, or str
            Prompts of one length, or of their own lengths; or one text (the model's
            tokenizer encodes it, and the generated text is returned:
            `tpcore.models.text_generate.generate_text`).
        max_new_tokens : int, default 16
            Tokens to generate per prompt, >= 0.
        {sampling}
        stream : bool, default False
            With a text prompt: an iterator of the generated text's pieces, as they come.
        stop : str or list of str, optional
            With a text prompt: the text ends before the first of these strings.

        Returns
        -------
        numpy.ndarray or list of numpy.ndarray or str or iterator of str
            (B, T + max_new_tokens) int64 when the prompts have one length, else a list of
            1-D arrays (prompt + generated); for a text prompt the generated text (not the
            prompt), or its pieces with stream=True.

        Raises
        ------
        TypeError, ValueError
            A bad argument (named; NaN temperature, top_p outside (0, 1], a negative
            repetition_penalty...), an encoder model, a sequence past max_positions, or ranks
            that passed different arguments (ValueError on every rank).
        ValueError
            Logits no token can be drawn from (NaN, +inf, or all -inf: the model's weights
            or activations went bad), naming the sequence and the step; on every rank.

        Notes
        -----
        Collective: one small all-gather at entry checks the arguments agree; per step,
        `forward`'s collectives and an all-gather of the logits.  The steps come from
        `iter_generate`.  A batch samples from one stream seeded by seed, row after row.
        """
        if isinstance(prompts, str) or stream is not False or stop is not None:
            from tpcore.models.text_generate import generate_text
            kw = dict(temperature=temperature, top_k=top_k, seed=seed, eos_token_id=eos_token_id,
                      pad_token_id=pad_token_id, top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty, sampling=sampling)
            return generate_text(self, prompts, max_new_tokens, stream, stop, **kw)
        stream = self.iter_generate(prompts, max_new_tokens, temperature, top_k, seed, eos_token_id, pad_token_id,
                                    top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty,
                                    presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                    sampling=sampling)
        out = [s.tolist() for s in stream.prompts]
        for ids in stream:
            for b, t in enumerate(ids.tolist()):
                out[b].append(t)
        return generate_result(out)

    def iter_generate(self, prompts: Any, max_new_tokens: int = 16, temperature: Optional[float] = None,
                      top_k: Optional[int] = None, seed: Optional[int] = None, eos_token_id: Any = None,
                      pad_token_id: Optional[int] = None, *, top_p: Optional[float] = None,
                      min_p: Optional[float] = None, repetition_penalty: Optional[float] = None,
                      presence_penalty: Optional[float] = None, frequency_penalty: Optional[float] = None,
                      logprobs: Optional[int] = None, sampling: Optional[SamplingParams] = None) -> "GenerationStream":
        """`generate` one step at a time: an iterator over each step's new ids.

            stream = model.iter_generate([ids], 64, temperature=0.7, top_p=0.9)
            for ids in stream:          # (B,) int64 per step; ids[b] is pad once row b finished
                print(ids[0])

        Signature (the text layer builds on it): ``iter_generate(prompts, max_new_tokens=16,
        temperature=None, top_k=None, seed=None, eos_token_id=None, pad_token_id=None, *,
        top_p=None, min_p=None, repetition_penalty=None, presence_penalty=None,
        frequency_penalty=None, logprobs=None, sampling=None) -> GenerationStream``.

        Parameters
        ----------
        prompts : array_like of int, shape (B, T), or list of 1-D sequences
            Prompts of one length, or of their own lengths.
        max_new_tokens : int, default 16
            The most steps, >= 0.
        {sampling}
        logprobs : int, optional
            None: none; 0: each generated token's log-probability; k in 1..20: also the k most
            probable, in ``stream.logprobs`` (log-softmax of the raw logits).

        Returns
        -------
        GenerationStream
            Yields (B,) int64 arrays, one per step, until max_new_tokens steps or every row
            has emitted an eos id; ``stream.done`` (B,) says which rows have, ``stream.prompts``
            the checked prompts, ``stream.logprobs[b]`` row b's TokenLogprob per step.

        Raises
        ------
        TypeError, ValueError
            As `generate`, here (the arguments are checked and agreed before the first step).

        Notes
        -----
        Collective: the agreement here; each step (each ``next``) runs the forward and the
        gather of the logits, so every rank must take the same number of steps (stop on
        what every rank sees alike: the ids, text decoded from them).  The stream owns the
        model's KV cache: `generate`, `cache` or an Engine step on the model before the stream
        ends make its next step a RuntimeError.  ``close()`` ends it early.
        """
        err = None
        try:
            kw = dict(temperature=temperature, top_k=top_k, seed=seed, top_p=top_p, min_p=min_p,
                      repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, logprobs=logprobs)
            args = generate_args(self, prompts, max_new_tokens, kw, eos_token_id, pad_token_id, sampling)
        except (TypeError, ValueError) as e:
            err = e
        agree_generate(self.comm, args if err is None else None, err)
        return GenerationStream(self, *args)

    for _f in (generate, iter_generate):
        if _f.__doc__:  # (python -OO drops docstrings)
            _f.__doc__ = _f.__doc__.replace("{sampling}", _SAMPLING_DOC)
    del _f


def sampling_args(model, kw: dict, sampling: Optional[SamplingParams], who: str = "generate") -> SamplingParams:
    """The SamplingParams of generate's settings kw (None: not given; the rest from model's
    generation_config), or `sampling` when given (then every setting of kw must be None).

    Parameters
    ----------
    model : TransformerLM
        Its ``generation_config`` gives the defaults.
    kw : dict
        SamplingParams' fields as generate took them.
    sampling : SamplingParams or None
        The settings at once.
    who : str
        The caller, for the messages.
    """
    if sampling is not None:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"{who}: sampling must be a SamplingParams or None, got {shown(sampling)}")
        given = sorted(k for k, v in kw.items() if v is not None)
        if given:
            raise TypeError(f"{who}: give either sampling or the settings {', '.join(given)}, not both")
        return sampling
    return SamplingParams.make(who, getattr(model, "generation_config", None) or {}, **kw)


def generate_args(model, prompts, max_new_tokens, sampling_kw: dict, eos_token_id, pad_token_id, sampling=None):
    """`TransformerLM.generate`'s arguments checked against model's config: (prompts as 1-D
    int64 arrays, max_new_tokens, SamplingParams (`sampling_args`), eos ids in the vocabulary,
    pad id)."""
    cfg, who = model.config, "generate"
    if not cfg.causal:
        raise ValueError("generate: needs a causal (decoder) model")
    max_new = int_arg(max_new_tokens, who, "max_new_tokens", lo=0, hi=2 ** 31 - 1)
    params = sampling_args(model, sampling_kw, sampling, who)
    seqs = _prompts(prompts, who)
    for b, q in enumerate(seqs):
        check_vocab(q, cfg.vocab_size, who, f"prompt {b}")
    gen = getattr(model, "generation_config", {}) or {}
    if eos_token_id is None:
        eos_token_id = gen.get("eos_token_id")
    eos_ids = eos_ids_arg(eos_token_id, cfg.vocab_size, who)
    if pad_token_id is None:
        pad_token_id = gen.get("pad_token_id")
        if pad_token_id is None:
            pad_token_id = eos_ids[0] if eos_ids else 0
    if isinstance(pad_token_id, (list, tuple)) and len(pad_token_id) == 1:
        pad_token_id = pad_token_id[0]
    pad = int_arg(pad_token_id, who, "pad_token_id")
    if eos_ids and not 0 <= pad < cfg.vocab_size:  # a finished sequence is fed pad tokens
        raise ValueError(f"generate: pad_token_id must be in [0, vocab_size={cfg.vocab_size}), got {pad}")
    longest = max(q.size for q in seqs)
    if cfg.positions == "learned" and longest + max_new > cfg.max_positions:
        raise ValueError(f"generate: {longest + max_new} tokens (the longest prompt, {longest}, plus "
                         f"max_new_tokens={max_new}) exceed max_positions ({cfg.max_positions})")
    return seqs, max_new, params, eos_ids, pad


def batch_samplers(params: SamplingParams, vocab_size: int, seqs) -> list:
    """One Sampler per prompt of a generate batch, sharing one stream seeded by params.seed (the
    rows draw from it in turn, row after row, step after step).

    Parameters
    ----------
    params : SamplingParams
        The batch's settings.
    vocab_size : int
        The logits' width.
    seqs : list of numpy.ndarray
        The prompts (repetition_penalty reads them).
    """
    rng = None if params.greedy else np.random.default_rng(params.seed)
    return [Sampler(params, vocab_size, q, rng=rng) for q in seqs]


class GenerationStream:
    """The steps of one `iter_generate` call: iterating yields each step's new ids, (B,) int64.

    Parameters
    ----------
    model : TransformerLM
        The model (its KV cache is the stream's until it ends).
    seqs : list of numpy.ndarray
        The prompts, checked.
    max_new_tokens : int
        The most steps.
    params : SamplingParams
        The settings of every row.
    eos_ids : list of int
        A row that emits one is done (then fed and given pad_token_id).
    pad_token_id : int
        A finished row's id.

    Notes
    -----
    Attributes: ``prompts`` (the checked prompts), ``sampling`` (the SamplingParams),
    ``eos_ids``, ``pad_token_id``, ``done`` ((B,) bool: the rows that emitted an eos id),
    ``steps`` (steps taken), ``logprobs`` (per row, a list of TokenLogprob per step while the
    row runs, when sampling.logprobs is not None; else None).
    """

    def __init__(self, model, seqs, max_new_tokens, params, eos_ids, pad_token_id):
        self.model, self.prompts, self.max_new_tokens = model, seqs, max_new_tokens
        self.sampling, self.eos_ids, self.pad_token_id = params, eos_ids, pad_token_id
        self.done = np.zeros(len(seqs), bool)
        self.steps = 0
        self.logprobs = [[] for _ in seqs] if params.logprobs is not None else None
        self._gen = _decode(model, self)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        return next(self._gen)

    def close(self) -> None:
        """End the stream (no more steps; the model's cache is free for other work)."""
        self._gen.close()


def _cache_owner(model):
    b = getattr(model, "blocks", None)
    return getattr(b[0], "_filled", None) if b else None


def _decode(model, stream: GenerationStream):
    """The prefill of every prompt, then one decode step per next(): yields each step's ids."""
    seqs, max_new_tokens, eos_ids = stream.prompts, stream.max_new_tokens, stream.eos_ids
    if max_new_tokens == 0:
        return
    B, lens = len(seqs), np.array([s.size for s in seqs], np.int64)
    model.cache(B, int(lens.max()) + max_new_tokens)
    owner = _cache_owner(model)
    samplers = batch_samplers(stream.sampling, model.config.vocab_size, seqs)
    out = [list(s) for s in seqs]
    h, last = _prefill(model, seqs, lens)
    hook = model._on_token  # the benchmarks' clock: -1 after the prefill, then each step's index
    if hook is not None:
        hook(-1)
    cur, done = lens.copy(), stream.done
    for step in range(max_new_tokens):
        logits = model.gather_logits(model.logits_shard(last if model._kdev is not None
                                                        else np.ascontiguousarray(last)))  # (B, V), every rank
        nxt, lps = sample_batch(logits, samplers)
        if nxt.min() < 0:
            i = int(np.argmax(nxt < 0))
            raise logits_error("generate", f"sequence {i}", step, int(nxt[i]))
        if eos_ids:
            nxt = np.where(done, stream.pad_token_id, nxt)
        for b in range(B):
            t = int(nxt[b])
            out[b].append(t)
            if not done[b]:
                samplers[b].accept(t)
                if stream.logprobs is not None:
                    stream.logprobs[b].append(lps[b])
        if eos_ids:
            done |= np.isin(nxt, eos_ids)
        if hook is not None:
            hook(step)
        stream.steps = step + 1
        yield nxt
        if step == max_new_tokens - 1 or (eos_ids and done.all()):
            return
        if _cache_owner(model) is not owner:
            raise RuntimeError("generate: the model's KV cache was reallocated (generate(), cache() or an Engine ran "
                               "on it) while this stream was open: its cached tokens are gone; start a new stream")
        if _longrope_switch(model, cur):  # transformers' Phi-3: past the original length, every key again
            h, last = _prefill(model, [np.asarray(o, np.int64) for o in out], cur + 1)
        else:
            h = model._forward(nxt.reshape(B, 1), pos0=cur, use_cache=True, _agreed=True)
            last = model._dev(h, (B, model.config.hidden)) if model._kdev is not None else h[:, 0]
        cur = cur + 1


def _prefill(model, seqs, lens):
    """Every sequence from position 0 through the cache (right padding: causal), and each one's
    last row: (h, last)."""
    B = len(seqs)
    padded = np.zeros((B, int(lens.max())), np.int64)
    for b, s in enumerate(seqs):
        padded[b, :s.size] = s
    h = model._forward(padded, pos0=np.zeros(B, np.int64), use_cache=True, _agreed=True)
    if model._kdev is not None:  # each sequence's last row, gathered where h lives (an embedding lookup)
        Tp, C = padded.shape[1], model.config.hidden
        rows = on_device(np.ascontiguousarray(np.arange(B) * Tp + lens - 1, dtype=np.int64), model._kdev)
        return h, _C.embedding_forward(rows, model._dev(h, (B * Tp, C)))
    return h, h[np.arange(B), lens - 1]                                                   # (B, C)


def _longrope_switch(model, cur) -> bool:
    """Whether the next decode step is the first past a LongRoPE model's original length: the
    cached keys hold the short factors, so transformers' Phi-3 drops its cache there and runs the
    whole sequence again with the long ones (prepare_inputs_for_generation); so does tpcore."""
    s = model.config.rope_scaling
    if not s or s.get("rope_type", s.get("type")) != "longrope":
        return False
    orig = s.get("original_max_position_embeddings") or model.config.max_positions
    return int(cur.max()) == int(orig)


def sample(logits, temperature, top_k, rng, who: str = "sample", step: int = 0, checked: bool = False):
    """The next token of each row of logits (n, vocab): the argmax at temperature 0, else drawn
    from the softmax of logits / temperature (of the top_k largest when top_k) with rng, one
    number per row in row order (`tpcore.models.sampling.draw`).  A row holding NaN or +inf, or
    all -inf, is a ValueError naming who, the row ("sequence i") and step (`logits_error`),
    greedy or not: no token is returned for it.  checked: the caller has already looked at the
    rows with `bad_logits` (the Engine, PipelineLM): not again.  The settings of tpcore before
    `SamplingParams`; `Sampler` and `sample_batch` take all of them."""
    codes = None if checked else bad_logits(logits)
    if codes is not None and codes.any():
        i = int(np.flatnonzero(codes)[0])
        raise logits_error(who, f"sequence {i}", step, codes[i])
    if temperature <= 0:
        return logits.argmax(-1).astype(np.int64)
    k = int(top_k or 0)
    return np.array([draw(row, temperature, k, 1.0, 0.0, rng) for row in logits], np.int64)


def agree_generate(comm: Comm, args, err) -> None:
    """generate's arguments (generate_args's tuple; None with err, this rank's refusal) checked
    to be the same on every rank of comm; raises on every rank if not (or err here)."""
    if comm.size == 1:
        if err is not None:
            raise err
        return
    ok = err is None
    seqs, max_new, params, eos_ids, pad = args if ok else (None,) * 5

    def signed(v):
        return v - 2 ** 64 if v >= 2 ** 63 else v

    def real(name):
        return (f"{name} differs", (getattr(params, name),) if ok else (), None)

    agree(comm, "generate", [
        ("the prompts differ", tuple(seqs) if ok else (), None),
        ("max_new_tokens differs", max_new if ok else 0, str),
        real("temperature"),
        ("top_k differs", params.top_k if ok else 0, lambda v: "None" if v == 0 else str(v)),
        real("top_p"), real("min_p"), real("repetition_penalty"), real("presence_penalty"),
        real("frequency_penalty"),
        ("seed differs", signed(params.seed) if ok else 0, lambda v: str(v % 2 ** 64)),
        ("logprobs differs", (-1 if params.logprobs is None else params.logprobs) if ok else 0,
         lambda v: "None" if v < 0 else str(v)),
        ("eos_token_id differs", (np.array(eos_ids, np.int64),) if ok else (), None),
        ("pad_token_id differs", pad if ok else 0, str)], err)


def _prompts(prompts, who: str) -> list:
    """generate's prompts as a list of non-empty 1-D int64 arrays: a (B, T) integer array, one
    flat sequence of ids, or a list of sequences of their own lengths."""
    want = "a (B, T) integer array, one sequence of token ids, or a list of such sequences"
    if isinstance(prompts, (str, bytes)) or prompts is None or is_int(prompts) or \
            not (isinstance(prompts, np.ndarray) or hasattr(prompts, "__len__") or hasattr(prompts, "__dlpack__")):
        raise TypeError(f"{who}: prompts must be {want}, got {shown(prompts)}")
    if not isinstance(prompts, (list, tuple)):
        a = int_array(prompts, who, "prompts")
        if a.ndim not in (1, 2):
            raise ValueError(f"{who}: prompts must be {want}, got an array of shape {a.shape}")
        batch = list(a) if a.ndim == 2 else [a]
    elif len(prompts) and all(is_int(t) for t in prompts):
        batch = [prompts]  # one flat prompt
    else:
        batch = list(prompts)
    seqs = []
    for b, p in enumerate(batch):
        q = int_array(p, who, f"prompt {b}")
        if q.ndim != 1:
            raise ValueError(f"{who}: prompts must be {want}; prompt {b} has shape {q.shape}")
        seqs.append(q)
    if not seqs or any(q.size == 0 for q in seqs):
        raise ValueError(f"{who}: every prompt needs at least one token (got {len(seqs)} prompts of lengths "
                         f"{[q.size for q in seqs]})")
    return seqs


def eos_ids_arg(eos_token_id, vocab_size: int, who: str) -> list:
    """eos_token_id (None, one id, or several: Llama 3 Instruct stops on any of three) as the list
    of ids that can be emitted: ids outside the vocabulary (e.g. GPT-2's 50256 in a small test
    model, or -1: never stop) never are."""
    if eos_token_id is None:
        eos = []
    elif isinstance(eos_token_id, np.ndarray):
        eos = list(eos_token_id.reshape(-1))
    else:
        eos = list(eos_token_id) if isinstance(eos_token_id, (list, tuple)) else [eos_token_id]
    if not all(is_int(e) for e in eos):
        raise TypeError(f"{who}: eos_token_id must be an integer, a list of integers or None, got "
                        f"{shown(eos_token_id)}")
    return [int(e) for e in eos if 0 <= int(e) < vocab_size]


def generate_result(out):
    """The generated sequences (lists of ids) as generate returns them: one (B, T) int64 array
    when they have one length, else a list of 1-D arrays."""
    res = [np.array(o, np.int64) for o in out]
    return np.stack(res) if len(set(r.size for r in res)) == 1 else res


def check_vocab(t: np.ndarray, n: int, who: str, name: str, what: str = "vocab_size") -> None:
    """Every id of t in [0, n), or a ValueError naming the first one outside."""
    lo, hi = minmax(t) if t.size else (0, 0)
    if lo < 0 or hi >= n:
        at = tuple(int(i) for i in np.argwhere((t < 0) | (t >= n))[0])
        raise ValueError(f"{who}: {name} holds {int(t[at])} at index {at if len(at) != 1 else at[0]}, out of range "
                         f"[0, {what}={n})")
