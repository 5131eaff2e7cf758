"""What gloo needs of this host before the ranks meet: enough open files, and an address the other nodes can reach.

memtrain's stop agreement (memtrain.train.signals) runs on a gloo group beside NCCL, and a CPU run is all gloo.
gloo connects every rank to every other rank of a group (a socket per peer and group), so near a thousand ranks a
rank needs more descriptors than the usual soft limit of 1024; and gloo listens on the address this host's name
resolves to, which on many images is 127.0.1.1: other nodes cannot reach it, and the first collective across
nodes hangs until the collective timeout.
"""
from __future__ import annotations

import os
from typing import Optional
import resource
import socket

from memtrain.errors import NodeError
from memtrain.train.node import agent_ranks

FILES_PER_PEER = 4  # gloo's sockets per peer and group (main and side group, a pair each), with room
FILES_BESIDE = 1024  # what the rest of a rank opens: libraries, data files, checkpoint shards, pipes


def open_files_needed(world: int) -> int:
    return FILES_PER_PEER * world + FILES_BESIDE


def raise_open_files_limit(world: int) -> Optional[str]:
    """Raise this process's soft limit on open files to what gloo needs for `world` ranks (up to the hard limit, which
    needs no privilege); a warning where even the hard limit is short."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = open_files_needed(world)
    if soft >= needed or soft == resource.RLIM_INFINITY:
        return None
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed if hard == resource.RLIM_INFINITY else min(needed, hard), hard))
    if hard != resource.RLIM_INFINITY and hard < needed:
        return (f"open files: {world} ranks need about {needed} descriptors each (gloo: a socket per peer and group), "
                f"the hard limit here is {hard} (ulimit -Hn); raise it (limits.conf, or Slurm's PropagateResourceLimits)")
    return None


def check_reachable(world: int, ranks_here: int, hostname: str, address: str, master: str, env=os.environ) -> None:
    """One line where the ranks span nodes and this host's name resolves to a loopback `address` (gloo would listen
    where no other node can connect) with no GLOO_SOCKET_IFNAME naming the interface to use. A job whose rendezvous
    (`master`: MASTER_ADDR, resolved) is itself on loopback runs on this host alone, however many agents it has."""
    if world <= ranks_here or "GLOO_SOCKET_IFNAME" in env or not address.startswith("127.") or \
            master.startswith("127."):
        return
    raise NodeError(f"GLOO_SOCKET_IFNAME: this host's name '{hostname}' resolves to {address} (loopback), where gloo "
                    f"would listen and the other nodes of this {world}-rank job could not connect (the first collective "
                    "would hang until train.collective_timeout_s); set GLOO_SOCKET_IFNAME to the network interface "
                    "the nodes share (e.g. eth0, ib0), or fix the host name's entry in /etc/hosts")


def prepare(world: int) -> Optional[str]:
    """Both, for this rank, before the rendezvous; returns a warning line or None."""
    def resolved(name: str) -> str:
        try:
            return socket.gethostbyname(name)
        except OSError:
            return ""

    hostname = socket.gethostname()
    check_reachable(world, agent_ranks(world), hostname, resolved(hostname),
                    resolved(os.environ.get("MASTER_ADDR", "127.0.0.1")))
    return raise_open_files_limit(world)
