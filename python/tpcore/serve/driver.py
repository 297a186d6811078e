"""The SPMD serving loop: rank 0's HTTP front end feeds one engine that every rank runs.

Rank 0 runs the HTTP server (`tpcore.serve.openai_api`, uvicorn in the main thread) and, in a
second thread, `Driver.run`: each iteration takes the submissions and cancellations that the
HTTP handlers queued (`Driver.submit`, `Driver.cancel`), sends them to every rank in one
broadcast (a fixed-size header of `HEADER` bytes that carries a short message whole; a second
broadcast of the rest only when the message is longer), applies them to its engine and calls
``engine.step()``.  The other ranks run `Driver.follow`: receive, apply the same messages in the
same order, step.  So every rank submits and cancels the same requests between the same steps,
as the engine's SPMD contract asks (vLLM's driver worker does the same).  When nothing runs,
rank 0 sends an empty message (a heartbeat) every `heartbeat` seconds, well within the
communicator's timeout, and one that says "stop" when the server shuts down.

Tokens go back to the HTTP handlers on rank 0: after each step, each request's new tokens are
detokenized incrementally (never half a UTF-8 character), stop strings are matched across token
boundaries (held back while they may still start one; never sent), and the text is put on the
request's asyncio queue with ``loop.call_soon_threadsafe``.  A stop string ends the request at
once for its client; the engine's request is cancelled at the next step.

Imports: tpcore.models (SamplingParams; the text layer: IncrementalDetokenizer, StopMatcher).
"""
from __future__ import annotations

import itertools
import json
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

import numpy as np

from tpcore.models.sampling import SamplingParams
from tpcore.models.text import IncrementalDetokenizer, StopMatcher

__all__ = ["Driver", "Handle", "HEADER"]

HEADER = 4096                     # bytes of the per-step broadcast (16 of them: kind and length)
_STEP, _STOP, _FAIL = 1, 2, 3     # message kinds
_CONTEXT = 16                     # prompt tokens the detokenizer reads as its first window's context


class Handle:
    """One HTTP request's link to the engine (rank 0): its asyncio queue receives lists of
    events ("text", str, logprob entries), ("done", finish_reason, completion tokens),
    ("error", status, message).

    Parameters
    ----------
    uid : int
        The front end's number for it.
    loop : asyncio.AbstractEventLoop
        The HTTP server's loop.
    queue : asyncio.Queue
        Where the events go.
    prompt_ids : list of int
    stops : list of str
    logprobs : int or None
    """

    def __init__(self, uid, loop, queue, prompt_ids, stops, logprobs) -> None:
        self.uid, self.loop, self.queue = uid, loop, queue
        self.prompt_len, self.prompt_tail = len(prompt_ids), list(prompt_ids[-_CONTEXT:])
        self.stops, self.logprobs = stops, logprobs
        self.req = None           # the engine's Request (rank 0's engine)
        self.sent = 0             # tokens taken from req.tokens
        self.closed = False       # done / error sent
        self.detok: Optional[IncrementalDetokenizer] = None
        self.matcher = StopMatcher(stops)

    def post(self, events) -> None:
        """Put events on the queue from any thread (dropped once the HTTP loop has closed: the
        server is shutting down and no one waits for them)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, events)
        except RuntimeError:  # the event loop is closed
            self.closed = True


class Driver:
    """The serving loop of one rank (see the module doc).

    Parameters
    ----------
    comm : Comm
        The model's communicator (the same on every rank).
    engine : Engine
        This rank's engine.
    tokenizer : tpcore.models.Tokenizer or None
        Rank 0's tokenizer (decodes the tokens for the clients).
    max_queue : int, default 256
        Requests in the server at once (waiting and running); more get 503.
    heartbeat : float, optional
        Seconds between idle messages (default: a quarter of comm's timeout, at most 2 s).
    """

    def __init__(self, comm, engine, tokenizer=None, max_queue: int = 256, heartbeat: Optional[float] = None) -> None:
        self.comm, self.engine, self.tok = comm, engine, tokenizer
        self.max_queue = max_queue
        self.heartbeat = heartbeat if heartbeat is not None else min(2.0, comm.timeout / 4)
        self._cond = threading.Condition()
        self._subs: List[Dict[str, Any]] = []    # queued submissions (payloads)
        self._cancels: List[int] = []
        self._stop = False
        self._handles: Dict[int, Handle] = {}    # rank 0: uid -> handle, while in the server
        self._reqs: Dict[int, Any] = {}          # every rank: uid -> engine Request, while it runs
        self._uids = itertools.count()
        self.failed: Optional[str] = None
        self.snapshot: Dict[str, Any] = dict(engine.stats())
        self.on_failure = None                   # rank 0: called (no argument) when the loop dies

    # ---------------------------------------------------------------- HTTP side (rank 0)
    def submit(self, payload: Dict[str, Any], loop, queue, stops: List[str]) -> Handle:
        """Queue a request for the next step (thread-safe; rank 0).

        Parameters
        ----------
        payload : dict
            Engine.submit's settings: p (prompt ids), n (max new tokens), eos (list or -1), sp (the
            SamplingParams' fields).
        loop, queue
            The handler's event loop and asyncio.Queue.
        stops : list of str
            Stop strings (matched here, on rank 0).

        Returns
        -------
        Handle

        Raises
        ------
        OverflowError
            max_queue requests are in the server already.
        RuntimeError
            The loop has stopped.
        """
        with self._cond:
            if self.failed or self._stop:
                raise RuntimeError(self.failed or "the server is shutting down")
            if len(self._handles) >= self.max_queue:
                raise OverflowError(f"the server holds {len(self._handles)} requests (--max-queue "
                                    f"{self.max_queue}); try again later")
            uid = next(self._uids)
            h = Handle(uid, loop, queue, payload["p"], stops, payload["sp"].get("logprobs"))
            self._handles[uid] = h
            self._subs.append(dict(payload, u=uid))
            self._cond.notify()
        return h

    def cancel(self, uid: int) -> None:
        """Cancel a request (its client went away): at the next step on every rank (thread-safe).

        Parameters
        ----------
        uid : int
            `Handle.uid`.
        """
        with self._cond:
            h = self._handles.get(uid)
            if h is None:
                return
            h.closed = True
            queued = [s for s in self._subs if s["u"] == uid]
            if queued:  # never sent: forget it here
                self._subs.remove(queued[0])
                del self._handles[uid]
            else:
                self._cancels.append(uid)
                self._cond.notify()

    def stop(self) -> None:
        """Ask the loop to end (every rank's, with the next message)."""
        with self._cond:
            self._stop = True
            self._cond.notify()

    @property
    def in_server(self) -> int:
        """Requests in the server (rank 0)."""
        return len(self._handles)

    # ---------------------------------------------------------------- the message
    def _exchange(self, kind: int, body: bytes):
        """Rank 0's (kind, body) to every rank; returns it (on the others: what rank 0 sent)."""
        if self.comm.size == 1:
            return kind, body
        head = np.zeros(HEADER, np.uint8)
        if self.comm.rank == 0:
            head[:16] = np.frombuffer(np.array([kind, len(body)], np.int64).tobytes(), np.uint8)
            head[16:16 + min(len(body), HEADER - 16)] = np.frombuffer(body[:HEADER - 16], np.uint8)
        self.comm.broadcast(head, root=0)
        kind, n = (int(v) for v in np.frombuffer(head[:16].tobytes(), np.int64))
        if n <= HEADER - 16:
            return kind, head[16:16 + n].tobytes()
        rest = np.zeros(n - (HEADER - 16), np.uint8)
        if self.comm.rank == 0:
            rest[:] = np.frombuffer(body[HEADER - 16:], np.uint8)
        self.comm.broadcast(rest, root=0)
        return kind, head[16:].tobytes() + rest.tobytes()

    def _apply(self, body: bytes) -> None:
        """The submissions and cancellations, in order, on this rank's engine."""
        if not body:
            return
        msg = json.loads(body)
        for uid in msg.get("c", ()):
            r = self._reqs.get(uid)
            if r is not None and not r.done:
                self.engine.cancel(r.id)
        for s in msg.get("s", ()):
            uid = s["u"]
            try:
                r = self.engine.submit(s["p"], s["n"], eos_token_id=s["eos"], sampling=SamplingParams(**s["sp"]))
            except (TypeError, ValueError) as e:  # the same on every rank: the request alone fails
                self._refused(uid, str(e))
                continue
            self._reqs[uid] = r
            if self.comm.rank == 0:
                h = self._handles.get(uid)
                if h is not None:
                    h.req = r
                    h.detok = IncrementalDetokenizer(self.tok, h.prompt_tail) if self.tok is not None else None

    def _refused(self, uid, message):
        if self.comm.rank == 0:
            with self._cond:
                h = self._handles.pop(uid, None)
            if h is not None:
                h.post([("error", 400, message)])

    def _has_work(self) -> bool:
        return bool(self.engine.waiting or self.engine.running)

    def _step(self) -> None:
        self.engine.step()
        done = [u for u, r in self._reqs.items() if r.done]
        if self.comm.rank == 0:
            self._deliver()
        for u in done:
            del self._reqs[u]
        self.snapshot = dict(self.engine.stats())

    # ---------------------------------------------------------------- rank 0's loop
    def run(self) -> None:
        """Rank 0's loop (a thread): until `stop` (then the other ranks get "stop") or a failure
        (then every open request gets an error, `on_failure` runs, and the others get "fail")."""
        try:
            while True:
                with self._cond:
                    if not (self._subs or self._cancels or self._stop or self._has_work()):
                        self._cond.wait(self.heartbeat)
                    subs, cancels, stop = self._subs, self._cancels, self._stop
                    self._subs, self._cancels = [], []
                if stop:
                    self._exchange(_STOP, b"")
                    break
                body = json.dumps({"s": subs, "c": cancels}).encode() if subs or cancels else b""
                _, body = self._exchange(_STEP, body)
                self._apply(body)
                if self._has_work():
                    self._step()
        except BaseException as e:  # noqa: BLE001 (any failure ends the server; the clients hear why)
            self.failed = f"the engine failed: {type(e).__name__}: {e}"
            traceback.print_exc()
            print(f"tpcore.serve: {self.failed}; stopping", file=sys.stderr, flush=True)
            with self._cond:
                hs, self._handles = list(self._handles.values()), {}
            for h in hs:
                h.post([("error", 500, self.failed)])
            try:
                if self.comm.size > 1:
                    self._exchange(_FAIL, self.failed.encode()[:HEADER - 16])
            except BaseException:  # noqa: BLE001 (the others may be gone already)
                pass
            if self.on_failure is not None:
                self.on_failure()

    def follow(self) -> None:
        """The other ranks' loop: apply rank 0's messages and step, until "stop".

        Raises
        ------
        RuntimeError
            Rank 0's engine failed ("fail"): the message says why.
        """
        while True:
            kind, body = self._exchange(0, b"")
            if kind == _STOP:
                return
            if kind == _FAIL:
                raise RuntimeError(f"rank 0 stopped serving: {body.decode(errors='replace')}")
            self._apply(body)
            if self._has_work():
                self._step()

    # ---------------------------------------------------------------- tokens back to the clients
    def _token_text(self, t: int) -> str:
        return self.tok.decode([int(t)], skip_special_tokens=False) if self.tok is not None else str(int(t))

    def _entries(self, r, lo, hi):
        out = []
        for e in (r.logprobs or [])[lo:hi]:
            out.append({"token": self._token_text(e.token), "logprob": e.logprob,
                        "top": [(self._token_text(i), lp) for i, lp in e.top]})
        return out

    def _deliver(self) -> None:
        """Each open request's new tokens, as text events, on its queue (rank 0)."""
        for uid, h in list(self._handles.items()):
            r = h.req
            if r is None:
                continue
            if h.closed:
                if r.done:
                    with self._cond:
                        self._handles.pop(uid, None)
                continue
            new = r.tokens_since(h.sent)
            events, pieces, stopped, lo = [], [], False, h.sent
            for t in new:
                h.sent += 1
                piece = h.detok.push(t) if h.detok is not None else f" {t}"
                out, stopped = h.matcher.push(piece)
                pieces.append(out)
                if stopped:
                    break
            if r.done and not stopped and r.finish_reason in ("stop", "length"):
                tail = h.detok.flush() if h.detok is not None else ""
                out, stopped = h.matcher.push(tail)
                pieces.append(out)
                if not stopped:
                    pieces.append(h.matcher.flush())
            text = "".join(pieces)
            lps = self._entries(r, lo, h.sent) if h.logprobs is not None else None
            if text or lps:
                events.append(("text", text, lps))
            if stopped or r.done:
                if r.finish_reason == "error" and not stopped:
                    events.append(("error", 500, str(r.error)))
                else:
                    events.append(("done", "stop" if stopped or r.finish_reason == "stop" else "length", h.sent))
                h.closed = True
                with self._cond:
                    if r.done:
                        self._handles.pop(uid, None)
                    else:  # a stop string: the engine's request ends at the next step
                        self._cancels.append(uid)
            if events:
                h.post(events)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in the server (rank 0; tests and shutdown).

        Parameters
        ----------
        timeout : float
            Seconds.
        """
        end = time.monotonic() + timeout
        while self._handles and time.monotonic() < end:
            time.sleep(0.01)
        return not self._handles
