"""``python -m tpcore.serve MODEL [-n N] [options]`` (also ``tpcore-serve``): an OpenAI-compatible
server for a model on N ranks.

    python -m tpcore.serve SmolLM2-135M-Instruct.Q4_1.gguf -n 2 --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}]}'

MODEL is a safetensors folder (config.json, tokenizer.json) or a .gguf file.  Without a
launcher's environment, -n N (default 1) starts N local ranks through ``tpcore.launch`` (this
process becomes ``python -m tpcore.launch -n N -m tpcore.serve ...``); under
``python -m tpcore.launch``, mpirun or torchrun the ranks are there already.  Rank 0 listens
(127.0.0.1 unless --host says otherwise) and runs the engine loop of `tpcore.serve.driver`; the
others follow it.  A port in use is a one-line error and exit status 1 on every rank, before the
model is loaded.

Imports: tpcore.distributed, tpcore.models, tpcore.serve (tpcore.launch runs as a program, not
imported); uvicorn, starlette, jinja2 (the serve
extra).
"""
from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import sys
import threading
from typing import List, Optional

__all__ = ["main", "serve"]

_KEY_VAR = "TPCORE_SERVE_API_KEY"   # how the relaunched ranks get --api-key (not on their command line)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tpcore.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a safetensors folder (config.json, tokenizer.json) or a .gguf file")
    p.add_argument("-n", type=int, default=None,
                   help="local ranks to start when not started by a launcher (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free one, printed)")
    p.add_argument("--api-key", default=None,
                   help=f"clients must send 'Authorization: Bearer KEY' (or set {_KEY_VAR})")
    p.add_argument("--max-batch", type=int, default=16, help="requests decoded together (default 16)")
    p.add_argument("--max-len", type=int, default=None,
                   help="tokens per request, prompt + completion (default: the model's, at most 2048)")
    p.add_argument("--block-size", type=int, default=16, help="positions per KV-cache block (default 16)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV-cache blocks in the pool (default: max_batch x max_len worth)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="prompt tokens computed per step (default: adaptive, about one decode step's time)")
    p.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt whole (no shared blocks)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests in the server at once, running and waiting; more get 503 (default 256)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template (default: the model's own)")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in the API (default: MODEL's file or folder name)")
    p.add_argument("--max-body", type=int, default=8 << 20, help="largest request body in bytes (default 8 MiB)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers (default 10)")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="open connections at most; more get 503 (default 4096)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    return p


def _check(p, a) -> None:
    for name, lo in (("n", 1), ("max_batch", 1), ("max_queue", 1), ("max_body", 1024), ("max_connections", 1),
                     ("block_size", 1), ("num_blocks", 1), ("max_prefill_tokens", 1)):
        v = getattr(a, name)
        if v is not None and v < lo:
            p.error(f"--{name.replace('_', '-')} must be >= {lo}, got {v}")
    if a.max_len is not None and a.max_len < 2:
        p.error(f"--max-len must be >= 2, got {a.max_len}")
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be in [0, 65535], got {a.port}")
    if not a.header_timeout > 0:
        p.error(f"--header-timeout must be > 0, got {a.header_timeout}")
    if not (os.path.isdir(a.model) or os.path.isfile(a.model)):
        p.error(f"MODEL {a.model!r} is neither a folder nor a file")


def _launched() -> bool:
    return any(v in os.environ for v in ("TPCORE_JOB_ID", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"))


def _relaunch_argv(a) -> List[str]:
    out = [a.model, "--host", a.host, "--port", str(a.port), "--max-batch", str(a.max_batch),
           "--max-queue", str(a.max_queue), "--max-body", str(a.max_body), "--header-timeout", str(a.header_timeout),
           "--max-connections", str(a.max_connections), "--log-level", a.log_level, "--block-size", str(a.block_size)]
    if a.no_prefix_caching:
        out.append("--no-prefix-caching")
    for flag, v in (("--max-len", a.max_len), ("--chat-template", a.chat_template), ("--num-blocks", a.num_blocks),
                    ("--max-prefill-tokens", a.max_prefill_tokens),
                    ("--served-model-name", a.served_model_name)):
        if v is not None:
            out += [flag, str(v)]
    return out


def main(argv: Optional[List[str]] = None) -> None:
    """The command line (see the module doc); exits with the server's status.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default None: sys.argv[1:]).
    """
    p = _parser()
    a = p.parse_args(argv)
    _check(p, a)
    if a.api_key is not None:
        os.environ[_KEY_VAR] = a.api_key
    if not _launched() and (a.n or 1) > 1:  # this process becomes the launcher of N ranks
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, "-m", "tpcore.launch", "-n", str(a.n), "-m", "tpcore.serve"]
                 + _relaunch_argv(a))
    sys.exit(serve(a))


# ---------------------------------------------------------------------------- the model's text side
def _text_side(a):
    """(tokenizer, the --chat-template file's text or None) of MODEL (rank 0)."""
    from tpcore.models.text import load_tokenizer
    tok = load_tokenizer(a.model)
    template = None
    if a.chat_template is not None:
        with open(a.chat_template, encoding="utf-8") as f:
            template = f.read()
    return tok, template


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(2048)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


def _agree_error(comm, msg: str) -> str:
    """Rank 0's error message (empty: none) on every rank."""
    if comm.size == 1:
        return msg
    import numpy as np
    buf = np.zeros(1024, np.uint8)
    raw = msg.encode()[:1023]
    if comm.rank == 0:
        buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    comm.broadcast(buf, root=0)
    return bytes(buf).rstrip(b"\0").decode(errors="replace")


def _protocol(header_timeout: float):
    """uvicorn's h11 protocol that closes a connection which sent no whole request head within
    header_timeout seconds (slowloris: uvicorn alone waits for ever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class _Bounded(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_timer = self.loop.call_later(header_timeout, self._no_head)

        def handle_events(self):
            super().handle_events()
            if self.cycle is not None and self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc):
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

        def _no_head(self):
            self._head_timer = None
            if self.cycle is None:
                self.transport.close()

    return _Bounded


# ---------------------------------------------------------------------------- the server
def _run_http(a, comm, driver, engine, model, text, sock) -> int:
    """Rank 0: the engine loop in a thread, uvicorn in this one, until a signal; the status."""
    import uvicorn

    from tpcore.serve.openai_api import ServerState, make_app
    tok, template = text
    name = a.served_model_name or os.path.basename(os.path.normpath(a.model)).removesuffix(".gguf")
    state = ServerState(driver, name, tok, engine.max_len, model.config.vocab_size, engine.eos, chat_template=template,
                        defaults=getattr(model, "generation_config", None), api_key=os.environ.get(_KEY_VAR) or None,
                        max_body=a.max_body, world_size=comm.size)
    config = uvicorn.Config(make_app(state), lifespan="off", log_level=a.log_level, access_log=False,
                            http=_protocol(a.header_timeout), timeout_keep_alive=5,
                            limit_concurrency=a.max_connections, h11_max_incomplete_event_size=64 << 10,
                            timeout_graceful_shutdown=3)  # within the launcher's 5 s grace
    server = uvicorn.Server(config)
    signals: List[int] = []
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda sig, frame: signals.append(sig))
    driver.on_failure = lambda: setattr(server, "should_exit", True)
    loop = threading.Thread(target=driver.run, name="tpcore-serve-engine", daemon=True)
    loop.start()
    host, port = sock.getsockname()[:2]
    print(f"tpcore.serve: {name} on {comm.size} rank(s), max_batch {engine.max_batch}, max_len {engine.max_len}, "
          f"{engine.num_blocks} KV blocks of {engine.block_size}; listening on http://{host}:{port}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        driver.stop()
        loop.join(30)
    return 1 if driver.failed else 0


def serve(a: argparse.Namespace) -> int:
    """The server on this rank (the ranks are there: tpcore.init()).

    Parameters
    ----------
    a : argparse.Namespace
        The parsed command line.

    Returns
    -------
    int
        The exit status: 0 after a signal stopped it, 1 when it could not start or the
        engine failed.
    """
    from tpcore.distributed.init import init
    from tpcore.models.loader import from_pretrained
    from tpcore.serve.driver import Driver
    from tpcore.serve.engine import Engine
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # many idle connections must not exhaust the descriptors
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    comm = init()
    sock, text, err = None, None, ""
    try:
        if comm.rank == 0:
            try:
                sock = _listen(a.host, a.port)
                text = _text_side(a)
            except OSError as e:
                err = (f"cannot listen on {a.host}:{a.port}: {e.strerror or e}" if sock is None else
                       f"cannot read the model's tokenizer: {e}")
            except (ValueError, ImportError) as e:
                err = f"cannot read the model's tokenizer or chat template: {e}"
        err = _agree_error(comm, err)
        if err:
            who = "" if comm.rank == 0 else f"rank {comm.rank}: stopping, rank 0 says: "
            print(f"tpcore.serve: {who}{err}", file=sys.stderr, flush=True)
            return 1
        if comm.rank != 0:
            for s in (signal.SIGINT, signal.SIGTERM):  # rank 0 stops the others (with its last message)
                signal.signal(s, signal.SIG_IGN)
        try:
            model = from_pretrained(a.model, comm, progress=False)
            engine = Engine(model, max_batch=a.max_batch, max_len=a.max_len, block_size=a.block_size,
                            num_blocks=a.num_blocks, max_prefill_tokens=a.max_prefill_tokens,
                            prefix_caching=not a.no_prefix_caching)
        except (FileNotFoundError, ValueError, TypeError) as e:
            print(f"tpcore.serve: {e}", file=sys.stderr, flush=True)
            return 1
        driver = Driver(comm, engine, text[0] if text else None, max_queue=a.max_queue)
        if comm.rank == 0:
            return _run_http(a, comm, driver, engine, model, text, sock)
        driver.follow()
        return 0
    finally:
        if sock is not None:
            sock.close()
        comm.close()
