"""What a rank does with an exception nobody caught.

Installed by tpcore.init.  It (1) aborts this rank's live communicators with
the exception's text, so that peers fail at once with a message naming this
rank and the cause rather than a bare "closed", and (2) when the launcher asks
for it (TPCORE_ERROR_FILE), writes a small JSON record with a timestamp, so the
launcher can tell the rank that failed first from the ranks that failed in
reaction (torchrun's error files do the same)."""
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
    path = os.environ.get("TPCORE_ERROR_FILE")
    if not path:
        return
    try:
        info = {"time": time.time(), "type": type(exc).__name__, "message": str(exc)[:2000],
                "peer_failure": bool(getattr(exc, "peer_failure", False))}
        with open(path, "w") as f:
            json.dump(info, f)
    except OSError:
        pass
