"""HTTP/1.1 requests written byte for byte on a socket: the path exactly as given (no client
normalises it), and a body that can be declared and never sent."""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass
from typing import Any

# Long enough for a loaded 2-core machine; a server that waits for a body never sent blows it.
ANSWER_WITHIN_S = 20.0


@dataclass(frozen=True)
class RawAnswer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(port: int, head: str, timeout: float = ANSWER_WITHIN_S) -> RawAnswer:
    """Send ``head`` (request line and headers, no final blank line) to 127.0.0.1:``port``
    and nothing after it; the answer, or AssertionError if none comes within ``timeout``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n\r\n")
        response = http.client.HTTPResponse(sock, method=head.split(" ", 1)[0])
        try:
            response.begin()
            body = response.read()
        except TimeoutError:
            first = head.splitlines()[0]
            raise AssertionError(f"no answer within {timeout} s to {first!r}") from None
        return RawAnswer(response.status, body)
