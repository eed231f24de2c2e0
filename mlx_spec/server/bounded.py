"""uvicorn's h11 protocol with a head timeout and a connection cap (see connections.py)."""

from __future__ import annotations

import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .connections import HEAD_TIMEOUT

REFUSED_LINGER = 2.0  # a refused connection is closed after this (its 503 is read meanwhile)
MAX_LINGERING = 64  # refused connections left open at once; past it one is closed at once
REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
)
REFUSAL_BODY = (
    b'{"error": {"message": "too many open connections (--max-connections); retry later",'
    b' "type": "server_error", "param": null, "code": "too_many_connections"}}'
)
log = logging.getLogger("mlx_spec.server")


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a head timeout and a connection cap (module docstring).
    Configured by `bounded_protocol`."""

    lingering = 0  # refused connections still open, over the event loop (one per server)

    head_timeout: float = HEAD_TIMEOUT
    max_connections: int = 1024

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.head_timer = None
        self.refused = self.counted = False
        self.waiting_since = time.monotonic()
        if not self.make_room():
            self.refuse(transport)
            return
        super().connection_made(transport)
        self.arm()

    def make_room(self) -> bool:
        """Whether this connection may stay: below the cap, or the longest-waiting connection
        without a request head was closed for it."""
        live, oldest = 0, None
        for other in self.connections:
            if other.transport is None or other.transport.is_closing():
                continue
            live += 1
            if isinstance(other, BoundedH11) and other.waiting_for_head():
                if oldest is None or other.waiting_since < oldest.waiting_since:
                    oldest = other
        if live < self.max_connections:
            return True
        if oldest is None:
            return False
        oldest.transport.close()
        return True

    def refuse(self, transport) -> None:
        """A 503 now, then the socket closes (after REFUSED_LINGER, or when the client does):
        closing at once could reset the connection before the client reads the 503."""
        self.refused, self.transport = True, transport
        if BoundedH11.lingering >= MAX_LINGERING:  # a connect flood: no descriptor kept for it
            transport.abort()
            return
        transport.write(REFUSAL % (len(REFUSAL_BODY), REFUSAL_BODY))
        if transport.can_write_eof():
            transport.write_eof()
        BoundedH11.lingering += 1
        self.counted = True

        def close() -> None:
            self.release()
            transport.close()

        self.head_timer = self.loop.call_later(REFUSED_LINGER, close)

    def release(self) -> None:
        """A refused connection is closed: it no longer counts as lingering (once)."""
        if self.counted:
            self.counted = False
            BoundedH11.lingering -= 1
        log.warning(
            "refused a connection: %d are open (--max-connections %d)",
            len(self.connections),
            self.max_connections,
        )

    def waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def arm(self) -> None:
        """Start the head timer (a new connection, or a response just ended)."""
        self.disarm()
        self.waiting_since = time.monotonic()
        self.head_timer = self.loop.call_later(self.head_timeout, self.head_expired)

    def disarm(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def head_expired(self) -> None:
        self.head_timer = None
        if self.waiting_for_head():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is in: the request runs
            self.disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.arm()

    def eof_received(self) -> bool | None:
        if self.refused:
            self.transport.close()
            return None
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        self.disarm()
        if self.refused:
            self.release()
            return
        super().connection_lost(exc)

    def shutdown(self) -> None:
        self.disarm()
        super().shutdown()


def bounded_protocol(head_timeout: float, max_connections: int) -> type[BoundedH11]:
    """A `BoundedH11` class with these bounds (uvicorn.Config(http=...) takes a class)."""
    return type(
        "BoundedH11",
        (BoundedH11,),
        {"head_timeout": head_timeout, "max_connections": max_connections},
    )
