"""The address a push source gives the servers for the update group (`sglang.push.source_host`).

Bug caught (issue 37): the source named itself by `gethostbyname(gethostname())`, which a default Debian
/etc/hosts maps to 127.0.1.1: servers on another node connect to their own loopback and the group's
rendezvous hangs until its timeout. The address must be this host's end of the route to the servers.
"""
from __future__ import annotations

import socket

import pytest

from nanoflash.sglang import push


class _RouteStub:
    """A UDP socket whose local end depends on the peer connected to (two interfaces, as a stub)."""
    ROUTES = {"10.1.2.3": "10.1.0.7", "192.168.5.9": "192.168.5.1"}

    def __init__(self, family, kind):
        self.peer = None

    def connect(self, addr):
        self.peer = addr

    def getsockname(self):
        return (self.ROUTES[self.peer[0]], 40000)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_source_host_is_the_local_end_of_the_route_to_the_servers(monkeypatch):
    monkeypatch.delenv("NANOFLASH_SYNC_HOST", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer-0")
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")   # Debian's default /etc/hosts
    monkeypatch.setattr(push.socket, "socket", _RouteStub)
    assert push.source_host("0.0.0.0", ["http://10.1.2.3:30000"]) == "10.1.0.7"
    assert push.source_host("0.0.0.0", ["http://192.168.5.9:30000", "http://10.1.2.3:30000"]) == "192.168.5.1"
    monkeypatch.setenv("NANOFLASH_SYNC_HOST", "172.16.0.4")                 # named explicitly: it wins
    assert push.source_host("0.0.0.0", ["http://10.1.2.3:30000"]) == "172.16.0.4"


def test_loopback_stays_loopback_and_no_route_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("NANOFLASH_SYNC_HOST", raising=False)
    assert push.source_host("127.0.0.1", ["http://10.1.2.3:30000"]) == "127.0.0.1"
    assert push.route_address("http://127.0.0.1:30000") == "127.0.0.1"      # the real socket, no packet sent
    with pytest.raises(ValueError, match="NANOFLASH_SYNC_HOST"):
        push.source_host("0.0.0.0", [])
