"""Chat templates: a conversation to the prompt text a model was trained on.

    text = render_chat(tokenizer.chat_template, [{"role": "user", "content": "Hi"}],
                       bos_token="<s>", eos_token="</s>")

Templates are Jinja, from the checkpoint (tokenizer_config.json, chat_template.jinja, a GGUF
file's tokenizer.chat_template) or a file the user names (``--chat-template``): code from
elsewhere, rendered in jinja2's ImmutableSandboxedEnvironment as transformers renders them
(trim_blocks, lstrip_blocks, loop controls; raise_exception, strftime_now, a JSON ``tojson``
that keeps non-ASCII text, ``dict`` and a ``namespace`` refusing underscore names), the
messages and variables rebuilt from plain JSON types first, so a template reaches no Python
object's internals.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from datetime import datetime
from typing import Any, Mapping

from tpcore.utils.args import shown

__all__ = ["render_chat", "NO_TEMPLATE"]

NO_TEMPLATE = ("the model has no chat template (neither tokenizer_config.json / chat_template.jinja nor the GGUF "
               "metadata's tokenizer.chat_template): give one with --chat-template FILE (or chat_template=...)")


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("chat templates need jinja2: pip install jinja2") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


def _plain(v: Any) -> Any:
    """v rebuilt from JSON types (str, int, float, bool, None, dict, list, tuple); anything else
    as a placeholder "<TypeName>" (transformers' _plain_template_data)."""
    if v is None or type(v) in (str, int, float, bool):
        return v
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, int):
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, Mapping):
        return {_plain(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    if hasattr(v, "item") and callable(v.item) and getattr(v, "shape", None) == ():  # NumPy scalars
        return _plain(v.item())
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if callable(getattr(v, "model_dump", None)):   # pydantic (the openai client's messages)
        return _plain(v.model_dump())
    return f"<{type(v).__name__}>"


def _messages(messages: Any) -> list:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise TypeError(f"render_chat: messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                        f"{shown(messages)}")
    out = []
    for i, m in enumerate(_plain(list(messages))):
        if not isinstance(m, dict):
            raise TypeError(f"render_chat: messages[{i}] must be a dict with 'role' and 'content', got {shown(m)}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"render_chat: messages[{i}] needs a 'role' string, got {shown(m.get('role'))}")
        out.append({k: x for k, x in m.items() if x is not None})   # content=None: left out, as transformers
    return out


def render_chat(template: Any, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """The prompt text of a conversation: a chat template rendered in a Jinja sandbox.

    Parameters
    ----------
    template : str
        The Jinja template (None: a ValueError naming ``--chat-template``).
    messages : list of dict
        The conversation: {"role": "system" | "user" | "assistant" | ..., "content": ...}.
    add_generation_prompt : bool, default True
        End with the header of the assistant's turn (the model writes the rest).
    **kwargs
        More variables for the template: bos_token, eos_token (a `Tokenizer` gives them),
        tools, documents, ...

    Returns
    -------
    str

    Raises
    ------
    TypeError
        template not a str, messages not a list of dicts.
    ValueError
        No template; the template's syntax, a raise_exception() of it (the template's
        message), or a failure while rendering (named).
    jinja2.exceptions.SecurityError
        The template reached for what the sandbox refuses (an object's internals).
    """
    if template is None:
        raise ValueError(f"render_chat: {NO_TEMPLATE}")
    if not isinstance(template, str):
        raise TypeError(f"render_chat: template must be a str (Jinja), got {shown(template)}")
    if not isinstance(add_generation_prompt, bool):
        raise TypeError(f"render_chat: add_generation_prompt must be a bool, got {shown(add_generation_prompt)}")
    import jinja2
    msgs = _messages(messages)
    try:
        compiled = _compiled(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"render_chat: the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e
    variables = {"tools": None, "documents": None, **_plain(kwargs)}
    try:
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.SecurityError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"render_chat: the chat template refused the conversation: {e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as e:
        raise ValueError(f"render_chat: the chat template failed: {type(e).__name__}: {e}") from e
