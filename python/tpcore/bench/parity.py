"""Same results at every world size: perplexity, KL divergence against one rank and greedy agreement.

    python -m tpcore.bench parity --checkpoint DIR --worlds 1,2,4
    python -m tpcore.bench parity --checkpoint DIR --text FILE --json parity.json --plot
    python -m tpcore.bench parity --checkpoint model.gguf --worlds 1,2 --tokens 1,15043,3186

For each world size, the checkpoint is loaded on that many ranks (one tpcore.spawn per world)
and run over one text with teacher forcing: the text's tokens in consecutive windows of the
model's context (--window), the full-vocabulary logits of every position.  On the host, in
float64 (log-softmax of each position):

  ppl            the perplexity of the text: exp of the mean negative log-likelihood of each
                 next token (every position but the last is scored; a window's first token is
                 predicted by the previous window's last position)
  KL mean / max  KL(world 1 || world N) of the next-token distributions, mean and max over the
                 positions (natural log; 0 when the logits are identical)
  greedy agree   the fraction of positions whose most likely next token equals world 1's
  diverges at    greedy generation (--new tokens after the text's first --prompt tokens, EOS
                 ignored): the first generated token that differs from world 1's ("-": none)
  ms/token       the teacher-forced passes' wall time per token (the slowest rank's)

and the same against Hugging Face transformers (AutoModelForCausalLM, float32, run last in this
process) when transformers and torch import and transformers loads the checkpoint (a Hugging
Face folder; a GGUF file through its GGUF loader, which needs accelerate and gguf); a failure to
load is shown, not fatal (--no-transformers skips it).  The text's tokens: the checkpoint's own tokenizer
(tokenizer.json through the `tokenizers` package, or a GGUF file's embedded tokenizer), else
--tokens, else the text's UTF-8 bytes (modulo the vocabulary), labelled as such in the output.
Default text: a built-in English paragraph (--text FILE for another).

Exit status: 0 when every world's greedy tokens equal world 1's, 1 when one differs, 2 for a
bad argument (a one-line message).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import tempfile
import time
from typing import List, Optional, Tuple

import numpy as np

DEFAULT_TEXT = (
    "Tensor parallelism splits each layer of a model across several devices. The attention heads are divided "
    "between them, and so are the columns of the first matrix of the feed-forward network and the rows of the "
    "second; every device computes its share, and an all-reduce adds the partial results. Done right, the split "
    "model computes the same function as the whole one: the sums are only taken in another order, so the "
    "numbers differ in their last bits and nowhere else. Done wrong, a head lands on the wrong device, a bias is "
    "added twice, or a rotary table is offset, and the output drifts while still looking like language. "
    "Perplexity over a known text, the divergence of each next-token distribution from the one computed on a "
    "single device, and the agreement of the greedy tokens tell the two cases apart.")


class ArgError(ValueError):
    """A bad command-line argument: printed as one line, exit status 2."""


def _worlds(text: str) -> List[int]:
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ArgError(f"--worlds must be a comma list of positive integers, got {text!r}") from None
    if not v or min(v) < 1:
        raise ArgError(f"--worlds must be a comma list of positive integers, got {text!r}")
    return sorted(set(v) | {1})  # every comparison is against one rank: world 1 runs first


def add_arguments(p: argparse.ArgumentParser) -> None:
    _one_line_errors(p)
    p.add_argument("--checkpoint", default=None, help="a Hugging Face or tpcore checkpoint folder, or a .gguf file "
                                                      "(required)")
    p.add_argument("--worlds", default="1,2,4", help="world sizes, a comma list (default 1,2,4; 1 is always run)")
    p.add_argument("--text", metavar="FILE", default=None, help="the text (UTF-8; default: a built-in paragraph)")
    p.add_argument("--tokens", default=None, help="token ids instead of a text: a comma list, or @FILE of them")
    p.add_argument("--max-tokens", type=int, default=512, help="score at most this many tokens (default 512)")
    p.add_argument("--window", type=int, default=None, help="tokens per teacher-forced pass (default: the context)")
    p.add_argument("--prompt", type=int, default=16, help="greedy generation: prompt tokens (default 16)")
    p.add_argument("--new", type=int, default=32, help="greedy generation: new tokens (default 32)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: one GPU per rank (the nccl backend)")
    p.add_argument("--no-transformers", dest="transformers", action="store_false",
                   help="skip the comparison with Hugging Face transformers")
    p.add_argument("--json", metavar="FILE", nargs="?", const="parity.json", default=None,
                   help="write the numbers as JSON (FILE, default parity.json)")
    p.add_argument("--plot", metavar="FILE", nargs="?", const="parity.png", default=None,
                   help="KL per position as a PNG (matplotlib; FILE, default parity.png)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one world size may take")
    p.add_argument("--no-progress", dest="progress", action="store_false")


# ---------------------------------------------------------------- the checkpoint and its text
def checkpoint_config(path: str):
    """The tpcore Config of a checkpoint (HF folder, tpcore folder or GGUF file), read here."""
    import tpcore
    from tpcore.bench.decode import gguf_path
    from tpcore.io import formats
    g = gguf_path(path)
    if g:
        import tpcore.models.gguf
        return tpcore.models.gguf.read_gguf(g)[0]
    if not os.path.isdir(path):
        raise ArgError(f"--checkpoint {path!r}: no such folder or .gguf file")
    own = os.path.join(path, formats.OWN_CONFIG)
    if os.path.exists(own):
        with open(own) as f:
            return tpcore.Config(**json.load(f))
    if not os.path.exists(os.path.join(path, formats.HF_CONFIG)):
        raise ArgError(f"--checkpoint {path!r}: a folder without {formats.HF_CONFIG} or {formats.OWN_CONFIG}")
    return tpcore.Config.from_hf(path)


def _tokenizer(checkpoint: str):
    """(tokenizer with .encode(text).ids, label) of the checkpoint, or (None, why there is none)."""
    from tpcore.bench.decode import gguf_path
    g = gguf_path(checkpoint)
    try:
        if g:
            import tpcore.models.gguf
            return tpcore.models.gguf.tokenizer(g), "the GGUF file's tokenizer"
        tj = os.path.join(checkpoint, "tokenizer.json")
        if not os.path.exists(tj):
            return None, "the checkpoint has no tokenizer.json"
        from tokenizers import Tokenizer
        return Tokenizer.from_file(tj), "tokenizer.json"
    except ImportError:
        return None, "the `tokenizers` package is not installed"
    except ValueError as e:  # a GGUF tokenizer tpcore does not build
        return None, f"the GGUF tokenizer: {e}"


def text_tokens(checkpoint: str, vocab: int, text: Optional[str] = None, tokens: Optional[str] = None,
                text_name: str = "the built-in text") -> Tuple[np.ndarray, str]:
    """The ids to score and where they come from (a label for the output)."""
    if tokens is not None:
        src = tokens
        if tokens.startswith("@"):
            try:
                with open(tokens[1:]) as f:
                    src = f.read()
            except OSError as e:
                raise ArgError(f"--tokens {tokens!r}: {e.strerror}") from None
        try:
            ids = [int(x) for x in src.replace(",", " ").split()]
        except ValueError:
            raise ArgError(f"--tokens must be integers separated by commas or spaces, got {src[:60]!r}") from None
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ArgError(f"--tokens: ids must be in [0, {vocab}) (the vocabulary), got {bad[0]}")
        return np.asarray(ids, np.int64), "--tokens"
    text = DEFAULT_TEXT if text is None else text
    if not text.strip():
        raise ArgError(f"--text {text_name}: the text is empty")
    tok, label = _tokenizer(checkpoint)
    if tok is not None:
        ids = np.asarray(tok.encode(text).ids, np.int64)
        if ids.size and int(ids.max()) >= vocab:
            raise ArgError(f"{label} gives id {int(ids.max())}, outside the model's vocabulary of {vocab}")
        return ids, f"{text_name} through {label}"
    raw = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int64) % vocab
    return raw, f"{text_name} as UTF-8 bytes modulo {vocab} (no tokenizer: {label}; not a real tokenization)"


def windows(n: int, window: int) -> List[Tuple[int, int]]:
    """Consecutive [start, stop) windows of at most `window` tokens covering n tokens."""
    return [(s, min(s + window, n)) for s in range(0, n, window)]


# ---------------------------------------------------------------- logits (every rank / transformers)
def world_logits(model, ids: np.ndarray, window: int, path: Optional[str]) -> float:
    """Teacher-forced logits of ids (N,), window by window, written to the .npy file path (float32,
    (N, vocab)) when path is given; collective over the model's ranks.  Returns the seconds of the
    passes."""
    V = model.config.vocab_size
    out = np.lib.format.open_memmap(path, "w+", np.float32, (ids.size, V)) if path else None
    model.comm.barrier()
    t0 = time.perf_counter()
    for s, e in windows(ids.size, window):
        lg = model.logits(ids[None, s:e])[0]
        if out is not None:
            out[s:e] = lg
    secs = time.perf_counter() - t0
    if out is not None:
        out.flush()
        del out
    return secs


def _rank(comm, spec: dict) -> dict:
    """One world size, on every rank (tpcore.spawn): load, teacher-forced logits, greedy tokens."""
    import tpcore
    from tpcore.bench._sweep import Progress
    prog = Progress(spec["progress"] and comm.rank == 0)
    tag = f"[parity] world {comm.size}"
    prog.status(f"{tag}: loading {spec['checkpoint']}", important=True)
    dev = f"cuda:{comm.local_rank}" if spec["device"] != "cpu" else None
    model = tpcore.models.from_pretrained(spec["checkpoint"], comm, progress=False, device=dev)
    ids = spec["ids"]
    prog.status(f"{tag}: logits of {ids.size} tokens", important=True)
    path = spec["logits_path"] if comm.rank == 0 else None
    secs = world_logits(model, ids, spec["window"], path)
    greedy = []
    if spec["new"] > 0:
        prompt = ids[None, :spec["prompt"]]
        # greedy whatever the checkpoint's generation_config says
        greedy = np.asarray(model.generate(prompt, max_new_tokens=spec["new"], eos_token_id=-1,
                                           temperature=0.0))[0, prompt.shape[1]:]
    prog.done()
    return {"rank": comm.rank, "seconds": secs, "greedy": [int(t) for t in greedy]}


def transformers_logits(checkpoint: str, ids: np.ndarray, window: int, path: str, prompt: int,
                        new: int) -> dict:
    """The same passes in Hugging Face transformers (AutoModelForCausalLM, float32, CPU): logits to
    path, greedy tokens, seconds.  Raises ImportError / any loading error: the caller reports it."""
    import torch
    import transformers
    from tpcore.bench.decode import gguf_path
    transformers.utils.logging.disable_progress_bar()
    g = gguf_path(checkpoint)
    where = dict(pretrained_model_name_or_path=os.path.dirname(os.path.abspath(g)), gguf_file=os.path.basename(g)) \
        if g else dict(pretrained_model_name_or_path=checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    V = int(model.config.vocab_size) if hasattr(model.config, "vocab_size") else None
    out = None
    t0 = time.perf_counter()
    with torch.no_grad():
        for s, e in windows(ids.size, window):
            lg = model(torch.from_numpy(ids[None, s:e])).logits[0].float().numpy()
            if out is None:
                V = lg.shape[-1]
                out = np.lib.format.open_memmap(path, "w+", np.float32, (ids.size, V))
            out[s:e] = lg
        secs = time.perf_counter() - t0
        greedy: List[int] = []
        if new > 0:  # plain argmax with the KV cache (as tpcore's greedy: no logits processors, EOS ignored)
            # transformers 5.25 calls the cache `cache` (past_key_values deprecated); earlier, past_key_values
            key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            o = model(torch.from_numpy(ids[None, :prompt]), use_cache=True)
            while True:
                greedy.append(int(o.logits[0, -1].argmax()))
                if len(greedy) == new:
                    break
                o = model(torch.tensor([[greedy[-1]]]), use_cache=True, **{key: o.get(key)})
    out.flush()
    return {"seconds": secs, "greedy": greedy, "version": transformers.__version__, "vocab": V}


def _hf_folder(checkpoint: str) -> Optional[str]:
    """Why transformers is not compared on this checkpoint, or None when it is (a Hugging Face
    folder, or a GGUF file: transformers' GGUF loader, which dequantizes to float32)."""
    from tpcore.bench.decode import gguf_path
    from tpcore.io import formats
    if not gguf_path(checkpoint) and not os.path.exists(os.path.join(checkpoint, formats.HF_CONFIG)):
        return "not a Hugging Face folder or GGUF file"
    if os.path.exists(os.path.join(checkpoint, formats.OWN_CONFIG)):
        return "a tpcore folder"
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        return f"not installed ({e.name})"
    return None


# ---------------------------------------------------------------- the comparisons (host, float64)
def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def nll(logits: np.ndarray, ids: np.ndarray, chunk: int = 256) -> np.ndarray:
    """Per position t < N-1: -log p(ids[t+1] | logits[t]) in float64."""
    n = ids.size - 1
    out = np.empty(n, np.float64)
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        lp = _log_softmax(np.asarray(logits[s:e]))
        out[s:e] = -lp[np.arange(e - s), ids[s + 1:e + 1]]
    return out


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp(mean next-token negative log-likelihood) of ids under teacher-forced logits (N, V)."""
    return float(np.exp(nll(logits, ids).mean()))


def compare(ref: np.ndarray, other: np.ndarray, chunk: int = 256) -> dict:
    """KL(ref || other) per position (float64, natural log) and the argmax agreement, over the
    positions that predict a token (all but the last)."""
    n = ref.shape[0] - 1
    if other.shape != ref.shape:
        raise ValueError(f"compare: logits of shape {other.shape} against {ref.shape}")
    kl = np.empty(n, np.float64)
    same = 0
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        a, b = np.asarray(ref[s:e]), np.asarray(other[s:e])
        la, lb = _log_softmax(a), _log_softmax(b)
        kl[s:e] = np.maximum((np.exp(la) * (la - lb)).sum(axis=-1), 0.0)
        same += int((a.argmax(axis=-1) == b.argmax(axis=-1)).sum())
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "kl_argmax": int(kl.argmax()),
            "agree": same / n, "kl": kl}


def first_divergence(a: List[int], b: List[int]) -> Optional[int]:
    """The first index where two greedy generations differ (None: equal over their common length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _against(row: dict, ref_logits, logits, ref_greedy: List[int], key: str) -> np.ndarray:
    c = compare(ref_logits, logits)
    row[f"kl_mean_{key}"], row[f"kl_max_{key}"] = c["kl_mean"], c["kl_max"]
    row[f"kl_max_position_{key}"] = c["kl_argmax"]
    row[f"agree_{key}"] = c["agree"]
    row[f"diverges_at_{key}"] = first_divergence(ref_greedy, row["greedy"])
    return c["kl"]


# ---------------------------------------------------------------- in the 1-vs-N report (tpcore.bench report)
def report_tokens(checkpoint: Optional[str], cfg, quick: bool) -> Tuple[np.ndarray, int, str]:
    """The report's parity text: (ids, window, label); the built-in text through the checkpoint's
    tokenizer, else its bytes; 64 tokens with --quick, else 256, in windows of the context."""
    vocab = cfg.vocab_size
    if checkpoint:
        ids, label = text_tokens(checkpoint, vocab)
    else:
        ids = np.frombuffer(DEFAULT_TEXT.encode("utf-8"), np.uint8).astype(np.int64) % vocab
        label = f"the built-in text as UTF-8 bytes modulo {vocab} (random weights: no tokenizer)"
    ids = ids[:64 if quick else 256]
    return ids, min(cfg.max_positions, ids.size), label


def report_rows(rows: List[dict], ids: np.ndarray, work: str) -> None:
    """Each report row gets "parity": perplexity, KL(world 1 || world n) mean and max, the argmax
    agreement (from work/world{n}.npy, each rank 0's `world_logits`) and the first generated token
    where the row's greedy tokens (every sequence) part from world 1's."""
    ref = np.load(os.path.join(work, f"world{rows[0]['n']}.npy"), mmap_mode="r")
    for r in rows:
        lg = np.load(os.path.join(work, f"world{r['n']}.npy"), mmap_mode="r")
        c = compare(ref, lg)
        parts = [first_divergence(a, b) for a, b in zip(rows[0]["tokens"], r["tokens"])]
        parts = [d for d in parts if d is not None]
        r["parity"] = {"ppl": perplexity(lg, ids), "kl_mean": c["kl_mean"], "kl_max": c["kl_max"],
                       "agree": c["agree"], "diverges_at": min(parts) if parts else None,
                       "ms_per_token": 1e3 * r.pop("parity_s") / ids.size}


# ---------------------------------------------------------------- the driver
def run(checkpoint: str, worlds: List[int], ids: np.ndarray, window: int, prompt: int = 16, new: int = 32,
        device: str = "cpu", with_transformers: bool = True, timeout: float = 3600.0, progress: bool = False,
        keep_logits: Optional[str] = None) -> dict:
    """Measure parity over worlds (world 1 first); the numbers `table` prints and --json writes.

    Parameters
    ----------
    checkpoint : str
        What `tpcore.models.from_pretrained` loads (a folder or a .gguf file).
    worlds : list of int
        World sizes; 1 is added when missing (every comparison is against it).
    ids : numpy.ndarray of int, shape (N,), N >= 2
        The tokens scored with teacher forcing.
    window : int
        Tokens per pass (at most the model's context).
    prompt, new : int
        Greedy generation: the first `prompt` tokens of ids, then `new` tokens (0: none).
    device : str
        "cpu" or "cuda" (one GPU per rank, the nccl backend).
    with_transformers : bool
        Compare with Hugging Face transformers where it applies (see `_hf_folder`).
    keep_logits : str, optional
        A folder to keep the logits in (world{n}.npy, transformers.npy); default None: a
        temporary one, removed.
    """
    import tpcore
    from tpcore.bench._sweep import Progress, env_info
    ids = np.ascontiguousarray(ids, np.int64)
    worlds = sorted(set(worlds) | {1})
    prog = Progress(progress)
    work = keep_logits or tempfile.mkdtemp(prefix="tpcore-parity-")
    os.makedirs(work, exist_ok=True)
    try:
        rows, logits, kls = [], {}, {}
        for n in worlds:
            path = os.path.join(work, f"world{n}.npy")
            spec = {"checkpoint": checkpoint, "ids": ids, "window": window, "prompt": prompt, "new": new,
                    "device": device, "progress": progress, "logits_path": path}
            res = tpcore.spawn(_rank, n, args=(spec,), backend="nccl" if device == "cuda" else "shm",
                               deadline=timeout)
            logits[n] = np.load(path, mmap_mode="r")
            row = {"world": n, "ppl": perplexity(logits[n], ids),
                   "ms_per_token": 1e3 * max(r["seconds"] for r in res) / ids.size, "greedy": res[0]["greedy"],
                   "same_greedy_across_ranks": all(r["greedy"] == res[0]["greedy"] for r in res)}
            kls[f"world{n}_vs_world1"] = _against(row, logits[1], logits[n], rows[0]["greedy"] if rows else
                                                  row["greedy"], "world1")
            rows.append(row)
        hf = {"skipped": "--no-transformers"} if not with_transformers else None
        why = None if hf else _hf_folder(checkpoint)
        if why:
            hf = {"skipped": why}
        elif hf is None:
            prog.status("[parity] transformers", important=True)
            path = os.path.join(work, "transformers.npy")
            try:
                hf = transformers_logits(checkpoint, ids, window, path, prompt, new)
                hf_logits = np.load(path, mmap_mode="r")
                if hf_logits.shape != logits[1].shape:
                    raise ValueError(f"transformers' logits have shape {hf_logits.shape}, tpcore's {logits[1].shape}")
            except Exception as e:  # noqa: BLE001 - any failure of the optional reference is shown, not fatal
                hf = {"skipped": f"transformers failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            else:
                hf["ppl"] = perplexity(hf_logits, ids)
                hf["ms_per_token"] = 1e3 * hf.pop("seconds") / ids.size
                for row in rows:
                    kls[f"world{row['world']}_vs_transformers"] = _against(row, hf_logits, logits[row["world"]],
                                                                           hf["greedy"], "transformers")
        prog.done()
        return {"tpcore": tpcore.__version__, "env": env_info(), "checkpoint": checkpoint, "tokens": int(ids.size),
                "window": window, "windows": len(windows(ids.size, window)), "prompt": prompt, "new": new,
                "device": device, "worlds": rows, "transformers": hf,
                "kl_per_position": {k: v.tolist() for k, v in kls.items()}}
    finally:
        logits = None
        if keep_logits is None:
            shutil.rmtree(work, ignore_errors=True)


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def table(data: dict) -> str:
    """The printed table: one row per world, then transformers' own row."""
    hf = data["transformers"]
    cmp_hf = "skipped" not in hf
    head = ["world", "ppl", "KL mean vs 1", "KL max vs 1", "agree vs 1", "diverges vs 1"]
    if cmp_hf:
        head += ["KL mean vs HF", "KL max vs HF", "agree vs HF", "diverges vs HF"]
    head.append("ms/token")
    body = []
    for r in data["worlds"]:
        line = [str(r["world"]), _num(r["ppl"], ".6g"), _num(r["kl_mean_world1"], ".2e"),
                _num(r["kl_max_world1"], ".2e"), _num(r["agree_world1"], ".4f"), _num(r["diverges_at_world1"], "d")]
        if cmp_hf:
            line += [_num(r["kl_mean_transformers"], ".2e"), _num(r["kl_max_transformers"], ".2e"),
                     _num(r["agree_transformers"], ".4f"), _num(r["diverges_at_transformers"], "d")]
        body.append(line + [_num(r["ms_per_token"], ".3f")])
    if cmp_hf:
        body.append(["HF", _num(hf["ppl"], ".6g")] + [""] * (len(head) - 3) + [_num(hf["ms_per_token"], ".3f")])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def header(data: dict) -> str:
    hf = data["transformers"]
    ref = (f"transformers {hf['version']} (float32, CPU)" if "skipped" not in hf else
           f"transformers: not compared ({hf['skipped']})")
    return (f"# parity of {data['checkpoint']} on {data['device']}: {data['tokens']} tokens of {data['token_source']}\n"
            f"# teacher forcing in {data['windows']} window(s) of {data['window']} tokens; greedy: {data['prompt']} "
            f"prompt + {data['new']} new tokens; KL(ref || world) in nats, float64; {ref}\n"
            f"# cpu: {data['env'].get('cpu', '?')}")


def _plot(data: dict, path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# --plot: matplotlib is not installed (pip install 'tpcore[bench]')", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, kl in data["kl_per_position"].items():
        if name != "world1_vs_world1":
            ax.semilogy(np.maximum(np.asarray(kl), 1e-20), label=name.replace("_vs_", " vs "), lw=0.8)
    ax.set_xlabel("position")
    ax.set_ylabel("KL (nats, floored at 1e-20)")
    ax.set_title(f"parity: {os.path.basename(data['checkpoint'].rstrip('/'))}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _one_line_errors(p: argparse.ArgumentParser) -> None:
    def error(message):
        print(f"parity: {message}", file=sys.stderr)
        sys.exit(2)
    p.error = error  # argparse's own errors (a bad int, an unknown option): one line, status 2


def _prepare(args) -> Tuple[List[int], np.ndarray, str, int, int, int]:
    """The checked arguments: worlds, ids, their label, window, prompt, new.  Raises ArgError."""
    worlds = _worlds(args.worlds)
    if args.max_tokens < 2:
        raise ArgError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    if args.prompt < 1 or args.new < 0:
        raise ArgError(f"--prompt must be >= 1 and --new >= 0, got {args.prompt} and {args.new}")
    if args.device not in ("cpu", "cuda"):
        raise ArgError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.text is not None and args.tokens is not None:
        raise ArgError("give --text or --tokens, not both")
    if not os.path.exists(args.checkpoint):
        raise ArgError(f"--checkpoint {args.checkpoint!r}: no such file or folder")
    try:
        cfg = checkpoint_config(args.checkpoint)
    except ArgError:
        raise
    except Exception as e:  # noqa: BLE001 - an unreadable or unsupported checkpoint, shown in one line
        raise ArgError(f"--checkpoint {args.checkpoint!r}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    if not cfg.causal:
        raise ArgError(f"--checkpoint {args.checkpoint!r}: a {cfg.model_type} encoder (bidirectional) has no "
                       f"next-token distribution; parity needs a decoder")
    text = None
    if args.text is not None:
        try:
            with open(args.text, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ArgError(f"--text {args.text!r}: {getattr(e, 'strerror', None) or e}") from None
    ids, source = text_tokens(args.checkpoint, cfg.vocab_size, text, args.tokens,
                              f"the text of {args.text}" if args.text else "the built-in text")
    if ids.size < 2:
        raise ArgError(f"the text has {ids.size} token(s); at least 2 are needed (a next token to predict)")
    ids = ids[:args.max_tokens]
    ctx = cfg.max_positions
    window = min(ctx, ids.size) if args.window is None else args.window
    if not 1 <= window <= ctx:
        raise ArgError(f"--window must be in [1, {ctx}] (the model's context), got {window}")
    prompt = min(args.prompt, ids.size)
    new = max(0, min(args.new, ctx - prompt))
    return worlds, ids, source, window, prompt, new


def cli(args) -> int:
    """python -m tpcore.bench parity: the table on stdout, --json and --plot files."""
    try:
        if not args.checkpoint:
            raise ArgError("--checkpoint is required")
        worlds, ids, source, window, prompt, new = _prepare(args)
    except ArgError as e:
        print(f"parity: {e}", file=sys.stderr)
        return 2
    data = run(args.checkpoint, worlds, ids, window, prompt, new, args.device, args.transformers, args.timeout,
               args.progress)
    data["token_source"] = source
    print(header(data))
    print(table(data))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)
        print(f"# wrote {args.json}")
    if args.plot and _plot(data, args.plot):
        print(f"# wrote {args.plot}")
    return 0 if all(r["diverges_at_world1"] is None for r in data["worlds"]) else 1
