"""What the OpenAI server's tests share: a server started as a subprocess on a free port (and
torn down with nothing left), a tiny Llama checkpoint with a character tokenizer and a chat
template, the references (generate() of each prompt alone, the tokenizer's own decode)."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

import tpcore

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "fixtures", "llama")
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model(folder):
    """tests/fixtures/llama (vocab 128) with a character-level tokenizer.json (ids 3..97 the
    printable ASCII characters, 98 newline, 2 the EOS "</s>") and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    os.makedirs(folder, exist_ok=True)
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(FIXTURE, f), folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    vocab["\n"] = len(vocab)
    while len(vocab) < 128:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), "isolated")
    t.decoder = decoders.Fuse()
    t.add_special_tokens(["<s>", "</s>"])
    t.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}, f)
    return folder


def render(template, messages, bos="", eos=""):
    """The chat prompt as transformers renders it (jinja2's sandbox, trim_blocks, lstrip_blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True, bos_token=bos,
                                            eos_token=eos)


def _generate(comm, path, prompts, new, sampling=None):
    m = tpcore.models.from_pretrained(path, comm, progress=False)
    eos = m.generation_config.get("eos_token_id")
    eos = set([eos] if isinstance(eos, int) else eos or [])
    out = []
    for p in prompts:
        g = m.generate([np.array(p, np.int64)], max_new_tokens=new, **(sampling or {"temperature": 0.0}))
        g = (g[0] if isinstance(g, list) else g[0])[len(p):].tolist()
        cut = next((i + 1 for i, t in enumerate(g) if t in eos), len(g))
        out.append((g[:cut], "length" if cut == new and g[cut - 1] not in eos else "stop"))
    return out


def reference(path, prompts, new, world=1, sampling=None):
    """generate() of each prompt alone on `world` ranks (greedy, or with the sampling settings):
    [(tokens up to and with the EOS, finish_reason)]."""
    return tpcore.spawn(_generate, world, args=(path, prompts, new, sampling), deadline=300)[0]


class Server:
    """python -m tpcore.serve MODEL --port P [args] [-n N], until close()."""

    def __init__(self, model, *args, n=1, timeout=180, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tpcore.serve", model, "--port", str(self.port), *args]
        if n > 1:
            cmd += ["-n", str(n)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **(env or {}))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        end = time.monotonic() + timeout
        import httpx
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                self.close()
                raise AssertionError(f"the server did not come up in {timeout} s: {self.output()}")
            time.sleep(0.2)

    def output(self):
        with open(self.log.name) as f:
            return f.read()[-4000:]

    def health(self):
        import httpx
        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_idle(self, timeout=30):
        """The engine's counters once nothing runs, waits or is held by the server."""
        end = time.monotonic() + timeout
        while True:
            h = self.health()
            e = h["engine"]
            if h["in_server"] == 0 and e["running"] == 0 and e["waiting"] == 0 and e["tracked"] == 0:
                return h
            assert time.monotonic() < end, h
            time.sleep(0.05)

    def close(self):
        """SIGTERM, then every process of the server's session must be gone."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                raise AssertionError(f"the server did not stop on SIGTERM: {self.output()}") from None
        end = time.monotonic() + 10
        while True:  # the ranks (the launcher's children) are gone too
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < end, "processes of the server's session are left"
            time.sleep(0.05)
        self.log.close()
        os.unlink(self.log.name)
