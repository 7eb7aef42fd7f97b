"""Connections that stall are closed (api/http_protocol.py), against a real server: a slowloris of 1,000
half-open connections is closed within the header timeout while another client is served, a body that
stops moving is cut off, a body that keeps moving slowly is not, and idle kept-alive connections close."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from tests.e2e.conftest import Server

TIMEOUT_S = 2.0
# How long after its timeout a connection may still be open: the loop's timer fires on time unless the
# loop is busy; 1,000 connections' timers and closes take well under this on two shared cores.
SLACK_S = 10.0
HALF_OPEN = 1000


@pytest.fixture(scope="module")
def server(start_module_server: Callable[..., Server]) -> Server:
    seconds = str(TIMEOUT_S)
    return start_module_server(
        "--http-header-timeout-s",
        seconds,
        "--http-body-idle-timeout-s",
        seconds,
        "--http-keep-alive-s",
        seconds,
    )


@contextmanager
def _connections(server: Server, count: int) -> Iterator[list[socket.socket]]:
    with ExitStack() as stack:
        sockets = []
        for _ in range(count):
            sock = stack.enter_context(socket.create_connection(("127.0.0.1", server.port), timeout=30))
            sockets.append(sock)
        yield sockets


def _read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes the connection; fails past `deadline`."""
    received = b""
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            pytest.fail(f"the connection was still open {SLACK_S} s past its timeout; got {received!r}")
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def test_a_thousand_half_open_connections_are_closed_while_another_client_is_served(server: Server) -> None:
    with _connections(server, HALF_OPEN) as sockets:
        for i, sock in enumerate(sockets):
            # Half a request: the request line and one header, then nothing (half the sockets send nothing).
            if i % 2:
                sock.sendall(b"POST /api/v1/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        started = time.monotonic()
        assert httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10).json()["status"] == "ok"
        deadline = started + TIMEOUT_S + SLACK_S
        answers = [_read_until_closed(sock, deadline) for sock in sockets]
    assert all(answer.startswith(b"HTTP/1.1 408 Request Timeout") for answer in answers)
    assert httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10).status_code == 200


def test_a_body_that_stops_moving_is_cut_off(server: Server) -> None:
    with _connections(server, 1) as (sock,):
        sock.sendall(
            b"POST /api/v1/create_session HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b'content-length: 1000\r\n\r\n{"tags": ['
        )
        answer = _read_until_closed(sock, time.monotonic() + TIMEOUT_S + SLACK_S)
    assert answer == b""  # no one is answered for a request that never arrived


def test_a_slow_body_that_keeps_moving_is_served(server: Server) -> None:
    """Three pieces 0.6 of the idle timeout apart: longer than the timeout in all, never idle past it."""
    body = b'{"tags": ["slow"], "user_metadata": {}}'
    head = (
        b"POST /api/v1/create_session HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"x-api-key: tml-local\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(body)
    )
    with _connections(server, 1) as (sock,):
        sock.sendall(head)
        for piece in (body[:10], body[10:20], body[20:]):
            time.sleep(0.6 * TIMEOUT_S)
            sock.sendall(piece)
        answer = _read_until_closed(sock, time.monotonic() + SLACK_S)
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:200]
    assert b'"session_id"' in answer


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(server: Server) -> None:
    with _connections(server, 1) as (sock,):
        sock.sendall(b"GET /api/v1/healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = _read_until_closed(sock, time.monotonic() + TIMEOUT_S + SLACK_S)
    assert answer.startswith(b"HTTP/1.1 200 OK") and b'{"status":"ok",' in answer
