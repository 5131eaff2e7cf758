"""A launch's rendezvous port (memtrain.train.ports): never one the kernel can hand an outgoing connection."""
import socket

from memtrain.train.ports import LOWEST, ephemeral_start, free_port


def test_free_ports_lie_below_the_ephemeral_range_with_room_and_are_free():
    low = ephemeral_start()
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:  # read here, not through the code under test
        assert low == int(f.read().split()[0])
    ports = [free_port() for _ in range(20)]
    assert all(LOWEST <= p <= low - 64 for p in ports), ports
    assert len(set(ports)) > 1  # drawn, not one fixed port that two launches side by side would share
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_in_use_is_not_handed_out():
    taken = []
    try:
        for port in range(LOWEST, LOWEST + 2000):  # hold a block of the range, then draw many times
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        assert not held & {free_port() for _ in range(200)}
    finally:
        for s in taken:
            s.close()
