"""A fault injector: an HTTP proxy on loopback (127.0.0.1, never another interface) in front of a real
server, the registry or the Docker engine's socket. It is a test tool, not part of sparkbuild.

Each request gets its own upstream connection (``Connection: close`` is added), so every request is
seen. A rule that matches a request answers it with a status (500, 503, 429 with Retry-After, ...),
resets the connection, stalls it (reads nothing, answers nothing), or holds it at a gate until the
test has done something at that moment (kill -9, SIGINT) and lets it go on. Everything else is
forwarded byte for byte. ``injected`` counts faults per kind, ``seen`` lists every request.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["status", "reset", "stall", "gate"]
REASONS = {
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    408: "Request Timeout",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


@dataclass
class Rule:
    """Fault requests whose method and path match (``agent`` narrows to a User-Agent substring)."""

    kind: Kind
    path: str = ".*"
    method: str | None = None
    agent: str | None = None
    status: int = 503
    headers: dict[str, str] = field(default_factory=dict)
    times: int = 1  # how many matching requests to fault; -1: all
    probability: float = 1.0
    # For "gate": once released, drop the request instead of forwarding it (its client was killed).
    drop: bool = False
    # For "gate": set when a request arrives; the request waits until ``release`` is set.
    arrived: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def matches(self, method: str, path: str, agent: str) -> bool:
        return (
            self.times != 0
            and (self.method is None or self.method == method)
            and re.search(self.path, path) is not None
            and (self.agent is None or self.agent in agent)
        )

    @property
    def name(self) -> str:
        return f"{self.status}" if self.kind == "status" else self.kind


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    agent: str
    fault: str | None


class FaultProxy:
    """``FaultProxy(("127.0.0.1", 5000))`` or ``FaultProxy("/var/run/docker.sock")``; ``address`` is its host:port."""

    def __init__(self, upstream: tuple[str, int] | str, seed: int = 17) -> None:
        self.upstream = upstream
        self.rules: list[Rule] = []
        self.injected: Counter[str] = Counter()
        self.seen: list[Seen] = []
        self.rng = random.Random(seed)
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._closed = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            for rule in self.rules:
                rule.release.set()
            self.rules = []

    def close(self) -> None:
        self._closed.set()
        self.clear()
        self._server.close()
        with self._lock:
            for sock in self._open:
                _close(sock)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the proxy ---------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with self._lock:
            self._open.append(client)
        try:
            head = _read_head(client)
            if head is None:
                return
            method, path, headers = _parse(head)
            rule = self._pick(method, path, headers.get("user-agent", ""))
            self.seen.append(Seen(method, path, headers.get("user-agent", ""), rule.name if rule else None))
            if rule is not None and rule.kind != "gate":
                self.injected[rule.name] += 1
                self._fault(client, rule, headers)
                return
            if rule is not None:
                self.injected["gate"] += 1
                rule.arrived.set()
                while not rule.release.wait(0.1) and not self._closed.is_set():
                    pass
                if rule.drop:
                    return
            self._forward(client, head)
        except OSError:
            pass
        finally:
            _close(client)

    def _pick(self, method: str, path: str, agent: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path, agent) and self.rng.random() < rule.probability:
                    if rule.times > 0:
                        rule.times -= 1
                    return rule
        return None

    def _fault(self, client: socket.socket, rule: Rule, headers: dict[str, str]) -> None:
        if rule.kind == "reset":
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        if rule.kind == "stall":
            while not self._closed.wait(0.2):
                pass
            return
        _drain(client, headers)
        extra = "".join(f"{k}: {v}\r\n" for k, v in rule.headers.items())
        reason = REASONS.get(rule.status, "Fault")
        client.sendall(f"HTTP/1.1 {rule.status} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n{extra}\r\n".encode())

    def _forward(self, client: socket.socket, head: bytes) -> None:
        if isinstance(self.upstream, str):
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.upstream)
        else:
            upstream = socket.create_connection(self.upstream)
        with self._lock:
            self._open.append(upstream)
        try:
            upstream.sendall(_one_request(head))
            pump = threading.Thread(target=_pipe, args=(client, upstream), daemon=True)
            pump.start()
            _pipe(upstream, client)
            pump.join(timeout=1)
        finally:
            _close(upstream)


def _read_head(sock: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk or data + chunk[:1] == b"\x16":
            # Closed, or a TLS handshake: the daemon tries HTTPS first; fail it at once, as the
            # plain-HTTP registry behind does, so it goes on over HTTP.
            return None
        data += chunk
        if len(data) > 1 << 20:
            return None
    return data


def _parse(head: bytes) -> tuple[str, str, dict[str, str]]:
    text = head.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    request, *lines = text.split("\r\n")
    method, path, _ = request.split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return method, path, headers


def _one_request(head: bytes) -> bytes:
    """The same request with ``Connection: close``: the upstream answers it and closes, so the next
    request comes on a new connection and is seen too."""
    top, sep, rest = head.partition(b"\r\n\r\n")
    lines = [line for line in top.split(b"\r\n") if not line.lower().startswith(b"connection:")]
    return b"\r\n".join([*lines, b"Connection: close"]) + sep + rest


def _drain(sock: socket.socket, headers: dict[str, str]) -> None:
    """Read what the client is sending, so answering early does not turn into a reset."""
    length = int(headers.get("content-length", "0") or 0)
    sock.settimeout(0.2)
    try:
        while length > 0 or headers.get("transfer-encoding") == "chunked":
            chunk = sock.recv(min(65536, max(length, 65536)))
            if not chunk:
                break
            length -= len(chunk)
    except OSError:
        pass
    sock.settimeout(None)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(65536):
            sink.sendall(chunk)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def wait_for(event: threading.Event, what: str, timeout: float = 120) -> None:
    if not event.wait(timeout):
        raise AssertionError(f"{what} did not happen within {timeout}s")
