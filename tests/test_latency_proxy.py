"""Tests for benchmarks/latency_proxy.py: delayed, pipelined, order-preserving TCP proxying."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from benchmarks import latency_proxy as lp

pytestmark = [pytest.mark.component, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[1]
# The proxy's one timing promise is a lower bound: a byte is never forwarded before its delay.
# Load only lengthens a round trip, so the tests assert that bound (and order and content),
# never an upper one; how close to the delay the proxy stays is for benchmarks/.
DELAY_S = 0.050
RTT_S = 2 * DELAY_S


class EchoServer:
    """asyncio echo server on 127.0.0.1 that records how each connection ended."""

    def __init__(self, hold: int = 0) -> None:
        self.hold = hold  # echo nothing until this many bytes have come (then all of them)
        self.received = bytearray()
        self.eof_seen = asyncio.Event()
        self.reset_seen = asyncio.Event()
        self.ended = asyncio.Event()
        self.eof_at = 0.0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.received += data
                if len(self.received) < self.hold:
                    continue
                if self.hold:
                    data, self.hold = bytes(self.received), 0
                writer.write(data)
                await writer.drain()
            self.eof_at = time.perf_counter()
            self.eof_seen.set()
        except ConnectionError:
            self.reset_seen.set()
        finally:
            self.ended.set()
            writer.close()


async def _with_proxy(
    body: Callable[[EchoServer, lp.LatencyProxy], Awaitable[None]],
    delay_s: float = DELAY_S,
    hold: int = 0,
) -> None:
    echo = EchoServer(hold)
    echo_port = await echo.start()
    proxy = lp.LatencyProxy("127.0.0.1", 0, "127.0.0.1", echo_port, delay_s)
    await proxy.start()
    try:
        await asyncio.wait_for(body(echo, proxy), 60)  # a hang guard
    finally:
        await proxy.close()
        await echo.close()


async def _connect(proxy: lp.LatencyProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return reader, writer


async def _wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.perf_counter() + timeout
    while not cond():
        assert time.perf_counter() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_round_trip_takes_twice_the_delay() -> None:
    rtts: list[float] = []

    async def body(echo: EchoServer, proxy: lp.LatencyProxy) -> None:
        reader, writer = await _connect(proxy)
        for i in range(3):
            msg = f"ping-{i}".encode()
            t0 = time.perf_counter()
            writer.write(msg)
            assert await reader.readexactly(len(msg)) == msg
            rtts.append(time.perf_counter() - t0)
        writer.close()

    asyncio.run(_with_proxy(body))
    print(f"round trips: {[f'{r * 1e3:.1f} ms' for r in rtts]}")
    assert all(r >= RTT_S for r in rtts), rtts


def test_pipelining_no_stop_and_wait() -> None:
    """The proxy forwards each message without waiting for the reply to the one before: the
    echo server here answers nothing until it has all of them, so a stop-and-wait proxy would
    never deliver the second one (and the hang guard would end the test)."""
    n, gap = 20, 0.005
    message = lambda i: b"msg-%04d" % i  # noqa: E731
    sent: list[float] = []
    arrived: list[float] = []

    async def body(echo: EchoServer, proxy: lp.LatencyProxy) -> None:
        reader, writer = await _connect(proxy)

        async def read_all() -> None:
            for i in range(n):
                assert await reader.readexactly(8) == message(i)  # in order
                arrived.append(time.perf_counter())

        read_task = asyncio.create_task(read_all())
        for i in range(n):  # never waits for an echo before sending the next message
            sent.append(time.perf_counter())
            writer.write(message(i))
            await asyncio.sleep(gap)  # separate reads at the proxy, not one chunk
        await read_task
        assert bytes(echo.received) == b"".join(message(i) for i in range(n))
        writer.close()

    asyncio.run(_with_proxy(body, hold=n * 8))
    rtts = [a - s for s, a in zip(sent, arrived, strict=True)]
    print(f"pipelined {n} msgs: per-message rtt {min(rtts) * 1e3:.1f}..{max(rtts) * 1e3:.1f} ms")
    # each reply left the echo server after the last message reached it: the last message's
    # round trip is still at least the delay both ways
    assert rtts[-1] >= RTT_S, rtts


def test_one_megabyte_intact_and_counted() -> None:
    payload = random.Random(1234).randbytes(1 << 20)
    elapsed = [0.0]

    async def body(echo: EchoServer, proxy: lp.LatencyProxy) -> None:
        reader, writer = await _connect(proxy)

        async def send() -> None:
            for off in range(0, len(payload), 64 * 1024):
                writer.write(payload[off : off + 64 * 1024])
                await writer.drain()

        t0 = time.perf_counter()
        _, got = await asyncio.gather(send(), reader.readexactly(len(payload)))
        elapsed[0] = time.perf_counter() - t0
        assert got == payload
        assert echo.received == payload
        assert proxy.bytes_forwarded == {"up": len(payload), "down": len(payload)}
        writer.close()

    asyncio.run(_with_proxy(body))
    print(f"1 MiB echoed through the proxy in {elapsed[0] * 1e3:.1f} ms")


def test_client_close_flushes_then_closes_upstream() -> None:
    timing: dict[str, float] = {}

    async def body(echo: EchoServer, proxy: lp.LatencyProxy) -> None:
        _, writer = await _connect(proxy)
        await _wait_until(lambda: proxy.active_connections == 1)
        writer.write(b"last words")
        t0 = time.perf_counter()
        writer.close()
        await asyncio.wait_for(echo.eof_seen.wait(), 20)
        timing["eof"] = echo.eof_at - t0
        assert bytes(echo.received) == b"last words"  # in-flight data delivered before EOF
        await _wait_until(lambda: proxy.active_connections == 0)
        timing["closed"] = time.perf_counter() - t0

    asyncio.run(_with_proxy(body))
    print(
        f"upstream EOF {timing['eof'] * 1e3:.1f} ms after client close, "
        f"proxy connection gone after {timing['closed'] * 1e3:.1f} ms"
    )
    assert timing["eof"] >= DELAY_S  # the close is forwarded after the data, delayed as it


def test_half_close_keeps_other_direction_open() -> None:
    async def body(echo: EchoServer, proxy: lp.LatencyProxy) -> None:
        reader, writer = await _connect(proxy)
        writer.write(b"abc")
        writer.write_eof()  # half-close: we can still read the echo
        assert await asyncio.wait_for(reader.read(), 20) == b"abc"  # data, then EOF
        assert echo.eof_seen.is_set()
        await _wait_until(lambda: proxy.active_connections == 0)
        writer.close()

    asyncio.run(_with_proxy(body))


def test_client_reset_closes_upstream() -> None:
    async def body(echo: EchoServer, proxy: lp.LatencyProxy) -> None:
        reader, writer = await _connect(proxy)
        writer.write(b"x")
        assert await reader.readexactly(1) == b"x"
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        writer.transport.abort()  # close with linger 0: sends RST
        await asyncio.wait_for(echo.ended.wait(), 20)
        await _wait_until(lambda: proxy.active_connections == 0)

    asyncio.run(_with_proxy(body))


def test_unreachable_target_closes_client() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nothing listens here once closed

    async def main() -> None:
        proxy = lp.LatencyProxy("127.0.0.1", 0, "127.0.0.1", dead_port, DELAY_S)
        await proxy.start()
        try:
            reader, writer = await _connect(proxy)
            with contextlib.suppress(ConnectionError):  # EOF or reset are both fine
                assert await asyncio.wait_for(reader.read(), 20) == b""
            writer.close()
            await _wait_until(lambda: proxy.active_connections == 0)
        finally:
            await proxy.close()

    asyncio.run(main())


def _blocking_echo_server() -> tuple[int, Callable[[], None]]:
    """A thread-based echo server (no asyncio) for the synchronous tests."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)
    stopping = threading.Event()

    def serve_conn(conn: socket.socket) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept_loop() -> None:
        while not stopping.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=serve_conn, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()

    def stop() -> None:
        stopping.set()
        thread.join(2)
        srv.close()

    return srv.getsockname()[1], stop


def _blocking_round_trip(port: int, msg: bytes) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sock.sendall(msg)
        got = b""
        while len(got) < len(msg):
            chunk = sock.recv(65536)
            assert chunk, "connection closed early"
            got += chunk
        rtt = time.perf_counter() - t0
        assert got == msg
    return rtt


def test_start_in_thread_with_blocking_client() -> None:
    echo_port, stop_echo = _blocking_echo_server()
    proxy, stop = lp.start_in_thread("127.0.0.1", 0, "127.0.0.1", echo_port, DELAY_S)
    try:
        rtt = _blocking_round_trip(proxy.port, b"hello from a blocking socket")
        print(f"start_in_thread round trip: {rtt * 1e3:.1f} ms")
        assert rtt >= RTT_S
        deadline = time.perf_counter() + 20  # a hang guard
        while proxy.bytes_forwarded["down"] < 28 and time.perf_counter() < deadline:
            time.sleep(0.005)
        assert proxy.bytes_forwarded == {"up": 28, "down": 28}
        port = proxy.port
    finally:
        stop()
        stop()  # idempotent
        stop_echo()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_cli_runs_until_sigterm() -> None:
    echo_port, stop_echo = _blocking_echo_server()
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "latency_proxy.py"),
        "--listen",
        "127.0.0.1:0",
        "--target",
        f"127.0.0.1:{echo_port}",
        "--delay-ms",
        "20",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert "latency proxy 127.0.0.1:" in banner, banner + proc.stderr.read()  # type: ignore[union-attr]
        port = int(banner.split()[2].rsplit(":", 1)[1].rstrip(","))
        rtt = _blocking_round_trip(port, b"via cli")
        assert rtt >= 0.040  # --delay-ms 20, both ways
        proc.terminate()
        out, err = proc.communicate(timeout=5)
        assert proc.returncode == 0, err
        assert "stopped: 1 connections" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_echo()


def test_parse_hostport() -> None:
    assert lp._parse_hostport("127.0.0.1:7001") == ("127.0.0.1", 7001)
    assert lp._parse_hostport("[::1]:7001") == ("::1", 7001)
    with pytest.raises(Exception, match="HOST:PORT"):
        lp._parse_hostport("7001")
