"""listeners.py reads this process's listening sockets from /proc, with the
address each one is bound to, and the start-up log names them."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from vllm_hicache.storage.mooncake import listeners


def listen(family: int, address: str) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((address, 0))
    sock.listen()
    return sock


@pytest.mark.skipif(not os.path.exists("/proc/self/net/tcp"), reason="no /proc")
def test_listening_sockets_of_this_process_with_their_addresses():
    before = listeners.listening_sockets()
    socks = [listen(socket.AF_INET, "127.0.0.1"), listen(socket.AF_INET, "0.0.0.0")]
    if socket.has_ipv6:
        try:
            socks.append(listen(socket.AF_INET6, "::"))
        except OSError:  # no IPv6 here
            pass
    connected = socket.create_connection(socks[0].getsockname())  # not a listener
    try:
        opened = listeners.listening_sockets() - before
        expected = {(s.getsockname()[0], s.getsockname()[1]) for s in socks}
        assert opened == expected
        assert [listeners.is_wildcard(lst) for lst in sorted(opened)] == [
            lst[0] in ("0.0.0.0", "::") for lst in sorted(opened)]
    finally:
        connected.close()
        for s in socks:
            s.close()


def test_report_warns_about_every_interface(caplog):
    with caplog.at_level(logging.INFO, "vllm_hicache.storage.mooncake.listeners"):
        listeners.report({("0.0.0.0", 1234), ("::", 5678)}, "10.0.0.5", 4096)
        listeners.report(set(), "10.0.0.5", 4096)  # /proc unreadable: still said
        listeners.report({("127.0.0.1", 9)}, "127.0.0.1", 4096)
    first, second, third = caplog.records
    assert first.levelno == logging.WARNING and "0.0.0.0:1234, [::]:5678" in first.getMessage()
    assert "local_hostname=10.0.0.5" in first.getMessage() and "4096-byte" in first.getMessage()
    assert second.levelno == logging.WARNING and "ports not found" in second.getMessage()
    assert third.levelno == logging.INFO and "127.0.0.1:9" in third.getMessage()
