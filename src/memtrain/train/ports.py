"""A TCP port for a launch's rendezvous (MASTER_PORT): free now, and below the kernel's ephemeral port range."""
from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 20000  # above the ports services commonly listen on


def ephemeral_start() -> int:
    """The first port the kernel gives an outgoing connection as its source port (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(room: int = 64) -> int:
    """A port nothing is bound to now, with `room` ports above it that are below the ephemeral range too (a launch that
    runs several rendezvous one after another counts up from it).

    A port from bind(port 0) lies in the ephemeral range. Between that check and the launcher's bind, any outgoing
    connection can be given it as its source port, and the gloo ranks of a launch beside it open dozens. A rank then
    failed to reach its TCPStore ("connection reset by peer", seen in the test suite on 2026-11-27). The kernel never
    picks a source port below the range. Where the range starts too low for that, the kernel's choice as before."""
    top = ephemeral_start() - room
    draw = random.SystemRandom()
    for _ in range(200 if top > LOWEST else 0):
        port = draw.randrange(LOWEST, top)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
