"""Latency-injecting TCP proxy for benchmarks (a user-space stand-in for ``tc netem delay``).

Every byte read from one side is written to the other side ``delay_s`` seconds after it was
read, in each direction independently. It is a pipe with latency, not a stop-and-wait relay:
while earlier chunks wait out their delay, later bytes keep being read and time-stamped, so
any number of chunks can be in flight and throughput is not bounded by the delay (only by
``max_inflight_bytes`` per direction, a memory cap: throughput <= cap / delay).

Per connection and direction there is a reader task, which reads chunks and queues them with
their due time (read time + delay), and a writer task, which sleeps until each chunk is due
and writes it (chunks due together are written as one batch). Byte order per direction is
preserved. TCP_NODELAY is set on both sockets (gRPC sends small frames).

Closing semantics:
  * EOF (FIN) from one side is forwarded as a half-close (``shutdown(SHUT_WR)``) to the other
    side after everything read before it has been delivered, i.e. also delayed. The other
    direction keeps working; the connection is closed once both directions have seen EOF.
  * A reset or read error on one side: the bytes already in flight from that side are still
    delivered, then both sockets are closed.
  * A write error (the destination is gone) stops that direction; the other direction ends
    when reading the dead socket fails, after delivering what it has in flight.
  * If the target cannot be reached, the client connection is closed.

Usage::

    pipeshard bench latency-proxy --listen 127.0.0.1:7001 --target 127.0.0.1:6001 \\
        --delay-ms 10

or from synchronous benchmark code::

    proxy, stop = start_in_thread("127.0.0.1", 0, "127.0.0.1", 6001, 0.010)
    ...  # connect to 127.0.0.1:proxy.port
    stop()
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["LatencyProxy", "delay_stages", "start_in_thread"]

log = logging.getLogger("latency_proxy")

_READ_SIZE = 256 * 1024
_DEFAULT_MAX_INFLIGHT = 64 * 1024 * 1024
_CLOSE_TIMEOUT_S = 2.0

Outcome = Literal["eof", "reset", "dst_broken"]


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    """Close a stream, flushing its buffer if the peer takes it; abort if it does not."""
    with contextlib.suppress(Exception):
        writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), _CLOSE_TIMEOUT_S)
    except asyncio.CancelledError:
        writer.transport.abort()
        raise
    except Exception:
        writer.transport.abort()


class _Direction:
    """One direction of one connection: src -> (delay) -> dst.

    The reader appends ``(due_time, chunk)`` to ``pending``; the chunk ``b""`` means EOF and
    ``None`` means the source failed. Both are the last entry the reader appends.
    """

    def __init__(
        self,
        proxy: LatencyProxy,
        name: str,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        delay_s: float,
    ) -> None:
        self.proxy = proxy
        self.name = name
        self.delay_s = delay_s
        self.src = src
        self.dst = dst
        self.pending: deque[tuple[float, bytes | None]] = deque()
        self.has_data = asyncio.Event()
        self.inflight = 0
        self.has_space = asyncio.Event()
        self.has_space.set()

    def _push(self, due: float, chunk: bytes | None) -> None:
        self.pending.append((due, chunk))
        self.has_data.set()

    async def read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self.delay_s
        limit = self.proxy.max_inflight_bytes
        while True:
            while self.inflight >= limit:
                self.has_space.clear()
                await self.has_space.wait()
            try:
                data = await self.src.read(_READ_SIZE)
            except OSError as exc:
                log.debug("%s: read failed: %r", self.name, exc)
                self._push(loop.time() + delay, None)
                return
            self._push(loop.time() + delay, data)
            if not data:  # EOF
                return
            self.inflight += len(data)

    async def write_loop(self) -> Outcome:
        loop = asyncio.get_running_loop()
        counters = self.proxy.bytes_forwarded
        try:
            while True:
                while not self.pending:
                    self.has_data.clear()
                    await self.has_data.wait()
                wait = self.pending[0][0] - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                # Write every chunk that is due now, then drain once.
                now = loop.time()
                while self.pending and self.pending[0][0] <= now:
                    _, chunk = self.pending.popleft()
                    if chunk is None:
                        await self.dst.drain()
                        return "reset"
                    if not chunk:
                        if self.dst.can_write_eof():
                            self.dst.write_eof()
                        return "eof"
                    self.inflight -= len(chunk)
                    counters[self.name] += len(chunk)
                    self.dst.write(chunk)
                self.has_space.set()
                await self.dst.drain()
        except (OSError, RuntimeError) as exc:
            log.debug("%s: write failed: %r", self.name, exc)
            return "dst_broken"
        finally:
            self.has_space.set()


class LatencyProxy:
    """TCP proxy adding a fixed one-way delay in each direction (see module docstring).

    ``delay_s`` delays client -> target, ``down_delay_s`` (default: the same) target -> client.
    ``bytes_forwarded`` counts bytes handed to the destination socket, per direction:
    ``"up"`` is client -> target, ``"down"`` is target -> client.
    """

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        delay_s: float,
        *,
        down_delay_s: float | None = None,
        max_inflight_bytes: int = _DEFAULT_MAX_INFLIGHT,
    ) -> None:
        down_delay_s = delay_s if down_delay_s is None else down_delay_s
        if min(delay_s, down_delay_s) < 0:
            raise ValueError(f"delays must be >= 0, got {delay_s}, {down_delay_s}")
        if max_inflight_bytes <= 0:
            raise ValueError(f"max_inflight_bytes must be > 0, got {max_inflight_bytes}")
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.target_host = target_host
        self.target_port = target_port
        self.delay_s = float(delay_s)
        self.down_delay_s = float(down_delay_s)
        self.max_inflight_bytes = max_inflight_bytes
        self.bytes_forwarded: dict[str, int] = {"up": 0, "down": 0}
        self.connections_total = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._closing = False

    async def start(self) -> None:
        """Bind and start accepting; ``listen_port`` 0 picks a free port (see ``port``)."""
        if self._server is not None:
            raise RuntimeError("LatencyProxy already started")
        self._server = await asyncio.start_server(self._handle, self.listen_host, self.listen_port)

    @property
    def port(self) -> int:
        """The bound port (valid after ``start``)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("LatencyProxy is not listening")
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def active_connections(self) -> int:
        """Client connections currently being proxied."""
        return len(self._handlers)

    async def close(self) -> None:
        """Stop listening and close all connections (in-flight data is dropped)."""
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.gather(*handlers, return_exceptions=True)
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), _CLOSE_TIMEOUT_S)

    async def __aenter__(self) -> LatencyProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _handle(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self._closing:
            client_writer.transport.abort()
            return
        self._handlers.add(task)
        self.connections_total += 1
        try:
            await self._proxy_connection(client_reader, client_writer)
        except asyncio.CancelledError:
            pass  # close(): the connection is torn down in _proxy_connection's finally
        except Exception:  # pragma: no cover - defensive, keep the server alive
            log.exception("latency proxy connection failed")
        finally:
            self._handlers.discard(task)

    async def _proxy_connection(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        peer = client_writer.get_extra_info("peername")
        try:
            target_reader, target_writer = await asyncio.open_connection(
                self.target_host, self.target_port
            )
        except OSError as exc:
            log.warning(
                "cannot reach target %s:%s for %s: %s",
                self.target_host,
                self.target_port,
                peer,
                exc,
            )
            await _close_writer(client_writer)
            return
        _set_nodelay(client_writer)
        _set_nodelay(target_writer)

        up = _Direction(self, "up", client_reader, target_writer, self.delay_s)
        down = _Direction(self, "down", target_reader, client_writer, self.down_delay_s)
        readers = [
            asyncio.create_task(up.read_loop(), name="latency-proxy-up-read"),
            asyncio.create_task(down.read_loop(), name="latency-proxy-down-read"),
        ]
        writers = [
            asyncio.create_task(up.write_loop(), name="latency-proxy-up-write"),
            asyncio.create_task(down.write_loop(), name="latency-proxy-down-write"),
        ]
        tasks = readers + writers
        try:
            pending: set[asyncio.Task[Outcome]] = set(writers)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if any(t.result() == "reset" for t in done):
                    break  # a side is gone: its in-flight data was flushed; close both
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(
                asyncio.shield(_close_writer(client_writer)),
                asyncio.shield(_close_writer(target_writer)),
                return_exceptions=True,
            )
            log.debug("connection from %s closed", peer)


def start_in_thread(
    listen_host: str,
    listen_port: int,
    target_host: str,
    target_port: int,
    delay_s: float,
    down_delay_s: float | None = None,
) -> tuple[LatencyProxy, Callable[[], None]]:
    """Run a ``LatencyProxy`` on its own event loop in a daemon thread.

    Returns once the proxy is listening (``proxy.port`` is valid), with the proxy and an
    idempotent ``stop()`` that closes it and ends the thread.
    """
    proxy = LatencyProxy(
        listen_host, listen_port, target_host, target_port, delay_s, down_delay_s=down_delay_s
    )
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(proxy.start())
        except BaseException as exc:
            failure.append(exc)
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="latency-proxy", daemon=True)
    thread.start()
    ready.wait()
    if failure:
        thread.join()
        raise failure[0]

    stopped = threading.Lock()
    done = [False]

    def stop() -> None:
        with stopped:
            if done[0]:
                return
            done[0] = True
        if loop.is_closed():
            return
        fut = asyncio.run_coroutine_threadsafe(proxy.close(), loop)
        with contextlib.suppress(Exception):
            fut.result(timeout=_CLOSE_TIMEOUT_S * 3)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=_CLOSE_TIMEOUT_S * 3)

    return proxy, stop


def delay_stages(
    addresses: Sequence[str], delay_s: float, *, star: bool = False
) -> tuple[list[str], Callable[[], None]]:
    """A proxy in front of every stage of a ring; the addresses to use instead, and a stop().

    The gateway's client links each stage to the next stage's address as the client knows it,
    so stage k reaches stage k + 1 through that stage's proxy too. Ring (default): every hop
    waits ``delay_s`` one way, N + 1 transfers per step for N stages. ``star``: what reaches
    stage k > 0 waits ``2 * delay_s`` (stage k - 1 -> coordinator -> stage k, relayed by the
    proxy's thread in the coordinator's process) and what leaves it ``delay_s``: 2N transfers
    per step, a coordinator that sends every stage its input and gets its output back.
    """
    addresses_out: list[str] = []
    stops: list[Callable[[], None]] = []
    try:
        for index, address in enumerate(addresses):
            host, port = address.rsplit(":", 1)
            up = 2 * delay_s if star and index > 0 else delay_s
            proxy, stop = start_in_thread("127.0.0.1", 0, host, int(port), up, delay_s)
            stops.append(stop)
            addresses_out.append(f"127.0.0.1:{proxy.port}")
    except BaseException:
        for stop in stops:
            stop()
        raise

    def stop_all() -> None:
        for stop in stops:
            stop()

    return addresses_out, stop_all


def _parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


async def _serve(args: argparse.Namespace) -> None:
    listen_host, listen_port = args.listen
    target_host, target_port = args.target
    proxy = LatencyProxy(
        listen_host,
        listen_port,
        target_host,
        target_port,
        args.delay_ms / 1000.0,
        max_inflight_bytes=int(args.max_inflight_mb * 1024 * 1024),
    )
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    print(
        f"latency proxy {listen_host}:{proxy.port} -> {target_host}:{target_port}, "
        f"{args.delay_ms:g} ms each way",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await proxy.close()
        print(
            f"stopped: {proxy.connections_total} connections, "
            f"up {proxy.bytes_forwarded['up']} B, down {proxy.bytes_forwarded['down']} B",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench latency-proxy", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--listen", type=_parse_hostport, required=True, help="HOST:PORT")
    parser.add_argument("--target", type=_parse_hostport, required=True, help="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, ms")
    parser.add_argument(
        "--max-inflight-mb",
        type=float,
        default=_DEFAULT_MAX_INFLIGHT / 2**20,
        help="per-direction buffer cap per connection (MiB)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
