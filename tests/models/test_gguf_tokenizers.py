"""The tokenizers embedded in GGUF files (tpcore.models.gguf.tokenizer, gguf_tokenizer): Llama 3's
byte-level BPE (tokenizer.ggml.pre "llama-bpe"), Qwen2's ("qwen2"), and the SentencePiece
vocabularies (tokenizer.ggml.model "llama") of Llama 2 / Mistral, Phi-3 and Gemma.

The vocabularies are trained here with the `tokenizers` package on a small multilingual
text and written to GGUF as llama.cpp's converter writes them (_set_vocab_gpt2: tokens,
merges, token types; _set_vocab_sentencepiece: tokens, scores, token types, <0xNN> byte
tokens, add_space_prefix).  The references, none of them tpcore's:
- byte-level BPE: the trained tokenizer itself, its pre-tokenizer the one of Llama 3's
  tokenizer.json (Split by Llama 3's regex, then ByteLevel); for qwen2 transformers'
  Qwen2Tokenizer built from the same vocabulary and merges (its own NFC and regex);
- SentencePiece: llama.cpp's algorithm (llm_tokenizer_spm: merge the adjacent pair whose
  concatenation is the best-scored token, leftmost first; bytes of unknown characters as
  <0xNN> tokens), written below in plain Python;
- and for all of them transformers' own GGUF tokenizer reader
  (AutoTokenizer.from_pretrained(gguf_file=...)), where its conventions are the same
  (the llama architecture's SentencePiece: transformers' LlamaTokenizer puts no extra "▁"
  before text that starts with a space, llama.cpp and tpcore do: those strings are left out).
"""
import pytest

from tpcore import CheckpointError
from tpcore.models import gguf as tg
import gguf_convert as gc

CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello, world! Hello there, how are you today?",
          "naïve café résumé façade — déjà vu", "한국어 텍스트입니다. 안녕하세요 세계", "emoji 🎉🚀 party time 🎉",
          "digits 1234567 and 3.14159 and 2026", "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
          "tabs\tand\nnewlines\n\n  indented   spaces", "it's we're they'll I'm you've she'd",
          "日本語 and English mixed テキスト", "Straße ÀÉÎÕÜ ßø æ"] * 4
TEXTS = ["Hello, world!", "  leading and   multiple   spaces", "naïve café résumé", "한국어 텍스트입니다",
         "emoji 🎉🚀 time", "digits 1234567 and 3.14159", "def f(x):\n    return x**2  # code",
         "tabs\tand\nnewlines\n\n", "ÀÉÎÕÜ ßø Ωmega", "mixed 日本語 and English", "it's we're they'll",
         "trailing space ", "unseen: ж Ψ 🐍 ☃", "x", "xyz xyzzy", "9xyz —xyz"]


def _train_byte_level(split):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=500, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       special_tokens=["<|begin_of_text|>", "<|end_of_text|>"]))
    return tk


def _vocab_merges(tk):
    import json
    m = json.loads(tk.to_str())["model"]
    vocab = sorted(m["vocab"].items(), key=lambda kv: kv[1])
    assert [i for _, i in vocab] == list(range(len(vocab)))
    merges = [" ".join(x) if isinstance(x, list) else x for x in m["merges"]]
    return [t for t, _ in vocab], merges


def _model_file(tmp_path, family, n_tokens, write_tokenizer, name="m.gguf"):
    model, cfg = gc.hf_model(family, vocab_size=n_tokens, num_hidden_layers=1 if family != "gemma3" else 6)
    path = str(tmp_path / name)
    gc.write_gguf(path, family, model, cfg, tokenizer=write_tokenizer)
    return path


def _write_bpe(tokens, merges, pre, control):
    def write(w):
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_string("tokenizer.ggml.pre", pre)
        w.add_array("tokenizer.ggml.tokens", tokens)
        w.add_array("tokenizer.ggml.token_type", [3 if t in control else 1 for t in tokens])
        w.add_array("tokenizer.ggml.merges", merges)
        w.add_uint32("tokenizer.ggml.bos_token_id", 0)
        w.add_uint32("tokenizer.ggml.eos_token_id", 1)
        w.add_bool("tokenizer.ggml.add_bos_token", True)
    return write


def _transformers_gguf(path):
    import os
    import transformers as T
    return T.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_llama3_bpe(tmp_path):
    """llama-bpe: ids equal the trained tokenizer's (Llama 3's pre-tokenizer) and
    transformers' GGUF reader's; control tokens whole; BOS as the file says; decode."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    from tpcore.models.gguf_tokenizer import LLAMA3_SPLIT
    ref = _train_byte_level(GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"])
    tokens, merges = _vocab_merges(ref)
    path = _model_file(tmp_path, "llama3", len(tokens),
                       _write_bpe(tokens, merges, "llama-bpe", {"<|begin_of_text|>", "<|end_of_text|>"}))
    tk = tg.tokenizer(path)
    theirs = _transformers_gguf(path)
    assert LLAMA3_SPLIT == GGUF_PRE_TOKENIZER_SPLITS["llama-bpe"]
    for text in TEXTS + ["<|end_of_text|>after"]:
        ids = tk.encode(text).ids
        assert ids == ref.encode(text).ids, text
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert tk.decode(ids, skip_special_tokens=False) == text
    assert tk.encode("<|end_of_text|>x").ids[0] == 1
    assert tg.tokenizer(path, add_bos=None).encode("hi").ids == [0] + tk.encode("hi").ids
    # digits in threes (Llama 3), not one by one (Qwen2)
    assert [len(ref.decode([i])) for i in tk.encode("1234567").ids] == [3, 3, 1]


def test_qwen2_bpe(tmp_path):
    """qwen2: ids equal transformers' Qwen2Tokenizer built from the same vocabulary and
    merges (NFC, its regex) and transformers' GGUF reader's (on NFC text)."""
    import unicodedata
    import transformers as T
    ref = _train_byte_level(T.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX)
    tokens, merges = _vocab_merges(ref)
    path = _model_file(tmp_path, "qwen2", len(tokens), _write_bpe(tokens, merges, "qwen2", set()))
    tk = tg.tokenizer(path)
    qwen = T.Qwen2Tokenizer(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    theirs = _transformers_gguf(path)
    for text in TEXTS + ["cafe\u0301 decomposed"]:
        ids = tk.encode(text).ids
        assert ids == qwen.encode(text, add_special_tokens=False), text
        if unicodedata.is_normalized("NFC", text):
            assert ids == theirs.encode(text, add_special_tokens=False), text
    assert [len(ref.decode([i])) for i in tk.encode("1234567").ids] == [1] * 7


# ------------------------------------------------------------------------- SentencePiece
def _spm_vocab(gemma):
    """A SentencePiece BPE vocabulary as llama.cpp's converter writes it: (tokens, scores,
    types): the specials, the 256 <0xNN> byte tokens, then the pieces best first."""
    from tokenizers import SentencePieceBPETokenizer
    sp = SentencePieceBPETokenizer(add_prefix_space=not gemma)
    sp.train_from_iterator(CORPUS, vocab_size=420, show_progress=False, special_tokens=[])
    pieces = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1])]
    # two overlapping pieces first: "xyz" is x + yz by the scores, xy + z the other way round
    pieces = ["yz", "xy"] + [t for t in pieces if t not in ("yz", "xy")]
    if gemma:
        pieces.append("  ")              # a whitespace token, stored with spaces (Gemma's files)
    specials = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2)] if gemma else \
        [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [ty for _, ty in specials] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    return tokens, scores, types


def _write_spm(tokens, scores, types, gemma):
    def write(w):
        w.add_string("tokenizer.ggml.model", "llama")
        w.add_string("tokenizer.ggml.pre", "default")
        w.add_array("tokenizer.ggml.tokens", tokens)
        w.add_array("tokenizer.ggml.scores", scores)
        w.add_array("tokenizer.ggml.token_type", types)
        w.add_uint32("tokenizer.ggml.bos_token_id", 2 if gemma else 1)
        w.add_uint32("tokenizer.ggml.eos_token_id", 1 if gemma else 2)
        w.add_uint32("tokenizer.ggml.unknown_token_id", 3 if gemma else 0)
        w.add_uint32("tokenizer.ggml.padding_token_id", 0)
        w.add_bool("tokenizer.ggml.add_space_prefix", not gemma)
    return write


def llamacpp_spm(text, tokens, scores, types, prefix):
    """llama.cpp's llm_tokenizer_spm, in plain Python: the text's spaces as "▁" (one put
    first when prefix), split in characters; while an adjacent pair's concatenation is a
    token, merge the pair whose token scores best (the leftmost of equals); a symbol that
    is no token becomes its UTF-8 bytes' <0xNN> tokens."""
    vocab = {}
    for i, t in enumerate(tokens):
        if types[i] in (1, 4):
            vocab.setdefault(t.replace(" ", "\u2581") if " " in t and not t.strip() else t, i)
    s = ("\u2581" if prefix else "") + text.replace(" ", "\u2581")
    sym = list(s)
    while True:
        best = None
        for j in range(len(sym) - 1):
            t = vocab.get(sym[j] + sym[j + 1])
            if t is not None and (best is None or scores[t] > scores[best[1]]):
                best = (j, t)
        if best is None:
            break
        j = best[0]
        sym[j:j + 2] = [sym[j] + sym[j + 1]]
    out = []
    for x in sym:
        out += [vocab[x]] if x in vocab else [tokens.index(f"<0x{b:02X}>") for b in x.encode()]
    return out


@pytest.mark.parametrize("family", ["mistral", "phi3", "gemma2"])
def test_sentencepiece(tmp_path, family):
    """SentencePiece vocabularies (Llama 2 / Mistral, Phi-3 with the space prefix; Gemma
    without it and with a whitespace token stored with spaces): ids equal llama.cpp's
    algorithm and transformers' GGUF reader; unknown characters as their bytes; decode."""
    gemma = family.startswith("gemma")
    tokens, scores, types = _spm_vocab(gemma)
    path = _model_file(tmp_path, family, len(tokens), _write_spm(tokens, scores, types, gemma))
    tk = tg.tokenizer(path)
    theirs = _transformers_gguf(path)
    for text in TEXTS:
        ids = tk.encode(text).ids
        assert ids == llamacpp_spm(text, tokens, scores, types, not gemma), text
        if family != "mistral" or not text.startswith(" "):
            assert ids == theirs.encode(text, add_special_tokens=False), text
        assert tk.decode(ids) == text, text
    assert any(tokens[i].startswith("<0x") for i in tk.encode("ж 🐍").ids)      # byte fallback used
    if gemma:   # the whitespace token stored with spaces matches the text's spaces
        assert tokens.index("  ") in tk.encode("x   ").ids
    bos = 2 if gemma else 1
    assert tg.tokenizer(path, add_bos=None).encode("hi").ids == [bos] + tk.encode("hi").ids
    assert tk.encode("<s>" if not gemma else "<bos>").ids == [bos]


def test_refused_vocabularies(tmp_path):
    """Another vocabulary kind or pre-tokenizer is refused by name with the supported ones."""
    tokens, scores, types = _spm_vocab(False)

    def write(model=None, pre=None, scores_=scores):
        def w(wr):
            _write_spm(tokens, scores_, types, False)(wr) if model is None else None
            if model is not None:
                wr.add_string("tokenizer.ggml.model", model)
                wr.add_string("tokenizer.ggml.pre", pre or "default")
                wr.add_array("tokenizer.ggml.tokens", tokens)
        return w
    cases = [("bert", None, "'tokenizer.ggml.model'", "'gpt2' (byte-level BPE) or 'llama'"),
             ("gpt2", "tekken", "'tokenizer.ggml.pre'", "llama-bpe")]
    for i, (model, pre, key, words) in enumerate(cases):
        path = _model_file(tmp_path, "mistral", len(tokens), write(model, pre), name=f"r{i}.gguf")
        with pytest.raises(CheckpointError) as e:
            tg.tokenizer(path)
        assert key in str(e.value) and words in str(e.value), str(e.value)
    path = _model_file(tmp_path, "mistral", len(tokens), write(scores_=scores[:-1]), name="short.gguf")
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores"):
        tg.tokenizer(path)
    with pytest.raises(TypeError, match="add_bos"):
        tg.tokenizer(path, add_bos="yes")
