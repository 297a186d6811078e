"""An interactive chat with a model in the terminal, on N local ranks (as ``llama-cli -cnv`` and
``ollama run``).

    python -m tpcore.chat MODEL [-n N] [--system TEXT] [--max-tokens M] [--chat-template FILE]
                                [--temperature T] [--top-k K] [--top-p P] [--min-p P] [--seed S]
                                [--repetition-penalty R] [--presence-penalty R] [--frequency-penalty R]

MODEL is a .gguf file or a Hugging Face safetensors folder with its tokenizer.  Each line read
is a user turn; the reply streams as it is generated, through the model's chat template (or
FILE) and the conversation so far.  ``/exit`` or end of input (Ctrl-D) ends the chat; Ctrl-C
stops the reply being written (at the prompt: ends the chat).  Sampling: the flags given, the
others from the checkpoint's generation_config.json (greedy without one); its eos ids and the
tokenizer's end a reply.

Ranks: with ``-n N`` (default 1) the chat starts N ranks itself (`tpcore.spawn`), rank 0
reading the terminal; started by a launcher (mpirun, torchrun) it runs as that rank, rank 0
reading its standard input (``python -m tpcore.launch`` gives its ranks none: the chat ends at
once there; use ``-n N``).  Rank 0 sends each line to the
others (one broadcast), every rank generates the same reply (SPMD), and while a reply is
written rank 0 tells the others per piece whether to go on (Ctrl-C).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Dict, List, Optional

import numpy as np

__all__ = ["main", "chat_loop"]

_EXIT = ("/exit", "/quit", "/bye")
_WAIT = 7 * 24 * 3600.0   # the other ranks wait this long for rank 0's next line


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m tpcore.chat", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a .gguf file or a safetensors folder with tokenizer.json")
    p.add_argument("-n", type=int, default=None, help="ranks to start (default 1; not with a launcher)")
    p.add_argument("--system", default=None, help="a system prompt (default: the template's own, if any)")
    p.add_argument("--max-tokens", type=int, default=512, help="at most this many tokens per reply (default 512)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy; > 0: sampling (default: the checkpoint's generation_config, else greedy)")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
    p.add_argument("--min-p", type=float, default=None, help="drop tokens below min-p x the most likely one's")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 0 (1: off)")
    p.add_argument("--presence-penalty", type=float, default=None, help="in [-2, 2]")
    p.add_argument("--frequency-penalty", type=float, default=None, help="in [-2, 2]")
    p.add_argument("--seed", type=int, default=None, help="the sampling stream (default 0)")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template file")
    a = p.parse_args(argv)
    if a.n is not None and a.n < 1:
        p.error(f"-n must be >= 1, got {a.n}")
    if a.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {a.max_tokens}")
    if a.chat_template is not None:
        try:
            with open(a.chat_template, encoding="utf-8") as f:
                a.chat_template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--chat-template: cannot read {a.chat_template}: {e}")
    return a


_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "seed")


def _sampling(a) -> Dict[str, Any]:
    """The sampling flags given (the others: the checkpoint's generation_config, else off)."""
    return {k: getattr(a, k) for k in _FLAGS if getattr(a, k) is not None}


def _send_line(comm, line: Optional[str]) -> Optional[str]:
    """Rank 0's line (None: the chat ends) on every rank: its length, then its UTF-8 bytes."""
    if comm.size == 1:
        return line
    data = b"" if line is None or comm.rank != 0 else line.encode("utf-8")
    n = np.array([-1 if line is None and comm.rank == 0 else len(data)], np.int64)
    old, comm.timeout = comm.timeout, _WAIT
    try:
        comm.broadcast(n, root=0)
    finally:
        comm.timeout = old
    if n[0] < 0:
        return None
    buf = np.frombuffer(data, np.uint8).copy() if comm.rank == 0 else np.zeros(int(n[0]), np.uint8)
    if n[0]:
        comm.broadcast(buf, root=0)
    return buf.tobytes().decode("utf-8")


def _read(stdin, tty: bool) -> Optional[str]:
    """The next user line (None at the end: EOF, /exit, Ctrl-C)."""
    while True:
        if tty:
            sys.stdout.write("> ")
            sys.stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            return None
        if not line:
            return None
        line = line.rstrip("\r\n")
        if line.strip() in _EXIT:
            return None
        if line.strip():
            return line


def chat_loop(comm, model_path: str, system: Optional[str] = None, max_tokens: int = 512,
              chat_template: Optional[str] = None, sampling: Optional[dict] = None, stdin_fd: Optional[int] = None,
              out=None) -> List[dict]:
    """The chat on every rank of comm: load the model, then turns until rank 0's input ends.

    Parameters
    ----------
    comm : Comm
        The ranks.
    model_path : str
        A .gguf file or a safetensors folder.
    system : str, optional
        A system prompt.
    max_tokens : int, default 512
        Tokens per reply at most.
    chat_template : str, optional
        A template instead of the checkpoint's.
    sampling : dict, optional
        The sampling settings (`TransformerLM.chat`'s keywords).
    stdin_fd : int, optional
        The file descriptor rank 0 reads (default: standard input).
    out : file, optional
        Where rank 0 writes the replies (default: standard output).

    Returns
    -------
    list of dict
        The conversation.
    """
    import tpcore
    model = tpcore.models.from_pretrained(model_path, comm, progress=False)
    if model.tokenizer is None:
        raise ValueError(f"tpcore.chat: {model_path} carries no tokenizer (a GGUF file with tokenizer.ggml.* "
                         f"metadata, or tokenizer.json in the folder)")
    template = chat_template if chat_template is not None else model.tokenizer.chat_template
    if template is None:
        from tpcore.models.chat_template import NO_TEMPLATE
        raise ValueError(f"tpcore.chat: {model_path}: {NO_TEMPLATE}")
    messages: List[dict] = [{"role": "system", "content": system}] if system else []
    lead = comm.rank == 0
    out = out or sys.stdout
    stdin = (os.fdopen(stdin_fd, "r", encoding="utf-8", errors="replace", closefd=False)
             if stdin_fd is not None else sys.stdin) if lead else None
    tty = bool(lead and stdin.isatty())
    while True:
        line = _send_line(comm, _read(stdin, tty) if lead else None)
        if line is None:
            break
        messages.append({"role": "user", "content": line})
        reply = _reply(comm, model, messages, max_tokens, template, sampling or {}, out if lead else None)
        messages.append({"role": "assistant", "content": reply})
    return messages


def _go_on(comm, stop: bool) -> bool:
    """Whether every rank goes on writing the reply (rank 0 decides: Ctrl-C)."""
    if comm.size == 1:
        return not stop
    flag = np.array([0 if stop else 1], np.int64)
    comm.broadcast(flag, root=0)
    return bool(flag[0])


_INTERRUPT = {"on": False}


def _on_sigint(signum, frame):
    """Rank 0 while a reply is written: Ctrl-C stops the reply at the next piece (a collective
    cannot be left half-way); at the prompt it raises KeyboardInterrupt (the chat ends)."""
    _INTERRUPT["on"] = True


def _reply(comm, model, messages, max_tokens, template, sampling, out) -> str:
    pieces = []
    lead = comm.rank == 0
    _INTERRUPT["on"] = False
    old = signal.signal(signal.SIGINT, _on_sigint) if lead else None
    stream = model.chat(messages, stream=True, max_new_tokens=max_tokens, chat_template=template, **sampling)
    try:
        for piece in stream:
            pieces.append(piece)
            if out is not None:
                out.write(piece)
                out.flush()
            if not _go_on(comm, _INTERRUPT["on"]):
                break
    finally:
        stream.close()
        if lead:
            signal.signal(signal.SIGINT, old)
    if out is not None:
        out.write("\n")
        out.flush()
    return "".join(pieces)


def _rank(comm, a, stdin_fd):
    if comm.rank != 0:
        signal.signal(signal.SIGINT, signal.SIG_IGN)    # rank 0 decides what Ctrl-C does
    else:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    chat_loop(comm, a.model, a.system, a.max_tokens, a.chat_template, _sampling(a), stdin_fd)
    return 0


def main(argv=None) -> int:
    """``python -m tpcore.chat``: see the module's description.

    Parameters
    ----------
    argv : list of str, optional
        The arguments (default: sys.argv[1:]).
    """
    a = _parse(argv)
    import tpcore
    from tpcore.models.sampling import SamplingParams
    try:
        SamplingParams.make("tpcore.chat", None, **_sampling(a))     # a bad flag: refused before any load
    except (TypeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 2
    try:
        if "TPCORE_JOB_ID" in os.environ or "RANK" in os.environ:
            if a.n is not None:
                print("tpcore.chat: -n is for starting the ranks here; the launcher started them already",
                      file=sys.stderr)
                return 2
            with tpcore.init() as comm:
                return _rank(comm, a, None)
        n = a.n or 1
        if n == 1:
            with tpcore.init() as comm:
                return _rank(comm, a, None)
        fd = os.dup(0)      # a forked rank's sys.stdin is closed (multiprocessing): rank 0 reads this copy
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)   # the ranks handle Ctrl-C, not this process
        try:
            tpcore.spawn(_rank, n, args=(a, fd), relay_output=False)
        finally:
            signal.signal(signal.SIGINT, old)
            os.close(fd)
        return 0
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"tpcore.chat: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
