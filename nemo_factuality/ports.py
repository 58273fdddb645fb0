"""Free loopback ports for the servers a command starts on this machine (the lab's reward servers; Triton needs several
at once), and for the tests' and benchmarks' servers (``nemo_factuality.testing.ports`` re-exports it)."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that were free a moment ago (all bound together, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
