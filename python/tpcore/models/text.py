"""Text in, text out: a model's tokenizer, streaming detokenization and stop strings.

    tok = tpcore.models.text.load_tokenizer(path)      # a .gguf file or a safetensors folder
    ids = tok.encode("Hello")                           # as transformers' AutoTokenizer / llama.cpp
    tok.decode(ids)
    det = IncrementalDetokenizer(tok, prompt_ids)       # det.push(id) -> the new text only
    stops = StopMatcher(["\\n\\nUser:"])                 # stops.push(text) -> (emit, stopped)

`Tokenizer` wraps a `tokenizers.Tokenizer` with what a chat needs beside it: the BOS / EOS
tokens, the ids generation stops on (generation_config.json's too), the chat template.  A
GGUF file's comes from its metadata (`tpcore.models.gguf.tokenizer`); a safetensors folder's
from tokenizer.json, tokenizer_config.json (special tokens, add_bos_token / add_eos_token,
chat_template), chat_template.jinja / chat_template.json (as transformers 5 saves the
template) and generation_config.json (eos ids).  `load_tokenizer(path, lazy=True)` reads
nothing until the tokenizer is first used (the models' loaders set `TransformerLM.tokenizer`
so); a file that cannot be read is then an error naming it, at every use.

`IncrementalDetokenizer` is the prefix / read-offset scheme of vLLM's and TGI's
detokenizers: each new token's text is the decode of a short window of tokens (from the
prefix offset) minus the decode of the window without the new tokens (to the read offset),
so SentencePiece's word-leading spaces come out right, and text whose decode ends in U+FFFD
(a UTF-8 character not complete yet: byte tokens, byte-level BPE) is held back until the
character is.  `StopMatcher` holds back any suffix of the text that could begin a stop
string, so a stop string split over tokens is never sent, and cuts the text where one ends.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from tpcore.io.checks import CheckpointError, bad, parse_json, read_json_object, regular_file, type_name
from tpcore.utils.args import is_int, shown

__all__ = ["Tokenizer", "load_tokenizer", "has_tokenizer", "IncrementalDetokenizer", "StopMatcher"]

_JSON_MAX = 512 << 20        # tokenizer.json of a 256k vocabulary is ~35 MB
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class Tokenizer:
    """A model's tokenizer: a `tokenizers.Tokenizer` and its special tokens and chat template.

    Parameters
    ----------
    backend : tokenizers.Tokenizer
        The tokenizer (normalizer, pre-tokenizer, model, post-processor, decoder).
    bos_token, eos_token, pad_token, unk_token : str, optional
        The special tokens' text (the chat template sees them as bos_token, eos_token, ...).
    chat_template : str, optional
        The Jinja chat template (`render_chat`).
    eos_token_ids : list of int, optional
        The ids generation stops on (default: eos_token's id).
    source : str, optional
        Where it was read (for messages).

    Attributes
    ----------
    bos_token_id, eos_token_id : int or None
        The ids of bos_token / eos_token (None when absent or not in the vocabulary).
    vocab_size : int
        The backend's vocabulary size, added tokens included.
    """

    def __init__(self, backend: Any, *, bos_token: Optional[str] = None, eos_token: Optional[str] = None,
                 pad_token: Optional[str] = None, unk_token: Optional[str] = None,
                 chat_template: Optional[str] = None, eos_token_ids: Optional[Sequence[int]] = None,
                 source: Optional[str] = None) -> None:
        try:
            import tokenizers
        except ImportError as e:
            raise ImportError("tpcore's text functions need the `tokenizers` package: pip install tokenizers") from e
        if not isinstance(backend, tokenizers.Tokenizer):
            raise TypeError(f"Tokenizer: backend must be a tokenizers.Tokenizer, got {shown(backend)}")
        for name, v in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token),
                        ("unk_token", unk_token), ("chat_template", chat_template), ("source", source)):
            if v is not None and not isinstance(v, str):
                raise TypeError(f"Tokenizer: {name} must be a str or None, got {shown(v)}")
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self.chat_template = chat_template
        self.source = source
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        self.eos_token_id = None if eos_token is None else backend.token_to_id(eos_token)
        ids = [] if eos_token_ids is None else list(eos_token_ids)
        if not all(is_int(i) and 0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"Tokenizer: eos_token_ids must be token ids in [0, {self.vocab_size}), got {ids!r}")
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids.append(self.eos_token_id)
        self.eos_token_ids = [int(i) for i in ids]

    def __repr__(self) -> str:
        return (f"Tokenizer({self.source or 'in memory'}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, chat_template={'yes' if self.chat_template else 'no'})")

    @property
    def special_tokens_map(self) -> Dict[str, str]:
        """The special tokens by name (bos_token, eos_token, unk_token, pad_token; those set), as
        transformers gives a chat template."""
        return {k: getattr(self, k) for k in _SPECIAL if getattr(self, k) is not None}

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """The token ids of text.

        Parameters
        ----------
        text : str
            The text; special tokens written in it (``<|im_start|>``) are parsed as such.
        add_special_tokens : bool, default True
            Add what the tokenizer adds around a text (a BOS token, for some).

        Returns
        -------
        list of int
        """
        if not isinstance(text, str):
            raise TypeError(f"encode: text must be a str, got {shown(text)}")
        if not isinstance(add_special_tokens, bool):
            raise TypeError(f"encode: add_special_tokens must be a bool, got {shown(add_special_tokens)}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids.

        Parameters
        ----------
        ids : sequence of int
            Token ids in [0, vocab_size).
        skip_special_tokens : bool, default True
            Leave special tokens (BOS, EOS, ``<|im_end|>``) out of the text.

        Returns
        -------
        str
        """
        ids = _ids_arg(ids, self.vocab_size, "decode")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str:
        """The vocabulary entry of token_id (its raw form: "Ġthe", "▁the", "<0x0A>").

        Parameters
        ----------
        token_id : int
            In [0, vocab_size).
        """
        (i,) = _ids_arg([token_id], self.vocab_size, "token")
        return self.backend.id_to_token(i)

    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True,
                            chat_template: Optional[str] = None, **kwargs: Any) -> str:
        """The prompt text of a conversation through the chat template (`render_chat`), the
        special tokens given to it as transformers gives them.

        Parameters
        ----------
        messages : list of dict
            The conversation: {"role": ..., "content": ...} each.
        add_generation_prompt : bool, default True
            End with the header of the assistant's turn.
        chat_template : str, optional
            Another template than the tokenizer's.
        **kwargs
            More variables for the template (tools, documents, ...).

        Raises
        ------
        ValueError
            No chat template (the message names ``--chat-template``), or the template
            raised (raise_exception) or failed.
        """
        from tpcore.models.chat_template import render_chat
        template = self.chat_template if chat_template is None else chat_template
        return render_chat(template, messages, add_generation_prompt, **{**self.special_tokens_map, **kwargs})

    def encode_chat(self, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> List[int]:
        """The prompt ids of a conversation: `apply_chat_template`'s text encoded with no special
        tokens added (the template writes them), as transformers' apply_chat_template(tokenize=True).

        Parameters
        ----------
        messages : list of dict
            The conversation.
        add_generation_prompt : bool, default True
            End with the header of the assistant's turn.
        **kwargs
            As `apply_chat_template`.
        """
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


class _LazyTokenizer(Tokenizer):
    """A Tokenizer read from its files at its first use (load_tokenizer(lazy=True)); a failure
    is raised again at every use."""

    def __init__(self, source: str, load: Callable[[], Tokenizer]) -> None:  # no super(): read at first use
        object.__setattr__(self, "_lazy", (source, load, None))

    def _fill(self) -> None:
        source, load, err = self.__dict__["_lazy"]
        if err is None:
            try:
                tk = load()
            except Exception as e:  # noqa: BLE001 (each kept and raised again, named)
                err = e if source in str(e) else ValueError(f"{source}: the tokenizer cannot be read: "
                                                            f"{type(e).__name__}: {e}")
                if err is not e:
                    err.__cause__ = e
                object.__setattr__(self, "_lazy", (source, load, err))
            else:
                self.__dict__.update(tk.__dict__)
                self.__dict__["_lazy"] = None
                return
        raise err

    def __getattr__(self, name: str) -> Any:   # only for attributes not set yet: the loaded ones
        if name.startswith("__") or self.__dict__.get("_lazy") is None:
            raise AttributeError(name)
        self._fill()
        return getattr(self, name)

    def __repr__(self) -> str:
        lazy = self.__dict__.get("_lazy")
        return f"Tokenizer({lazy[0]}, not read yet)" if lazy else super().__repr__()


def _ids_arg(ids, n: int, who: str) -> List[int]:
    try:
        out = [int(i) for i in ids] if all(is_int(i) for i in ids) else None
    except TypeError:
        out = None
    if out is None:
        raise TypeError(f"{who}: ids must be a sequence of integer token ids, got {shown(ids)}")
    for i in out:
        if not 0 <= i < n:
            raise ValueError(f"{who}: token id {i} is out of range [0, vocab_size={n})")
    return out


# ------------------------------------------------------------------------- loading
def has_tokenizer(path) -> bool:
    """Whether a checkpoint carries a tokenizer: a .gguf file with tokenizer.ggml.model in its
    metadata (tokenizer_info), a folder with tokenizer.json."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, "tokenizer.json"))
    from tpcore.models.gguf import GGUFModel
    return GGUFModel(path, "load_tokenizer").tokenizer_info.get("model") is not None


def load_tokenizer(path, lazy: bool = False) -> Tokenizer:
    """The tokenizer of a checkpoint: a .gguf file's embedded one, or a safetensors folder's.

    Parameters
    ----------
    path : str or os.PathLike
        A .gguf file, or a folder with tokenizer.json (and tokenizer_config.json,
        chat_template.jinja / chat_template.json, generation_config.json when present).
    lazy : bool, default False
        Read the files at the first use instead of now.

    Returns
    -------
    Tokenizer

    Raises
    ------
    TypeError
        path not a str or os.PathLike.
    FileNotFoundError
        No such file or folder, or a folder without tokenizer.json.
    CheckpointError
        A file that cannot be read (named, with the field).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_tokenizer: path must be a .gguf file or a folder (str or os.PathLike), got "
                        f"{shown(path)}")
    path = os.fspath(path)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise FileNotFoundError(f"load_tokenizer: {path} has no tokenizer.json")
        load = _folder_loader(path)
    elif os.path.isfile(path):
        load = _gguf_loader(path)
    else:
        raise FileNotFoundError(f"load_tokenizer: {path} is neither a .gguf file nor a folder")
    return _LazyTokenizer(path, load) if lazy else load()


def _gguf_loader(path: str) -> Callable[[], Tokenizer]:
    def load() -> Tokenizer:
        from tpcore.models.gguf import GGUFModel, tokenizer
        g = GGUFModel(path, "load_tokenizer")
        info = g.tokenizer_info
        if info.get("model") is None:
            raise bad(path, "metadata key 'tokenizer.ggml.model'", "a tokenizer in the file", "none")
        backend = tokenizer(g, add_bos=None)
        names = {}
        for k in ("bos", "eos", "unknown", "padding"):
            i = info.get(f"{k}_token_id")
            names[k] = None if i is None else backend.id_to_token(i)
        eos = [info["eos_token_id"]] if info.get("eos_token_id") is not None else []
        return Tokenizer(backend, bos_token=names["bos"], eos_token=names["eos"], unk_token=names["unknown"],
                         pad_token=names["padding"], chat_template=info.get("chat_template"), eos_token_ids=eos,
                         source=path)
    return load


def _token_text(cfg: dict, key: str, p: str) -> Optional[str]:
    """A special token of tokenizer_config.json: a string, an AddedToken dict {"content": ...},
    or null."""
    v = cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    if v is not None and not isinstance(v, str):
        raise bad(p, key, "a string, an AddedToken object or null", type_name(v))
    return v


def _chat_template(folder: str, cfg: dict, p: str) -> Optional[str]:
    """The chat template: chat_template.jinja, else chat_template.json's "chat_template", else
    tokenizer_config.json's (a string, or a list of named ones: "default"), as transformers."""
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):
        size = regular_file(jinja)
        if size > 16 << 20:
            raise bad(jinja, "file size", "at most 16 MiB", f"{size} bytes")
        with open(jinja, "rb") as f:
            raw = f.read(size + 1)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise bad(jinja, "text", "UTF-8", f"an invalid byte at offset {e.start}") from e
    js = os.path.join(folder, "chat_template.json")
    if os.path.isfile(js):
        cfg, p = read_json_object(js), js
    v = cfg.get("chat_template")
    if isinstance(v, list):
        named = {d.get("name"): d.get("template") for d in v if isinstance(d, dict)}
        if "default" not in named:
            raise bad(p, "chat_template", "a string or a list of {name, template} holding 'default'",
                      f"the names {sorted(map(str, named))}")
        v = named["default"]
    if v is not None and not isinstance(v, str):
        raise bad(p, "chat_template", "a string, a list of {name, template} or null", type_name(v))
    return v


def _folder_loader(folder: str) -> Callable[[], Tokenizer]:
    def load() -> Tokenizer:
        from tokenizers import AddedToken, Tokenizer as Backend
        tj = os.path.join(folder, "tokenizer.json")
        size = regular_file(tj)
        if size > _JSON_MAX:
            raise bad(tj, "file size", f"at most {_JSON_MAX} bytes", f"{size} bytes")
        with open(tj, "rb") as f:
            raw = f.read(size + 1)
        parse_json(raw, tj)    # a JSON error named with its line, before the Rust parser's message
        try:
            backend = Backend.from_str(raw.decode("utf-8"))
        except Exception as e:
            raise CheckpointError(f"{tj}: not a tokenizers file: {e}", path=tj) from e
        tc = os.path.join(folder, "tokenizer_config.json")
        cfg = read_json_object(tc) if os.path.isfile(tc) else {}
        names = {k: _token_text(cfg, k, tc) for k in _SPECIAL}
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [AddedToken(t, special=True) for t in dict.fromkeys(names.values())
                   if t is not None and t not in added and backend.token_to_id(t) is None]
        if missing:     # transformers adds the special tokens the file lacks
            backend.add_special_tokens(missing)
        _llama_class(backend, cfg, tc)
        _post_processor(backend, cfg, names, tc)
        from tpcore.io.formats import read_generation_config
        eos = read_generation_config(folder).get("eos_token_id")
        eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
        n = backend.get_vocab_size(with_added_tokens=True)
        return Tokenizer(backend, **names, chat_template=_chat_template(folder, cfg, tc),
                         eos_token_ids=[i for i in eos if i < n], source=folder)
    return load


def _llama_class(backend, cfg: dict, p: str) -> None:
    """transformers 5's LlamaTokenizer (tokenizer_class "LlamaTokenizer[Fast]": Llama 2, Mistral,
    Phi-3) keeps tokenizer.json's vocabulary and merges but makes its own pipeline: no normalizer,
    a Metaspace pre-tokenizer putting "▁" before the first piece only (legacy false, the class's
    default; before every piece with legacy true; none with add_prefix_space false), the decoder
    to match.  tokenizer.json's own (a Prepend normalizer) put a "▁" after every special token
    too.  A byte-level tokenizer.json under that class name is kept as it is (so does transformers)."""
    from tokenizers import decoders, pre_tokenizers
    cls = cfg.get("tokenizer_class")
    if not isinstance(cls, str) or cls.removesuffix("Fast") != "LlamaTokenizer" or \
            "ByteLevel" in repr(backend.pre_tokenizer) + repr(backend.decoder):
        return
    flags = {}
    for k, default in (("legacy", False), ("add_prefix_space", True)):
        v = cfg.get(k)
        if v is not None and not isinstance(v, bool):
            raise bad(p, k, "true, false or null", type_name(v))
        flags[k] = default if v is None else v
    prefix = flags["add_prefix_space"]
    scheme = ("always" if flags["legacy"] else "first") if prefix else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if prefix else []))


def _post_processor(backend, cfg: dict, names: dict, p: str) -> None:
    """transformers' TokenizersBackend: add_bos_token / add_eos_token set in tokenizer_config.json
    (or a tokenizer.json without a post-processor) make the post-processor anew: BOS before,
    EOS after the text."""
    from tokenizers import processors
    flags = {}
    for k in ("add_bos_token", "add_eos_token"):
        v = cfg.get(k, False)
        if not isinstance(v, bool):
            raise bad(p, k, "true or false", type_name(v))
        flags[k] = v
    if not ("add_bos_token" in cfg or "add_eos_token" in cfg or backend.post_processor is None):
        return
    bos, eos = names["bos_token"], names["eos_token"]
    add_bos, add_eos = flags["add_bos_token"] and bos is not None, flags["add_eos_token"] and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special = ([(bos, backend.token_to_id(bos))] if add_bos else []) + \
        ([(eos, backend.token_to_id(eos))] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# ------------------------------------------------------------------------- streaming
class IncrementalDetokenizer:
    """A request's output text, token by token (vLLM's / TGI's prefix and read offsets).

    Parameters
    ----------
    tokenizer : Tokenizer
        The model's tokenizer.
    prompt_ids : sequence of int, optional
        The prompt: its last tokens are the first window's context (a word-leading space
        of the first new token is then kept, as in the whole text's decode).
    skip_special_tokens : bool, default True
        Leave special tokens out of the text.

    Notes
    -----
    The pushed pieces, joined, with `flush`'s, equal ``tokenizer.decode(new ids)`` (without
    prompt) or the text the new ids add to the prompt's decode (a character the prompt's last
    tokens begin comes out whole in the first piece).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Optional[Sequence[int]] = None,
                 skip_special_tokens: bool = True) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"IncrementalDetokenizer: tokenizer must be a tpcore Tokenizer, got {shown(tokenizer)}")
        prompt = [] if prompt_ids is None else _ids_arg(prompt_ids, tokenizer.vocab_size, "IncrementalDetokenizer")
        self.tokenizer, self.skip = tokenizer, bool(skip_special_tokens)
        k = min(16, len(prompt))    # the context: a few tokens are enough to decode a word, if it does not
        while k < min(len(prompt), 256) and \
                tokenizer.backend.decode(prompt[-k:], skip_special_tokens=self.skip).startswith("\ufffd"):
            k += 1                  # begin inside a character (a run of byte tokens would decode as U+FFFD)
        self.ids: List[int] = prompt[len(prompt) - k:]
        self.read = len(self.ids)
        self.prefix = self._clean(max(self.read - 5, 0), 0)
        self._fresh = bool(self.ids)    # nothing emitted after the prompt yet

    def _decode(self, ids: List[int]) -> str:
        return self.tokenizer.backend.decode(ids, skip_special_tokens=self.skip)

    def _clean(self, start: int, lo: int) -> int:
        """The window's new start: start, or before it while the window's text would begin inside
        a character (U+FFFD first: in a run of byte tokens the ByteFallback decoder makes every
        byte of the run U+FFFD when one is, so a window must not cut a character), down to lo."""
        while start > lo and self._decode(self.ids[start:]).startswith("\ufffd"):
            start -= 1
        return start

    def push(self, token_id: int) -> str:
        """The text token_id adds ("" while a UTF-8 character is incomplete).

        Parameters
        ----------
        token_id : int
            The next generated token.
        """
        if not is_int(token_id) or not 0 <= token_id < self.tokenizer.vocab_size:
            raise ValueError(f"IncrementalDetokenizer.push: token_id must be an id in [0, "
                             f"{self.tokenizer.vocab_size}), got {shown(token_id)}")
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix:self.read])
        if self._fresh:     # a prompt that ends inside a character: the character comes out whole
            before = before.rstrip("\ufffd")
        text = self._decode(self.ids[self.prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read, self._fresh = self._clean(self.read, self.prefix), len(self.ids), False
        if self.prefix > 64:    # keep the window's list short
            drop = self.prefix - 8
            del self.ids[:drop]
            self.prefix -= drop
            self.read -= drop
        return text[len(before):]

    def flush(self) -> str:
        """What is held back at the end (an incomplete character, as U+FFFD)."""
        before = self._decode(self.ids[self.prefix:self.read])
        if self._fresh:
            before = before.rstrip("\ufffd")
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        self._fresh = False
        return text[len(before):] if len(text) > len(before) else ""


class StopMatcher:
    """Stop strings found across token boundaries in streamed text.

    Parameters
    ----------
    stops : list of str
        The stop strings (non-empty); the text ends before the first one completed in the
        stream (of two ending at the same character, the longer), which is not emitted.

    Notes
    -----
    `push` holds back the longest suffix of the text seen that could begin a stop string,
    emitting it later when the text goes elsewhere (or at `flush`).
    """

    def __init__(self, stops: Optional[Sequence[str]]) -> None:
        if stops is None:
            stops = []
        if isinstance(stops, str):
            stops = [stops]
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
            raise TypeError(f"StopMatcher: stops must be a list of strings, got {shown(stops)}")
        if any(not s for s in stops):
            raise ValueError("StopMatcher: a stop string must not be empty")
        self.stops = list(dict.fromkeys(stops))
        self.longest = max((len(s) for s in self.stops), default=0)
        self.held = ""
        self.stopped = False
        self.stop: Optional[str] = None

    def push(self, text: str) -> Tuple[str, bool]:
        """The text that can be sent now, and whether a stop string ended the text.

        Parameters
        ----------
        text : str
            The next piece of the output.

        Returns
        -------
        (str, bool)
            Once stopped, ("", True) for every later piece.
        """
        if not isinstance(text, str):
            raise TypeError(f"StopMatcher.push: text must be a str, got {shown(text)}")
        if self.stopped:
            return "", True
        buf = self.held + text
        if not self.stops:
            self.held = ""
            return buf, False
        at, which, end = -1, None, -1
        for s in self.stops:  # the match that completes first in the stream (then the longest): a
            i = buf.find(s)   # result that does not depend on how the text was cut into pieces
            if i >= 0 and (at < 0 or (i + len(s), i) < (end, at)):
                at, which, end = i, s, i + len(s)
        if at >= 0:
            self.held, self.stopped, self.stop = "", True, which
            return buf[:at], True
        keep = self._partial(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def _partial(self, buf: str) -> int:
        """The length of buf's longest suffix that begins a stop string (shorter than it)."""
        best = 0
        lo = max(len(buf) - self.longest + 1, 0)
        for s in self.stops:
            j = buf.find(s[0], max(lo, len(buf) - len(s) + 1))
            while j >= 0:
                if len(buf) - j > best and s.startswith(buf[j:]):
                    best = len(buf) - j
                    break
                j = buf.find(s[0], j + 1)
        return best

    def flush(self) -> str:
        """The text held back (none when stopped): the end of the output."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
