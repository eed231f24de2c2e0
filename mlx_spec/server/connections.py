"""Connections bounded: what a client can hold open, and for how long (issue 45). The
limits and the log's rate limit here; the protocol that applies them in bounded.py (it
imports uvicorn, which the command line must not load just to parse its arguments).

uvicorn's h11 protocol never times out a request head (a client that sends half a header line
and nothing more keeps its socket for ever) and counts connections only when a request
arrives, so a few thousand silent sockets once used up the open-file limit: /health timed out
and asyncio logged "Too many open files" 300,000 times in 75 s. `bounded.BoundedH11` adds:

- a head timeout: a connection must send a whole request head within `head_timeout` seconds
  of opening (or of its previous response ending), trickled bytes or not, or it is closed;
- a connection cap below the open-file limit (`default_max_connections`): at the cap a new
  connection first evicts the connection that has waited longest without a request head (a
  silent or trickling socket, or an idle keep-alive one); when every connection is busy with a
  request, the new one gets a 503 and is closed.

`RateLimit` is a logging filter: the same message at most `burst` times per `interval`
seconds, then one line that counts the dropped ones.
"""

from __future__ import annotations

import logging
import resource
import time

HEAD_TIMEOUT = 10.0  # seconds for a whole request head (and the longest pause in a body)
SEND_TIMEOUT = 30.0  # seconds one write may wait for a client that stopped reading
FD_HEADROOM_FRACTION = 4  # a quarter of the open-file limit is kept for everything else
FD_HEADROOM_MIN = 64


def open_file_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 16 if soft == resource.RLIM_INFINITY else soft


def default_max_connections(limit: int | None = None) -> int:
    """Connections the server keeps open at most: the open-file limit less a quarter (at
    least 64 kept) for model files, pipes, logs and the sockets being refused."""
    limit = open_file_limit() if limit is None else limit
    return max(8, limit - max(FD_HEADROOM_MIN, limit // FD_HEADROOM_FRACTION))


class RateLimit(logging.Filter):
    """The same message (logger and the first line of its format string) passes `burst`
    times per `interval` seconds; what is dropped is counted in one line when the message
    passes again or another interval begins."""

    def __init__(self, burst: int = 20, interval: float = 10.0, clock=time.monotonic):
        super().__init__()
        self.burst, self.interval, self.clock = burst, interval, clock
        self.windows: dict[tuple, list] = {}  # key -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        seen = getattr(record, "rate_limited", None)
        if seen is not None:  # this filter sits on a logger and on a handler: decide once
            return seen
        record.rate_limited = passed = self.decide(record)
        return passed

    def decide(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg).split("\n", 1)[0][:200])
        now = self.clock()
        window = self.windows.get(key)
        if window is None or now - window[0] >= self.interval:
            dropped = window[2] if window is not None else 0
            if len(self.windows) > 4096:  # many distinct messages: forget the old windows
                self.windows.clear()
            self.windows[key] = [now, 1, 0]
            if dropped:
                record.msg = f"{record.msg} ({dropped} more like this were dropped in the last"
                record.msg += f" {self.interval:g} s)"
            return True
        if window[1] < self.burst:
            window[1] += 1
            return True
        window[2] += 1
        return False


def limit_log_rate(burst: int = 20, interval: float = 10.0) -> RateLimit:
    """Put one `RateLimit` on every handler the server's records reach (uvicorn's, the root
    logger's and logging's last resort) and on the loggers that write without uvicorn's
    handlers (asyncio: a failing accept() logs once per attempt)."""
    limit = RateLimit(burst, interval)
    names = ["", "uvicorn", "uvicorn.error", "asyncio", "mlx_spec.server"]
    handlers = {h for n in names for h in logging.getLogger(n).handlers}
    if logging.lastResort is not None:
        handlers.add(logging.lastResort)
    for handler in handlers:
        handler.addFilter(limit)
    for name in ("asyncio", "mlx_spec.server", "uvicorn.error"):
        logging.getLogger(name).addFilter(limit)
    return limit
