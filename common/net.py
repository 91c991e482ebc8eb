"""The one probe of the network: whether anything accepts TCP connections at a host and port (a store
hosted there, a rendezvous endpoint), asked once or until a bound. Torch-free."""

from __future__ import annotations

import socket
import time

from common.clock import wait_until


def listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a connection at host:port within `timeout_s` (one try: a refused,
    unreachable or silent address is False). The connection is closed at once: a bare connection is
    harmless to a TCPStore."""
    try:
        socket.create_connection((host, port), timeout=max(timeout_s, 0.01)).close()
    except OSError:
        return False
    return True


def listening_at(where: str, timeout_s: float) -> bool:
    """`listening` at `where`, "host:port" (an IPv6 host in brackets); False for an address that does not parse."""
    host, _, port = where.rpartition(":")
    try:
        return listening(host.strip("[]"), int(port), timeout_s)
    except ValueError:
        return False


def wait_listening(host: str, port: int, timeout_s: float, interval_s: float = 0.01) -> bool:
    """Try `listening` every `interval_s` until something accepts a connection at host:port (True) or
    `timeout_s` has passed (False). Each try waits at most 1 s, and never past the bound."""
    deadline = time.monotonic() + timeout_s
    return wait_until(lambda: listening(host, port, min(1.0, deadline - time.monotonic())), timeout_s, interval_s)
