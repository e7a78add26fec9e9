"""An HTTP proxy on 127.0.0.1 between an S3 client and the S3 server of the tests that fails a given fraction of
requests: half of the failures an HTTP 503 (S3's ServiceUnavailable, as S3 answers when it sheds load), half a
connection reset before any answer. ``failed`` counts them; ``fraction`` may change while it runs."""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

_UNAVAILABLE = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


class FlakyProxy:
    def __init__(self, upstream: str, fraction: float, seed: int = 0) -> None:
        self.fraction = fraction
        self.failed = 0
        self.forwarded = 0
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        target = urlparse(upstream)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with proxy._lock:
                    fail = proxy._random.random() < proxy.fraction
                    reset = fail and proxy._random.random() < 0.5
                    if fail:
                        proxy.failed += 1
                    else:
                        proxy.forwarded += 1
                if reset:  # an RST instead of an answer
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                if fail:
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_UNAVAILABLE)))
                    self.end_headers()
                    if self.command != "HEAD":  # a HEAD's answer has no body
                        self.wfile.write(_UNAVAILABLE)
                    return
                upstream_connection = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                    upstream_connection.request(self.command, self.path, body=body, headers=headers)
                    reply = upstream_connection.getresponse()
                    data = reply.read()
                finally:
                    upstream_connection.close()
                self.send_response(reply.status, reply.reason)
                for key, value in reply.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                # A HEAD's length is the object's, not that of the (empty) body.
                length = reply.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FlakyProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.shutdown()
        self._server.server_close()
