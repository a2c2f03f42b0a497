"""Addresses of registries and ports on this host: parsed, never matched by prefix.

Standard library only: options checks SPARKBUILD_REGISTRY with it, sign and verify use it, and none
of them needs the registry client (requests, tenacity) for that.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import socket
from urllib.parse import urlsplit

from sparkbuild.errors import ConfigError


def split_host(address: str) -> tuple[str, int | None]:
    """``host[:port]`` (``[::1]:5000`` too) -> (host name or address, port); refuses anything else."""
    try:
        parts = urlsplit(f"//{address}")
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or parts.path or parts.query or parts.username or not re.fullmatch(r"[A-Za-z0-9.\-:\[\]]+", address):
        raise ConfigError(f"registry '{address}': expected HOST or HOST:PORT, like 127.0.0.1:5000 or registry.example.com")
    return host, port


def is_loopback(address: str) -> bool:
    """True for a loopback IP address (127.0.0.0/8, ::1) or the name ``localhost`` itself: parsed, so
    ``127.0.0.1.nip.io`` and ``localhost.evil.example`` are not."""
    host, _ = split_host(address)
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(address: str) -> str:
    """``host[:port]`` of a registry, from the command line or SPARKBUILD_REGISTRY; a scheme may be
    given, but plain HTTP only for loopback."""
    scheme, _, rest = address.rpartition("://")
    host = rest.rstrip("/")
    split_host(host)
    if scheme not in ("", "http", "https"):
        raise ConfigError(f"registry '{address}': the scheme is http:// or https://")
    if scheme == "http" and not is_loopback(host):
        raise ConfigError(f"registry '{address}': plain HTTP only to a loopback address; drop http:// to use HTTPS")
    return host


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` free ports, all different: each socket is held until every port is chosen (ports asked
    one at a time may come back twice, as the kernel hands a freed port out again)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
