"""Things on 127.0.0.1 that answer, or do not, as a Ray head would not: for the network checks' tests.

Every one listens on loopback only, on a port the kernel picks, and is closed at the end of its block.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

#: An HTTP/2 SETTINGS frame, empty: the first thing a gRPC server sends.
SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
HTTP1 = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A port of 127.0.0.1 that refuses connections: bound (so nothing else takes it) and never listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


@contextlib.contextmanager
def listening(kind: str) -> Iterator[int]:
    """A port of 127.0.0.1 whose listener, once connected:
    silent: accepts and never says anything; http: answers as an HTTP/1 server and closes; close: closes at once;
    grpc: sends an HTTP/2 SETTINGS frame as a gRPC server does, then reads and never answers (no Ray head)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    kept: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (TimeoutError, OSError):
                continue
            try:
                if kind == "http":
                    conn.recv(4096)
                    conn.sendall(HTTP1)
                elif kind == "grpc":
                    conn.sendall(SETTINGS)
                if kind in ("http", "close"):
                    conn.close()
                else:
                    kept.append(conn)  # open and quiet until the block ends
            except OSError:
                conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in kept:
            conn.close()
        server.close()
