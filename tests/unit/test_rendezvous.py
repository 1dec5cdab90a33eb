"""The local launcher's rendezvous: a port the launcher holds from before any rank starts."""

from __future__ import annotations

import errno
import socket

import pytest

from megarl.distributed.launcher import rendezvous_store


def test_the_launchers_store_holds_its_port_so_no_other_process_can_take_it():
    store = rendezvous_store()
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other,
        pytest.raises(OSError) as taken,
    ):
        other.bind(("127.0.0.1", store.port))
    assert taken.value.errno == errno.EADDRINUSE
    store.set("rank 0 was here", "1")  # and it serves
    assert store.get("rank 0 was here") == b"1"
