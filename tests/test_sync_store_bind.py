"""The trainer's weight-sync store listens on the sync address only (issue 39 case 10).

Bug caught: rank 0 of an update group (the trainer's source) hosts the group's TCPStore, and torch's master
binds the wildcard address (`::`, every interface, no authentication) even with a loopback
`--rollout.sync_addr`. `transports.master_store` hands torch a socket bound to the address itself. The test
reads the listening sockets back from /proc/net/tcp{,6} (Linux), by port.
Run: pytest tests/test_sync_store_bind.py -q
"""
from __future__ import annotations

import ipaddress
import os
import socket

import pytest

from nanoflash.sglang.transports import join_group, leave_group
from conftest import free_port

LISTEN = "0A"   # TCP_LISTEN in /proc/net/tcp's st column


def listening(port: int) -> set:
    """Addresses with a listening TCP socket on `port`, from /proc/net/tcp and tcp6."""
    out = set()
    for name, width in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/net/{name}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                addr, p = fields[1].split(":")
                if fields[3] == LISTEN and int(p, 16) == port:
                    raw = bytes.fromhex(addr)   # the kernel prints each 32-bit word in host (little-endian) order
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width, 4))
                    out.add(str(ipaddress.ip_address(raw)))
    return out


def lan_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))   # TEST-NET-1: a route is picked, no packet leaves
            return None if s.getsockname()[0].startswith("127.") else s.getsockname()[0]
        except OSError:
            return None


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_the_group_store_binds_the_sync_address_not_every_interface():
    for host in ("127.0.0.1", lan_address()):
        if host is None:
            continue
        port = free_port()
        pg, store = join_group(host, port, 0, 1, f"bind-{port}", "gloo", timeout_s=30, register=False)
        try:
            assert listening(port) == {host}, (host, listening(port))   # the bug: {'::'}
            store.set("k", "v")
            assert store.get("k") == b"v"                                # and it serves
        finally:
            leave_group(pg)
            del store
