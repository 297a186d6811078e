"""The ranks' output, relayed to the parent's streams with one rank prefix a line
(used by tpcore.spawn and python -m tpcore.launch).

A rank's text is cut into lines at "\\n", "\\r\\n" and at a lone "\\r": a progress bar
that redraws its line with carriage returns is a line per update, never one prefix
glued to the next update ("[rank0] [rank0] loading ...").  How a line is shown:

- into a pipe, a file or a notebook: each line once, "<prefix><text>\\n", in order; a
  line is written when it ends (or when the rank's stream ends), so a "\\r" update
  shows as its own line once the next one begins.
- into a terminal: the rank's current line is drawn in place ("\\r<prefix><text>",
  cleared to the end) as its text arrives, so a progress bar is one updating line
  with one prefix; a line that ends with "\\n" stays, and output of another rank or
  stream first ends the line being drawn.

Only the standard library: the launcher imports this before any rank runs."""
from __future__ import annotations

import codecs
import os
import threading
from typing import Callable, Optional, TextIO

_CLEAR = "\x1b[K"  # erase to the end of the line (a redrawn line may be shorter)


class Console:
    """What the relays of one parent share: a lock, and which relay's line is drawn
    in place on a terminal right now (it must be ended before anyone else writes)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.open: Optional["LineRelay"] = None

    def relay(self, stream: Callable[[], TextIO], prefix: str, tty: Optional[bool] = None) -> "LineRelay":
        return LineRelay(self, stream, prefix, tty)

    def write(self, out: TextIO, text: str) -> None:
        """The parent's own message: after the line being drawn in place is ended."""
        with self.lock:
            if self.open is not None:
                o = self.open.stream()
                o.write("\n")
                o.flush()
                self.open = None
            out.write(text)
            out.flush()


class LineRelay:
    """One source (a rank's stdout or its stderr) to one stream.  stream: a function that
    returns the stream (resolved at each write: pytest and notebooks swap sys.stdout);
    tty: draw in place (default: the stream's isatty())."""

    def __init__(self, console: Console, stream: Callable[[], TextIO], prefix: str, tty: Optional[bool] = None):
        self.console, self.stream, self.prefix, self._tty = console, stream, prefix, tty
        self._buf = ""
        self._drawn: Optional[str] = None  # the unfinished line last drawn in place (terminal)
        self._after_cr = False   # the last line ended with "\r": a "\n" right after it completes "\r\n"
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def _is_tty(self, out) -> bool:
        if self._tty is not None:
            return self._tty
        try:
            return bool(out.isatty())
        except (AttributeError, ValueError, OSError):
            return False

    def feed_bytes(self, data: bytes) -> None:
        self.feed(self._decoder.decode(data))

    def feed(self, text: str) -> None:
        if not text:
            return
        with self.console.lock:
            out = self.stream()
            tty = self._is_tty(out)
            buf = self._buf + text
            i = 0
            n = len(buf)
            nl = cr = -2  # the next "\n" / "\r" at or after i (-1: none): each found once, so that
            while True:   # a long text without "\r" is not searched to its end at every line
                if -1 < nl < i or nl == -2:
                    nl = buf.find("\n", i)
                if -1 < cr < i or cr == -2:
                    cr = buf.find("\r", i)
                j = cr if nl < 0 else nl if cr < 0 else min(nl, cr)
                if j < 0:
                    break
                seg, end = buf[i:j], buf[j]
                i = j + 1
                if end == "\r" and i < n and buf[i] == "\n":  # "\r\n": one line end
                    end, i = "\n", i + 1
                if end == "\n" and not seg and self._after_cr:  # the "\n" of a "\r\n" cut between writes
                    self._after_cr = False
                    self._end_open(out)
                    continue
                self._after_cr = end == "\r"
                self._line(out, tty, seg, end)
            self._buf = buf[i:]
            if self._buf:
                self._after_cr = False
                if tty:
                    self._draw(out, self._buf)
            out.flush()

    def close(self) -> None:
        """The source ended: its unfinished line is written (and ended)."""
        with self.console.lock:
            out = self.stream()
            tail = self._decoder.decode(b"", final=True)
            self._buf += tail
            if self._buf:
                self._line(out, self._is_tty(out), self._buf, "\n")
                self._buf = ""
            else:
                self._end_open(out)
            out.flush()

    # -- writing ---------------------------------------------------------------
    def _take_over(self, out) -> None:
        """End the line another relay is drawing in place."""
        other = self.console.open
        if other is not None and other is not self:
            o = other.stream()
            o.write("\n")
            o.flush()
            self.console.open = None

    def _end_open(self, out) -> None:
        if self.console.open is self:
            out.write("\n")
            self.console.open = None

    def _draw(self, out, text: str) -> None:
        if self.console.open is self and self._drawn == text:
            return
        self._take_over(out)
        out.write(f"\r{self.prefix}{text}{_CLEAR}")
        self.console.open, self._drawn = self, text

    def _line(self, out, tty: bool, seg: str, end: str) -> None:
        if not tty:
            if seg or end == "\n":  # an empty "\r" update shows nothing; an empty line stays a line
                out.write(f"{self.prefix}{seg}\n")
            return
        drawn, self._drawn = self._drawn == seg, None
        if drawn:  # this line was drawn already, as its unfinished text: end it, or leave it
            if end == "\n":
                self._end_open(out)
            else:
                self._drawn = seg
            return
        if end == "\r":
            if seg:
                self._draw(out, seg)
            return
        if self.console.open is self:
            out.write(f"\r{self.prefix}{seg}{_CLEAR}\n")
            self.console.open = None
        else:
            self._take_over(out)
            out.write(f"{self.prefix}{seg}\n")


def pump(fd: int, relay: LineRelay) -> None:
    """Copy a pipe into a relay until its end (one read per chunk: a "\\r" update shows
    without waiting for a newline), then close both."""
    try:
        while True:
            try:
                data = os.read(fd, 65536)
            except InterruptedError:
                continue
            except OSError:
                break
            if not data:
                break
            relay.feed_bytes(data)
    finally:
        relay.close()
