"""What a rank does with an exception nobody caught.

Installed by tpcore.init.  It (1) aborts this rank's live communicators with
the exception's text, so that peers fail at once with a message naming this
rank and the cause rather than a bare "closed", and (2) when the launcher asks
for it (TPCORE_ERROR_FILE), writes a small JSON record with a timestamp, so the
launcher can tell the rank that failed first from the ranks that failed in
reaction (torchrun's error files do the same).  The record goes down a pipe
the launcher passes as file descriptor TPCORE_ERROR_FD: one write of less
than PIPE_BUF bytes, so records never interleave, and nothing is left on disk
even when the launcher itself is killed."""
from __future__ import annotations

import json
import os
import sys
import time
import weakref

_live: "weakref.WeakSet" = weakref.WeakSet()
_installed = False


def track(comm) -> None:
    global _installed
    _live.add(comm)
    if not _installed:
        _installed = True
        prev = sys.excepthook

        def hook(et, ev, tb):
            try:
                record(ev)
                for c in list(_live):
                    if not c.closed:
                        c.abort(f"unhandled {et.__name__}: {ev}")
            finally:
                prev(et, ev, tb)

        sys.excepthook = hook


def record(exc: BaseException) -> None:
    fd = os.environ.get("TPCORE_ERROR_FD")
    rank = os.environ.get("RANK")
    if not fd or rank is None:
        return
    info = {"rank": int(rank), "time": time.time(), "type": type(exc).__name__, "message": str(exc)[:1500],
            "peer_failure": bool(getattr(exc, "peer_failure", False))}
    line = (json.dumps(info) + "\n").encode()[:4000]
    try:
        os.write(int(fd), line)
    except (OSError, ValueError):
        pass
