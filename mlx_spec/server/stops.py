"""Stop strings honoured across token boundaries: text in, text out, cut before the first one.

Text that could be the start of a stop string is held back until the next piece decides it.
"""

from __future__ import annotations


class StopText:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""  # held back: it may begin a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _held(self) -> int:
        """Length of the longest tail of `pending` that is a proper prefix of a stop string."""
        for n in range(min(len(self.pending), max(map(len, self.stops)) - 1), 0, -1):
            tail = self.pending[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def feed(self, text: str) -> str:
        """The text that is safe to emit now ("" once a stop string was seen)."""
        if self.stopped:
            return ""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            out, self.pending, self.stopped = self.pending[:at], "", True
            return out
        keep = self._held()
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        """Generation ended without a stop string: the held-back text is reply after all."""
        out, self.pending = self.pending, ""
        return out
