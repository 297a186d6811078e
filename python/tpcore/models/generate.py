"""Generation: prompts, sampling, eos handling and the KV-cache decode loop.

    out = model.generate(prompts, max_new_tokens=16)       # TransformerLM.generate calls these

`generate_args` checks `TransformerLM.generate`'s arguments against a model's config (and
its checkpoint's generation_config), `agree_generate` checks that every rank passed the
same, `generate_tokens` runs the batched prefill and the decode steps through the model's
KV cache, `sample` picks the next tokens from full-vocabulary logits (greedy or top-k
sampling), refusing logits no token can be drawn from (`bad_logits`, `logits_error`: NaN,
+inf, or every logit -inf; NumPy's argmax would pick the first NaN, the softmax would give
NaN probabilities, and either would return tokens silently).  `tpcore.PipelineLM` (its
stages) and `tpcore.Engine` (its requests) reuse the argument checks, the agreement and the
sampling.

`TransformerLM` takes its `generate` method from `_GenerationMixin`.  The decode loop
drives the model through its methods (`_forward` with the KV cache, which leaves the hidden
states on the model's device, `logits_shard`, `gather_logits`, `cache`); this module does not
import the model (models.lm imports it).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from tpcore import _C
from tpcore.distributed.agree import agree
from tpcore.distributed.comm import Comm
from tpcore.models.norm import on_device
from tpcore.utils.args import int_arg, is_int, minmax, real_arg, seed_arg, shown
from tpcore.utils.arrays import int_array

__all__ = ["generate_args", "generate_tokens", "sample", "agree_generate", "eos_ids_arg", "generate_result",
           "check_vocab", "bad_logits", "logits_error"]


class _GenerationMixin:
    """`TransformerLM.generate`: the arguments checked and agreed, then `generate_tokens`."""

    def generate(self, prompts: Any, max_new_tokens: int = 16, temperature: float = 0.0, top_k: Optional[int] = None,
                 seed: int = 0, eos_token_id: Any = None, pad_token_id: Optional[int] = None, stream: bool = False,
                 stop: Any = None) -> Any:
        """Batched prefill, then KV-cache decoding (causal models).

        Parameters
        ----------
        prompts : array_like of int, shape (B, T), or list of 1-D sequences, or str
            Prompts of one length, or of their own lengths; or one text (the model's
            tokenizer encodes it, and the generated text is returned:
            `tpcore.models.text_generate.generate_text`).
        max_new_tokens : int, default 16
            Tokens to generate per prompt, >= 1.
        temperature : float, default 0.0
            0: greedy (the same tokens at every world size); > 0: sampling.
        top_k : int, optional
            Sample only from the k largest logits (None or 0: from all).
        seed : int, default 0
            The sampling stream, an integer in [0, 2**64).
        eos_token_id : int or list of int, optional
            A sequence that emits it is finished (default None: the checkpoint's
            generation_config.json, as in Hugging Face; -1: never stop).
        pad_token_id : int, optional
            Fills a finished sequence's rest (default None: generation_config's, else the
            first eos id, else 0).
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
            A bad argument, an encoder model, a sequence past max_positions, or ranks that
            passed different arguments (ValueError on every rank).
        ValueError
            Logits no token can be drawn from (NaN, +inf, or all -inf: the model's weights
            or activations went bad), naming the sequence and the step; on every rank.

        Notes
        -----
        Collective: one small all-gather at entry checks the arguments agree; per step,
        `forward`'s collectives and an all-gather of the logits.
        """
        if isinstance(prompts, str) or stream is not False or stop is not None:
            from tpcore.models.text_generate import generate_text
            return generate_text(self, prompts, max_new_tokens, stream, stop, temperature=temperature, top_k=top_k,
                                 seed=seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
        err = None
        try:
            args = generate_args(self, prompts, max_new_tokens, temperature, top_k, seed, eos_token_id, pad_token_id)
        except (TypeError, ValueError) as e:
            err = e
        agree_generate(self.comm, args if err is None else None, err)
        return generate_tokens(self, *args)



def generate_args(model, prompts, max_new_tokens, temperature, top_k, seed, eos_token_id, pad_token_id):
    """`TransformerLM.generate`'s arguments checked against model's config: (prompts as 1-D
    int64 arrays, max_new_tokens, temperature, top_k (0: none), seed, eos ids in the
    vocabulary, pad id)."""
    cfg, who = model.config, "generate"
    if not cfg.causal:
        raise ValueError("generate: needs a causal (decoder) model")
    max_new = int_arg(max_new_tokens, who, "max_new_tokens", lo=0, hi=2 ** 31 - 1)
    temp = real_arg(temperature, who, "temperature", lo=0)
    if top_k is None:
        top_k = 0
    else:
        top_k = int_arg(top_k, who, "top_k", lo=0, hi=cfg.vocab_size,
                        expected=f"an integer in [1, vocab_size={cfg.vocab_size}] (or None or 0: no top-k "
                                 f"filtering)")
    seed = seed_arg(seed, who)
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
    return seqs, max_new, temp, top_k, seed, eos_ids, pad


def generate_tokens(model, seqs, max_new_tokens, temperature, top_k, seed, eos_ids, pad_token_id):
    """The prefill of every prompt and max_new_tokens decode steps through model's KV cache,
    the arguments as `generate_args` gives them (and agreed): the prompts extended, as
    `generate_result` returns them."""
    B, lens = len(seqs), np.array([s.size for s in seqs], np.int64)
    total = int(lens.max()) + max_new_tokens
    model.cache(B, total)
    rng = np.random.default_rng(seed)
    out = [list(s) for s in seqs]
    if max_new_tokens == 0:
        return generate_result(out)
    h, last = _prefill(model, seqs, lens)
    hook = model._on_token  # the benchmarks' clock: -1 after the prefill, then each step's index
    if hook is not None:
        hook(-1)
    cur = lens.copy()
    done = np.zeros(B, bool)
    for step in range(max_new_tokens):
        logits = model.gather_logits(model.logits_shard(last if model._kdev is not None
                                                        else np.ascontiguousarray(last)))  # (B, V), every rank
        nxt = sample(logits, temperature, top_k, rng, "generate", step)
        if eos_ids:
            nxt = np.where(done, pad_token_id, nxt)
            done |= np.isin(nxt, eos_ids)
        for b in range(B):
            out[b].append(int(nxt[b]))
        if hook is not None:
            hook(step)
        if step == max_new_tokens - 1 or (eos_ids and done.all()):
            break
        if _longrope_switch(model, cur):  # transformers' Phi-3: past the original length, every key again
            h, last = _prefill(model, [np.asarray(o, np.int64) for o in out], cur + 1)
        else:
            h = model._forward(nxt.reshape(B, 1), pos0=cur, use_cache=True, _agreed=True)
            last = model._dev(h, (B, model.config.hidden)) if model._kdev is not None else h[:, 0]
        cur = cur + 1
    return generate_result(out)


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


_BAD_LOGITS = {-1: "hold NaN", -2: "hold +inf", -3: "are all -inf (no token can be drawn)"}


def bad_logits(logits) -> np.ndarray:
    """Per row of logits (n, vocab): 0 when a token can be picked from it, else -1 (it holds a
    NaN), -2 (+inf; no NaN) or -3 (every logit is -inf).  One max per row (NaN propagates
    through it); only the rows whose max is not finite are looked at again."""
    hi = np.max(logits, axis=-1)
    codes = np.zeros(hi.shape, np.int64)
    for i in np.flatnonzero(~np.isfinite(hi)).tolist():
        codes[i] = -1 if np.isnan(hi[i]) else (-2 if hi[i] > 0 else -3)
    return codes


def logits_error(who: str, what: str, step: int, code: int) -> ValueError:
    """The error for logits that `bad_logits` gave code (< 0), naming whose ("sequence 0",
    "request 5") and the step (the index of the token being picked, 0 for the first)."""
    return ValueError(f"{who}: the logits of {what} at step {step} {_BAD_LOGITS[int(code)]} (the model's weights or "
                      f"inputs hold NaN/Inf?)")


def sample(logits, temperature, top_k, rng, who: str = "sample", step: int = 0, checked: bool = False):
    """The next token of each row of logits (n, vocab): the argmax at temperature 0, else drawn
    from the softmax of logits / temperature (of the top_k largest when top_k) with rng.  A row
    holding NaN or +inf, or all -inf, is a ValueError naming who, the row ("sequence i") and
    step (`logits_error`), greedy or not: no token is returned for it.  checked: the caller
    has already looked at the rows with `bad_logits` (the Engine, PipelineLM): not again."""
    codes = None if checked else bad_logits(logits)
    if codes is not None and codes.any():
        i = int(np.flatnonzero(codes)[0])
        raise logits_error(who, f"sequence {i}", step, codes[i])
    if temperature <= 0:
        return logits.argmax(-1).astype(np.int64)
    z = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(z, -1)[:, -int(top_k)][:, None]
        z = np.where(z >= kth, z, -np.inf)
    z -= z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    u = rng.random(len(p))[:, None]
    return np.minimum((np.cumsum(p, -1) < u).sum(-1), p.shape[-1] - 1).astype(np.int64)


def agree_generate(comm: Comm, args, err) -> None:
    """generate's arguments (generate_args's tuple; None with err, this rank's refusal) checked
    to be the same on every rank of comm; raises on every rank if not (or err here)."""
    if comm.size == 1:
        if err is not None:
            raise err
        return
    ok = err is None
    seqs, max_new, temp, top_k, seed, eos_ids, pad = args if ok else (None,) * 7

    def signed(v):
        return v - 2 ** 64 if v >= 2 ** 63 else v

    agree(comm, "generate", [
        ("the prompts differ", tuple(seqs) if ok else (), None),
        ("max_new_tokens differs", max_new if ok else 0, str),
        ("temperature differs", (temp,) if ok else (), None),
        ("top_k differs", top_k if ok else 0, lambda v: "None" if v == 0 else str(v)),
        ("seed differs", signed(seed) if ok else 0, lambda v: str(v % 2 ** 64)),
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
