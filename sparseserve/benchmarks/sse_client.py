"""The load generator's HTTP client: one HTTP/1.1 connection per request (asyncio streams), a JSON
POST, and the server-sent events of the answer as they arrive.

A general-purpose client (httpx: h11, httpcore, anyio) costs tens of microseconds of the load
generator's CPU per streamed event; with hundreds of streams and tens of thousands of tokens a
second in one process that alone would set the pace. This one reads whatever bytes have arrived,
undoes the chunked framing and splits the events with a few bytes operations.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit


class HTTPStatusError(RuntimeError):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body.decode(errors='replace')[:200]}")
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    path: str  # the request target, e.g. /v1/completions

    @classmethod
    def from_url(cls, base_url: str, path: str) -> Endpoint:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--base-url must be an http:// URL with a host (the load generator speaks plain "
                             f"HTTP/1.1), got {base_url!r}")
        return cls(parts.hostname, parts.port or 80, parts.path.rstrip("/") + path)


def _request_head(ep: Endpoint, body_len: int, headers: dict[str, str]) -> bytes:
    lines = [f"POST {ep.path} HTTP/1.1", f"Host: {ep.host}:{ep.port}", "Content-Type: application/json",
             f"Content-Length: {body_len}", "Accept: text/event-stream", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Body:
    """The response body as it arrives: chunked framing undone, or read to the end of the connection."""

    def __init__(self, reader: asyncio.StreamReader, chunked: bool, length: int | None) -> None:
        self.reader, self.chunked, self.remaining = reader, chunked, length
        self.raw = bytearray()
        self.chunk_left = -1  # bytes of the current chunk still to come; -1: a size line next; -2: a CRLF
        self.done = False

    async def read(self) -> bytes:
        """The next decoded bytes (b"" at the end)."""
        while not self.done:
            data = await self.reader.read(1 << 16)
            if not data:
                self.done = True
                return bytes(self.raw) if not self.chunked else b""
            if not self.chunked:
                if self.remaining is not None:
                    self.remaining -= len(data)
                    self.done = self.remaining <= 0
                return data
            self.raw += data
            out = self._unchunk()
            if out:
                return out
        return b""

    def _unchunk(self) -> bytes:
        raw, out = self.raw, bytearray()
        while True:
            if self.chunk_left == -2:  # a chunk's data ended: its CRLF is next
                if len(raw) < 2:
                    break
                del raw[:2]
                self.chunk_left = -1
            if self.chunk_left == -1:  # a size line is next
                end = raw.find(b"\r\n")
                if end < 0:
                    break
                size = int(bytes(raw[:end]).split(b";", 1)[0], 16)
                del raw[:end + 2]
                if size == 0:
                    self.done = True
                    break
                self.chunk_left = size
            if not raw:
                break
            take = min(self.chunk_left, len(raw))
            out += raw[:take]
            del raw[:take]
            self.chunk_left -= take
            if self.chunk_left:
                break
            self.chunk_left = -2
        return bytes(out)


async def stream_events(ep: Endpoint, payload: dict, headers: dict[str, str]) -> AsyncIterator[list[bytes]]:
    """POST `payload` as JSON; yields, per read from the socket, the `data:` payloads of the events
    that read completed (raises `HTTPStatusError` for a status other than 200)."""
    body = json.dumps(payload).encode()
    reader, writer = await asyncio.open_connection(ep.host, ep.port)
    try:
        writer.write(_request_head(ep, len(body), headers) + body)
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        fields = {}
        for line in header_lines:
            if ":" in line:
                k, v = line.split(":", 1)
                fields[k.strip().lower()] = v.strip()
        chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        length = int(fields["content-length"]) if "content-length" in fields else None
        data = _Body(reader, chunked, length)
        if status != 200:
            rest = bytearray()
            while piece := await data.read():
                rest += piece
            raise HTTPStatusError(status, bytes(rest))
        pending = b""
        while piece := await data.read():
            pending += piece
            *events, pending = pending.split(b"\n\n")
            if events:
                yield [line[6:] for ev in events for line in ev.split(b"\n") if line.startswith(b"data: ")]
    finally:
        writer.close()
