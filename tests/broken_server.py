"""A server on 127.0.0.1 that answers every request with HTTP 500, for the tests of a Hub that fails."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Broken(BaseHTTPRequestHandler):
    """Every request answered with HTTP 500."""

    def do_GET(self):
        self.send_response(500)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_POST = do_HEAD = do_GET

    def log_message(self, *a):
        pass


@contextlib.contextmanager
def broken_server() -> Iterator[str]:
    """`with broken_server() as url:` a server on 127.0.0.1 that answers every request with HTTP 500."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
