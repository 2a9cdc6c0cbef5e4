"""A lab of hosts on one machine: network namespaces on a bridge, with shaped links.

Each host is a network namespace ``NAME-K`` with one veth into the bridge ``NAME-br`` and its
own address ``SUBNET.(K+2)`` (default subnet 10.77.0, a private /24); the bridge holds
``SUBNET.1`` in the root namespace, where the client (a test, a benchmark, curl) runs. No
other address or interface is touched. A link's rate is shaped with ``tc tbf`` on both ends of
its veth; ``netem`` is often missing, so a delay is a user-space TCP proxy on the host
(:mod:`benchmarks.latency_proxy`) in front of a port. A link can be cut (the veth down: every
packet to and from that host is dropped) and restored, and two hosts partitioned (each
drops the other's packets, nftables in their namespaces) while both still reach the rest.

Everything is named ``NAME-*``, so ``down`` (or :func:`remove`) finds and removes all of it
even from another process; :class:`Lab` removes what it made when it closes, also when
bringing it up failed half-way. Root only (:func:`unavailable` says why not).

Command line (``deploy/lab.sh`` runs it)::

    python -m benchmarks.lab up --hosts 3 [--rate 100mbit] [--name pslab] [--subnet 10.77.0]
    python -m benchmarks.lab shape --rate 1gbit        # every link
    python -m benchmarks.lab cut 1 | restore 1         # host 1's link
    python -m benchmarks.lab partition 1 2 | heal 1 2
    python -m benchmarks.lab status | down

and a process on host K: ``ip netns exec pslab-K pipeshard stage ... --listen 10.77.0.(K+2):P``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.processes import PIPESHARD, Proc

DEFAULT_NAME = "pslab"
DEFAULT_SUBNET = "10.77.0"
_PARTITION_TABLE = "pslab_partition"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmg]?)(bit|bps)$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


class LabError(RuntimeError):
    """A command that builds or changes the lab failed (its message has the command's)."""


def unavailable() -> str | None:
    """Why this machine cannot make a lab (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, a bridge, tc)"
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2, nftables)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def rate_bits(rate: str) -> float:
    """``100mbit``, ``1gbit``, ``12.5mbps`` (tc's units) in bits per second."""
    match = _RATE.match(rate.strip())
    if not match:
        raise ValueError(f"a rate is like 100mbit or 1gbit, not {rate!r}")
    value = float(match.group(1)) * _SCALE[match.group(2).lower()]
    return value * (8 if match.group(3).lower() == "bps" else 1)


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise LabError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def netns(name: str) -> list[str]:
    """The lab's namespaces of ``name`` (``NAME-K``), in host order."""
    out = _run("ip", "netns", "list", check=False).stdout
    found = [line.split()[0] for line in out.splitlines() if line.strip()]
    ours = [n for n in found if re.fullmatch(rf"{re.escape(name)}-\d+", n)]
    return sorted(ours, key=lambda n: int(n.rsplit("-", 1)[1]))


def remove(name: str = DEFAULT_NAME) -> list[str]:
    """Remove every namespace, veth and bridge named ``NAME-*``; returns what it removed."""
    removed = []
    for ns in netns(name):
        _run("ip", "netns", "del", ns, check=False)  # takes its end of the veth along
        removed.append(ns)
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for match in re.finditer(rf"^\d+: ({re.escape(name)}-[^:@\s]+)", links, re.MULTILINE):
        _run("ip", "link", "del", match.group(1), check=False)
        removed.append(match.group(1))
    return removed


@dataclass
class Host:
    index: int
    netns: str
    address: str
    veth: str  # the root namespace's end, in the bridge
    peer: str  # the namespace's end ("eth0" inside it)

    def exec(self) -> list[str]:
        """The prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]


@dataclass
class Lab:
    """``hosts`` hosts on a bridge (see the module docstring); ``rate``: every link's rate
    (tc's units; None: unshaped). Use as a context manager, or ``up()`` then ``down()``."""

    hosts_count: int
    name: str = DEFAULT_NAME
    subnet: str = DEFAULT_SUBNET
    rate: str | None = None
    hosts: list[Host] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts_count <= 200:
            raise ValueError(f"a lab has 1 to 200 hosts, not {self.hosts_count}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,7}", self.name):
            raise ValueError(f"a lab's name is up to 8 lower-case letters/digits: {self.name!r}")
        if not re.fullmatch(r"(10|172|192)\.\d{1,3}\.\d{1,3}", self.subnet):
            raise ValueError(f"a subnet is the first 3 numbers of a private /24: {self.subnet!r}")
        self.hosts = [
            Host(i, f"{self.name}-{i}", f"{self.subnet}.{i + 2}", f"{self.name}-{i}h", "eth0")
            for i in range(self.hosts_count)
        ]

    @property
    def bridge(self) -> str:
        return f"{self.name}-br"

    @property
    def client_address(self) -> str:
        """The root namespace's address on the bridge."""
        return f"{self.subnet}.1"

    def up(self) -> Lab:
        reason = unavailable()
        if reason:
            raise LabError(reason)
        if netns(self.name) or _run("ip", "link", "show", self.bridge, check=False).returncode == 0:
            raise LabError(f"a lab named {self.name!r} exists; `down` it first")
        taken = _run("ip", "-4", "route", "show", check=False).stdout
        if f"{self.subnet}.0/24" in taken:
            raise LabError(f"{self.subnet}.0/24 is routed here already: pick another --subnet")
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.client_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for host in self.hosts:
                _run("ip", "netns", "add", host.netns)
                inner = f"{host.netns}n"  # renamed eth0 inside the namespace
                _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", inner)
                _run("ip", "link", "set", inner, "netns", host.netns)
                _run("ip", "link", "set", host.veth, "master", self.bridge)
                _run("ip", "link", "set", host.veth, "up")
                ns = ["ip", "-n", host.netns]
                _run(*ns, "link", "set", inner, "name", host.peer)
                _run(*ns, "addr", "add", f"{host.address}/24", "dev", host.peer)
                _run(*ns, "link", "set", host.peer, "up")
                _run(*ns, "link", "set", "lo", "up")
            if self.rate:
                self.shape(self.rate)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Stop the processes started on the lab's hosts, then remove all of the lab."""
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()
        remove(self.name)

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def host(self, index: int) -> Host:
        if not 0 <= index < len(self.hosts):
            raise ValueError(f"no host {index} (the lab has {len(self.hosts)})")
        return self.hosts[index]

    def shape(self, rate: str | None) -> None:
        """Every link at ``rate`` both ways (``tc tbf`` on both ends); None: unshaped."""
        for host in self.hosts:
            ends = [("ip", "netns", "exec", host.netns, "tc"), ("tc",)]
            for prefix, dev in zip(ends, (host.peer, host.veth), strict=True):
                _run(*prefix, "qdisc", "del", "dev", dev, "root", check=False)
                if rate is None:
                    continue
                bits = rate_bits(rate)
                burst = max(int(bits / 8 * 0.004), 64 * 1024)  # 4 ms at the rate, >= a GSO packet
                _run(
                    *prefix, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", str(burst), "latency", "50ms",
                )  # fmt: skip
        self.rate = rate

    def cut(self, index: int) -> None:
        """Pull host ``index``'s cable: its veth down, every packet to and from it dropped."""
        _run("ip", "link", "set", self.host(index).veth, "down")

    def restore(self, index: int) -> None:
        _run("ip", "link", "set", self.host(index).veth, "up")

    def partition(self, a: int, b: int) -> None:
        """Hosts ``a`` and ``b`` drop each other's packets (both still reach every other)."""
        for one, other in ((self.host(a), self.host(b)), (self.host(b), self.host(a))):
            script = (
                f"table inet {_PARTITION_TABLE} {{\n"
                "  chain in { type filter hook input priority 0; "
                f"ip saddr {other.address} drop; }}\n"
                "  chain out { type filter hook output priority 0; "
                f"ip daddr {other.address} drop; }}\n"
                "}\n"
            )
            done = subprocess.run(
                [*one.exec(), "nft", "-f", "-"], input=script, capture_output=True, text=True
            )
            if done.returncode != 0:
                raise LabError(f"nft in {one.netns} failed: {done.stderr.strip()}")

    def heal(self, a: int, b: int) -> None:
        for host in (self.host(a), self.host(b)):
            _run(*host.exec(), "nft", "delete", "table", "inet", _PARTITION_TABLE, check=False)

    def start(
        self, index: int, args: Sequence[str], log: Path, env: dict[str, str] | None = None
    ) -> Proc:
        """Start ``args`` on host ``index`` (stopped by ``down``)."""
        proc = Proc([*self.host(index).exec(), *args], log, env=dict(env or {})).start()
        self.procs.append(proc)
        return proc

    def delay(self, index: int, port: int, target_port: int, delay_ms: float, log: Path) -> str:
        """A latency proxy on host ``index``: ``ADDRESS:port`` forwards to
        ``ADDRESS:target_port`` with ``delay_ms`` each way; returns ``ADDRESS:port``."""
        address = self.host(index).address
        proc = self.start(
            index,
            [
                PIPESHARD, "bench", "latency-proxy", "--listen", f"{address}:{port}",
                "--target", f"{address}:{target_port}", "--delay-ms", str(delay_ms),
            ],
            log,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while "latency proxy" not in log.read_text(errors="replace"):
            assert proc.popen is not None
            if proc.popen.poll() is not None or time.monotonic() > deadline:
                raise LabError(
                    f"the latency proxy on host {index} did not start:\n{log.read_text()}"
                )
            time.sleep(0.05)
        return f"{address}:{port}"


def free_subnet(second: int = 77) -> str:
    """The first ``10.SECOND.X`` /24 that nothing here routes yet (labs side by side)."""
    taken = _run("ip", "-4", "route", "show", check=False).stdout
    for third in range(256):
        if f"10.{second}.{third}.0/24" not in taken:
            return f"10.{second}.{third}"
    raise LabError(f"every 10.{second}.X.0/24 is taken")


@dataclass
class LabFleet:
    """A gateway and stages started on a lab's hosts: the gateway's ``url``, the stage
    addresses it uses (``stages``: a latency proxy's where delayed), the stages' metrics URLs
    and the CA bundle that verifies them all (None: plain HTTP and gRPC)."""

    url: str
    stages: list[str]
    metrics: list[str]
    ca: Path | None
    gateway: Proc
    stage_procs: list[Proc]

    @property
    def verify(self) -> str | bool:
        """httpx's ``verify`` for this fleet's URLs."""
        return str(self.ca) if self.ca else True


def start_fleet(
    lab: Lab,
    export: Path,
    logs: Path,
    *,
    gateway_host: int = 0,
    stage_hosts: Sequence[int] | None = None,
    delay_ms: float = 0.0,
    tls: bool = False,
    secret: str | None = None,
    api_key: str | None = None,
    stage_flags: Sequence[str] = (),
    gateway_flags: Sequence[str] = (),
    exact: bool = True,
    ov_cache: Path | None = None,
    timeout: float = 180.0,
) -> LabFleet:
    """Stage K of ``export`` on host ``stage_hosts[K]`` (default: hosts 1, 2, ...), listening
    on the host's address (port 50051 + K, metrics 9100 + K), the gateway on ``gateway_host``
    (port 8000). ``delay_ms``: a latency proxy in front of every stage (port 51051 + K) adds
    that much each way to every link into it. ``tls``: a CA and a certificate per host's
    address; the stages serve TLS and verify the next one, the gateway verifies the stages and
    serves HTTPS. ``ov_cache``: the stages' OpenVINO cache (default: in ``logs``). The
    processes stop with ``lab.down()``; a stage or gateway that does not
    start raises (with its log)."""
    from protos.manifest import load_manifest

    count = load_manifest(export).num_stages
    hosts = list(stage_hosts) if stage_hosts is not None else [k + 1 for k in range(count)]
    if len(hosts) != count:
        raise ValueError(f"{count} stages need {count} hosts, not {hosts}")
    logs.mkdir(parents=True, exist_ok=True)
    addresses = sorted({lab.host(i).address for i in [gateway_host, *hosts]})
    ca, certs = certificates(logs / "tls", addresses) if tls else (None, {})
    common = ["--secret", secret] if secret else []
    procs = []
    for stage, index in enumerate(hosts):
        address = lab.host(index).address
        args = [
            PIPESHARD, "stage", "--shards", str(export), "--stage", str(stage),
            "--listen", f"{address}:{50051 + stage}", "--metrics-port", str(9100 + stage),
            "--threads", "1", "--ov-cache-dir", str(ov_cache or logs / "ov-cache"), *common,
        ]  # fmt: skip
        if tls:
            cert, key = certs[address]
            args += ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-ca", str(ca)]
        if exact:
            args += ["--kv-cache-precision", "f32", "--inference-precision", "f32"]
        procs.append(lab.start(index, [*args, *stage_flags], logs / f"stage-{stage}.log"))
    for proc in procs:
        proc.wait_ready(timeout)
    stages = []
    for stage, index in enumerate(hosts):
        address = lab.host(index).address
        if delay_ms > 0:
            log = logs / f"proxy-{stage}.log"
            stages.append(lab.delay(index, 51051 + stage, 50051 + stage, delay_ms, log))
        else:
            stages.append(f"{address}:{50051 + stage}")
    address = lab.host(gateway_host).address
    args = [
        PIPESHARD, "serve", "--stages", ",".join(stages), "--listen", f"{address}:8000",
        *common,
    ]  # fmt: skip
    if api_key:
        args += ["--api-key", api_key]
    if tls:
        cert, key = certs[address]
        args += ["--tls-ca", str(ca), "--tls-cert", str(cert), "--tls-key", str(key)]
    gateway = lab.start(gateway_host, [*args, *gateway_flags], logs / "gateway.log")
    scheme = "https" if tls else "http"
    url = f"{scheme}://{address}:8000"
    if not gateway.wait_http(f"{url}/ready", timeout, str(ca) if ca else True):
        raise LabError(
            f"the gateway on host {gateway_host} is not ready:\n"
            + (logs / "gateway.log").read_text()[-3000:]
        )
    metrics = [
        f"{scheme}://{lab.host(index).address}:{9100 + stage}/metrics"
        for stage, index in enumerate(hosts)
    ]
    return LabFleet(url, stages, metrics, ca, gateway, procs)


def certificates(
    folder: Path, addresses: Sequence[str]
) -> tuple[Path, dict[str, tuple[Path, Path]]]:
    """A throw-away CA and one certificate per address (its IP in subjectAltName), made with
    openssl: (the CA bundle, {address: (certificate, key)})."""
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_key = folder / "ca.pem", folder / "ca.key"

    def openssl(*args: str) -> None:
        _run("openssl", *args)

    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", "2", "-subj", "/CN=pipeshard lab CA",
    )  # fmt: skip
    made = {}
    for address in addresses:
        key, csr, cert = (folder / f"{address}.{ext}" for ext in ("key", "csr", "pem"))
        ext = folder / f"{address}.cnf"
        ext.write_text(f"subjectAltName=IP:{address}\n")
        openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", f"/CN={address}",
        )  # fmt: skip
        openssl(
            "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext),
        )  # fmt: skip
        made[address] = (cert, key)
    return ca, made


def _status(name: str) -> str:
    lines = []
    for ns in netns(name):
        addrs = _run("ip", "-n", ns, "-4", "-o", "addr", "show", "dev", "eth0", check=False).stdout
        address = addrs.split()[3] if addrs.split() else "?"
        qdisc = _run("ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", "eth0", check=False)
        rate = re.search(r"rate (\S+)", qdisc.stdout)
        flags = _run("ip", "link", "show", f"{ns}h", check=False).stdout.split(">")[0]
        cut = "UP" not in flags.split("<")[-1].split(",")
        parted = _run(
            "ip", "netns", "exec", ns, "nft", "list", "table", "inet", _PARTITION_TABLE, check=False
        )
        drops = re.findall(r"daddr (\S+) drop", parted.stdout)
        lines.append(
            f"{ns}  {address}  rate {rate.group(1) if rate else 'unshaped'}"
            + ("  CUT" if cut else "")
            + (f"  partitioned from {', '.join(drops)}" if drops else "")
        )
    return "\n".join(lines) or f"no lab named {name!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pipeshard bench lab", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--name", default=DEFAULT_NAME, help="prefix of everything the lab makes")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="create the hosts, the bridge and the links")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--rate", help="every link's rate, e.g. 100mbit (default: unshaped)")
    up.add_argument("--subnet", default=DEFAULT_SUBNET, help="first 3 numbers of a private /24")
    shape = sub.add_parser("shape", help="set every link's rate")
    shape.add_argument("--rate", help="e.g. 1gbit; omitted: unshaped")
    for command in ("cut", "restore"):
        sub.add_parser(command, help=f"{command} a host's link").add_argument("host", type=int)
    for command in ("partition", "heal"):
        two = sub.add_parser(command, help=f"{command} two hosts")
        two.add_argument("a", type=int)
        two.add_argument("b", type=int)
    sub.add_parser("status", help="the hosts, their addresses, rates, cuts and partitions")
    sub.add_parser("down", help="remove everything the lab made")
    args = parser.parse_args(argv)
    try:
        if args.command == "down":
            removed = remove(args.name)
            print(
                f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove"
            )
            return 0
        if args.command == "status":
            print(_status(args.name))
            return 0
        if args.command == "up":
            lab = Lab(args.hosts, args.name, args.subnet, args.rate).up()
            print(_status(args.name))
            print(f"client (this namespace): {lab.client_address} on {lab.bridge}")
            return 0
        count = len(netns(args.name))
        if not count:
            raise LabError(f"no lab named {args.name!r}: `up` it first")
        lab = Lab(count, args.name, _subnet_of(args.name))
        if args.command == "shape":
            lab.shape(args.rate)
        elif args.command in ("cut", "restore"):
            getattr(lab, args.command)(args.host)
        else:
            getattr(lab, args.command)(args.a, args.b)
        print(_status(args.name))
        return 0
    except (LabError, ValueError) as exc:
        print(f"lab: {exc}", file=sys.stderr)
        return 2


def _subnet_of(name: str) -> str:
    addrs = _run("ip", "-4", "-o", "addr", "show", "dev", f"{name}-br").stdout.split()
    return addrs[3].rsplit(".", 1)[0]


if __name__ == "__main__":
    raise SystemExit(main())
