"""Read timeouts (``--read-timeout``): a request's head and its body each arrive within that many seconds, or 408.

uvicorn bounds neither: its keep-alive timer is armed only once a first response is complete, and every byte
received cancels it, so a head sent a byte every few seconds, or a body shorter than its Content-Length, held a
connection open for as long as the client liked. The head is bounded here by a subclass of uvicorn's h11
protocol (``uvicorn.Config(http=...)`` takes a protocol class; uvicorn is pinned, 0.54), the body by a deadline
around the app's read of it.
"""

from __future__ import annotations

import asyncio

import h11
from starlette.requests import Request
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvsieve.serve.errors import APIError

__all__ = ["DEFAULT_READ_TIMEOUT", "head_deadline_protocol", "read_body"]

DEFAULT_READ_TIMEOUT = 30.0  # seconds for a head, and again for a body: ample for 4 MiB at 1 Mbit/s


async def read_body(request: Request, seconds: float) -> bytes:
    """The whole body, or an APIError 408 (the connection closed after it) if it is not in after ``seconds``.
    A client that leaves meanwhile raises starlette's ClientDisconnect, as ``request.body()`` does."""
    chunks: list[bytes] = []
    received = 0

    async def read() -> None:
        nonlocal received
        async for chunk in request.stream():
            chunks.append(chunk)
            received += len(chunk)

    try:
        await asyncio.wait_for(read(), seconds)
    except TimeoutError:
        declared = request.headers.get("content-length")
        of = f"{received} of the {declared} bytes its Content-Length announced" if declared else f"{received} bytes"
        # the rest of the body may still come: the connection is closed rather than read as a next request
        raise APIError(408, f"the request body did not arrive within --read-timeout ({seconds:g} s): {of} came",
                       code="read_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


class _HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's head, from its first byte (or from the connection's
    opening) to its blank line: past it, a partial head is answered 408 and the connection closed; a connection
    that sent nothing is closed silently, as uvicorn's keep-alive timeout closes an idle one."""

    read_timeout: float = DEFAULT_READ_TIMEOUT
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # these bytes begin (or continue) a request's head
            self._arm()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is complete (or refused with 400)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why it is cut (h11 cannot, it saw no request)
            message = (f"the request head did not arrive within --read-timeout ({self.read_timeout:g} s)\n").encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(message), message))
        self.transport.close()


def head_deadline_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a ``seconds`` deadline on each request's head."""
    return type("HeadDeadlineProtocol", (_HeadDeadline,), {"read_timeout": seconds})
