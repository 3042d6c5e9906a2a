"""Rendezvous ports held from their pick on: no other process can bind them, and the servers that take the held
socket over (the CPU weight transport's gloo group, the policy's process group) meet their clients on it."""

from __future__ import annotations

import errno
import socket
import threading
import time

import pytest
import torch

from skyrl_mtp.net import claim_held, listening_socket, rehold


def test_a_held_port_cannot_be_taken_by_another_binder():
    sock = listening_socket()
    try:
        port = sock.getsockname()[1]
        with socket.socket() as rival, pytest.raises(OSError) as err:
            rival.bind(("127.0.0.1", port))
        assert err.value.errno == errno.EADDRINUSE
    finally:
        sock.close()


def test_cpu_transport_group_serves_on_the_held_socket_and_a_client_that_came_first_waits():
    from skyrl_mtp.weight_sync.cpu_transport import all_agree, broadcast, open_group

    sock = listening_socket()
    port = sock.getsockname()[1]
    got: dict[str, object] = {}

    def worker():
        group = open_group("127.0.0.1", port, 1, 2, timeout_s=30)
        t = torch.zeros(4)
        broadcast(group, t)
        got["tensor"], got["agree"] = t, all_agree(group, True)

    thread = threading.Thread(target=worker)
    thread.start()
    time.sleep(0.5)   # the worker connects before rank 0's store exists: it waits in the socket's backlog
    group = open_group("127.0.0.1", port, 0, 2, timeout_s=30, listen_socket=sock)
    broadcast(group, torch.arange(4.0))
    assert all_agree(group, True)
    thread.join(timeout=30)
    assert torch.equal(got["tensor"], torch.arange(4.0)) and got["agree"] is True


def test_a_held_socket_is_kept_only_by_the_rank_that_serves_its_port():
    assert claim_held(None, 1234, True) is None
    sock = listening_socket()
    port = sock.getsockname()[1]
    assert claim_held(sock, port, True) is sock
    sock.close()
    not_rank0 = listening_socket()
    assert claim_held(not_rank0, not_rank0.getsockname()[1], False) is None
    told_another_port = listening_socket()
    assert claim_held(told_another_port, told_another_port.getsockname()[1] + 1, True) is None
    assert not_rank0.fileno() == told_another_port.fileno() == -1   # closed: their ports are free again


def test_reholding_closes_the_unserved_socket_and_holds_a_new_port():
    first = rehold(None, "127.0.0.1")
    port = first.getsockname()[1]
    second = rehold(first, "127.0.0.1")
    try:
        assert first.fileno() == -1
        assert second.getsockname()[1] != 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", port))   # the first pick is free again
    finally:
        second.close()
