"""The one helper the trainer, the policy workers and the retriever share for local networking.

A rendezvous port is published to other processes before its server starts. `free_port` only says a port
was free a moment ago (another process may bind it before the server does); `listening_socket` holds the
port from the moment it is picked, so whoever serves it takes over that socket and no race remains.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the OS picks it; a race with other binders remains)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def listening_socket(host: str = "127.0.0.1") -> socket.socket:
    """A socket on `host`, bound to a port the OS picked and already listening (its port: `getsockname()[1]`).

    Clients that connect before the server takes the socket over wait in its backlog instead of failing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def rehold(held: socket.socket | None, host: str) -> socket.socket:
    """A freshly held port on `host` (`listening_socket`); `held`, an earlier one nobody served, is closed."""
    if held is not None:
        held.close()
    return listening_socket(host)


def claim_held(sock: socket.socket | None, port: int | None, serves: bool) -> socket.socket | None:
    """The socket held for a rendezvous, if this process serves that rendezvous on it (`serves`: it is rank 0,
    and the port the ranks were told is the socket's); otherwise the socket is closed and None returned."""
    if sock is not None and (not serves or sock.getsockname()[1] != port):
        sock.close()
        return None
    return sock
