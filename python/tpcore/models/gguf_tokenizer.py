"""The tokenizer embedded in a GGUF file as a `tokenizers.Tokenizer` (`tpcore.models.gguf.tokenizer`).

Two kinds of vocabulary, as llama.cpp's converter writes them (tokenizer.ggml.model):

- "gpt2": byte-level BPE, tokens and merges in the file; the text split first by the
  pre-tokenizer tokenizer.ggml.pre names: "default"/"gpt2" (GPT-2's regex), "smollm"
  (digits one by one, then GPT-2's), "llama-bpe" (Llama 3's regex: numbers in runs of
  up to 3 digits), "qwen2" (Qwen2's: digits one by one; NFC-normalized first, as Qwen2's
  own tokenizer does).
- "llama": SentencePiece BPE (Llama 2, Mistral v0.1, Phi-3, Gemma): tokens and scores,
  no merges: the merges are rebuilt from the vocabulary (every split of a token into two
  tokens, ranked by the merged token's score; Gemma: by its position, as transformers'
  Gemma GGUF reader ranks them), spaces written "▁", a "▁" put before the text when
  tokenizer.ggml.add_space_prefix (default true; Gemma's files say false), bytes the
  vocabulary lacks as its <0xNN> tokens (byte fallback).  Gemma's whitespace-only tokens,
  stored with real spaces, are respelled with "▁" (the text's spaces are).

Control tokens (type 3: <|im_start|>, <start_of_turn>...) are special tokens and
user-defined ones (type 4: <think>...) added tokens, both matched whole in the text.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from tpcore.io.formats import bad

__all__ = ["build", "PRE_TOKENIZERS", "LLAMA3_SPLIT", "QWEN2_SPLIT"]

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre of byte-level BPE files -> (split regex or None: GPT-2's, digits one by one first, NFC)
_BPE_PRE = {"default": (None, False, False), "gpt2": (None, False, False), "smollm": (None, True, False),
            "llama-bpe": (LLAMA3_SPLIT, False, False), "llama3": (LLAMA3_SPLIT, False, False),
            "llama-v3": (LLAMA3_SPLIT, False, False), "qwen2": (QWEN2_SPLIT, False, True)}
PRE_TOKENIZERS = tuple(_BPE_PRE)
_MODELS = ("gpt2", "llama")
_CONTROL, _USER, _BYTE, _UNKNOWN = 3, 4, 6, 2


def _spm_merges(tokens: List[str], types: List[int], rank) -> List[Tuple[str, str]]:
    """SentencePiece BPE's merges from its vocabulary: every split of a normal token into
    two tokens of the vocabulary, best merged token first (rank(id): smaller is better),
    then by the left and right tokens' ids."""
    ids = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    found = []
    for i, t in enumerate(tokens):
        if types[i] in (_CONTROL, _BYTE, _UNKNOWN) or ids[t] != i:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            ia, ib = ids.get(a), ids.get(b)
            if ia is not None and ib is not None:
                found.append((rank[i], ia, ib, a, b))
    found.sort()
    return [(a, b) for _, _, _, a, b in found]


def _special(tk, tokens, types) -> None:
    from tokenizers import AddedToken
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    if special:
        tk.add_special_tokens(special)
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER]
    if user:
        tk.add_tokens(user)


def _byte_level(path, m, tokens, types):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    pre = m.str("tokenizer.ggml.pre", "default")
    if pre not in _BPE_PRE:
        raise bad(path, "metadata key 'tokenizer.ggml.pre'", f"one of {', '.join(_BPE_PRE)} (byte-level BPE)", pre)
    merges = m.strings("tokenizer.ggml.merges")
    pairs = []
    for i, mg in enumerate(merges):
        a, sep, b = mg.partition(" ")
        if not sep or not a or not b:
            raise bad(path, f"metadata key 'tokenizer.ggml.merges' entry {i}", "two tokens separated by a space", mg)
        pairs.append((a, b))
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split, digits, nfc = _BPE_PRE[pre]
    if split is None:
        byte = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte]) \
            if digits else byte
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                             use_regex=False)])
    if nfc:
        tk.normalizer = normalizers.NFC()
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece(path, m, arch, tokens, types):
    from tokenizers import Tokenizer, decoders, models, normalizers
    pre = m.str("tokenizer.ggml.pre", "default")
    if pre != "default":
        raise bad(path, "metadata key 'tokenizer.ggml.pre'", "'default' (a SentencePiece vocabulary)", pre)
    n = len(tokens)
    gemma = arch.startswith("gemma")
    if gemma:   # whitespace-only tokens are stored with spaces; the text's spaces become "▁"
        tokens = [t.replace(" ", "\u2581") if " " in t and not t.strip() else t for t in tokens]
        rank = list(range(n))
    else:
        scores = m.floats("tokenizer.ggml.scores")
        if len(scores) != n:
            raise bad(path, "metadata key 'tokenizer.ggml.scores'", f"{n} entries (one per token)", len(scores))
        rank = [(-s, i) for i, s in enumerate(scores)]
    unk = m.int("tokenizer.ggml.unknown_token_id", None, lo=0)
    if unk is not None and unk >= n:
        raise bad(path, "metadata key 'tokenizer.ggml.unknown_token_id'", f"a token id < {n}", unk)
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, types, rank), fuse_unk=True,
                              byte_fallback=True, unk_token=None if unk is None else tokens[unk]))
    prefix = m.bool("tokenizer.ggml.add_space_prefix", True)
    space = normalizers.Replace(" ", "\u2581")
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), space]) if prefix else space
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk, tokens


def build(g, m, add_bos: Optional[bool] = False):
    """The `tokenizers.Tokenizer` of GGUFModel g (m: its metadata, a gguf_arch.Meta).
    add_bos: True / False, or None: as tokenizer.ggml.add_bos_token says (absent: true
    for a SentencePiece vocabulary, false for byte-level BPE, as llama.cpp)."""
    try:
        from tokenizers import processors
    except ImportError as e:
        raise ImportError("tpcore.models.gguf.tokenizer needs the `tokenizers` package: pip install tokenizers") from e
    if add_bos is not None and not isinstance(add_bos, bool):
        raise TypeError(f"tokenizer: add_bos must be True, False or None (as the file says), got {add_bos!r}")
    kind = m.str("tokenizer.ggml.model")
    if kind not in _MODELS:
        raise bad(g.path, "metadata key 'tokenizer.ggml.model'",
                  "'gpt2' (byte-level BPE) or 'llama' (SentencePiece BPE; others are not supported)", kind)
    tokens = m.strings("tokenizer.ggml.tokens")
    types = m.ints("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(types) != len(tokens):
        raise bad(g.path, "metadata key 'tokenizer.ggml.token_type'", f"{len(tokens)} entries", len(types))
    if kind == "gpt2":
        tk = _byte_level(g.path, m, tokens, types)
    else:
        tk, tokens = _sentencepiece(g.path, m, g.arch, tokens, types)
    _special(tk, tokens, types)
    if add_bos is None:
        add_bos = m.bool("tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos:
        bos = m.int("tokenizer.ggml.bos_token_id", lo=0)
        if bos >= len(tokens):
            raise bad(g.path, "metadata key 'tokenizer.ggml.bos_token_id'", f"a token id < {len(tokens)}", bos)
        t = tokens[bos]
        tk.post_processor = processors.TemplateProcessing(single=f"{t}:0 $A:0", pair=f"{t}:0 $A:0 {t}:1 $B:1",
                                                          special_tokens=[(t, bos)])
    return tk
