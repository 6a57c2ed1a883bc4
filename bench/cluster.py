"""A simulated multi-node cluster on one Linux machine, for benchmarks and tests.

``Cluster(nodes=N, ranks_per_node=L, rate="1gbit")`` makes N network
namespaces ("nodes"), each with its loopback up and one veth link, ``fr0``,
to a Linux bridge in a namespace of its own (the "switch", so any number of
nodes works). Each link is shaped with ``tbf`` to ``rate`` in both directions
(the node side's egress and the bridge port's egress). Node k's address is
``10.213.0.(k+1)/16``; that subnet exists only inside the namespaces the
cluster creates, and nothing is added to the host's namespace (no interface,
address or route), so no traffic can reach the host's or any other network.

``Cluster.run(fn, *args)`` runs ``fn(rank, world_size, *args)`` on L ranks per
node, each a process inside its node's namespace, in a gloo process group
joined through torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR = node 0's address, MASTER_PORT) with
``GLOO_SOCKET_IFNAME=fr0``: ranks of one node reach each other through the
kernel's local path (loopback speed), ranks of different nodes through the
shaped links. ``Cluster.probe()`` measures what the links really give.

Latency (``delay=``) needs the kernel's netem qdisc (``sch_netem``); rate
shaping (tbf) cannot add delay, and on a kernel without netem ``up()`` refuses
``delay=`` with that reason. Root (CAP_NET_ADMIN) and iproute2's ``ip`` and
``tc`` are needed; ``unavailable_reason()`` says what is missing.

Command line: ``fusedreduce-bench cluster {up,down,probe,run}``.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import ipaddress
import itertools
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from fusedreduce.local_ranks import join_and_run, run_rank_processes
from . import common, output_files

NAME = "cluster"
ACTIONS = ("up", "down", "probe", "run")
#: every namespace a cluster creates is named ``frc-<pid>-<n>-...``: the creating
#: process's id tells ``remove_stale`` which clusters nobody will take down
PREFIX = "frc"
#: the link's name inside every node's namespace (the namespace makes it unique)
INTERFACE = "fr0"
BRIDGE = "br0"
#: node k is 10.213.0.(k+1) in this /16, which exists only inside the cluster's namespaces
SUBNET = ipaddress.IPv4Network("10.213.0.0/16")
#: one address each in 10.213.0.1-254
MAX_NODES = 254
NETNS_DIR = "/run/netns"
#: the first rendezvous port; each run of a cluster takes the next one, so a
#: run never meets the previous run's listening socket in TIME_WAIT (the
#: namespaces are the cluster's own: no other program listens there)
MASTER_PORT = 29500
CLONE_NEWNET = 0x40000000
#: the capabilities the cluster needs, and their bits (linux/capability.h)
CAPABILITIES = (("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21))
_counter = itertools.count()

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class ClusterUnavailable(RuntimeError):
    """This machine cannot make the cluster (no root, no ``ip``/``tc``, no netem
    for a delay); the message says what is needed."""


def unavailable_reason() -> Optional[str]:
    """Why a cluster cannot be made here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the simulated cluster needs Linux network namespaces (this is {sys.platform})"
    lacking = missing_capabilities()
    if lacking:
        return (f"the simulated cluster needs root with CAP_NET_ADMIN and CAP_SYS_ADMIN (to "
                f"create network namespaces and shape links with tc); this process lacks "
                f"{' and '.join(lacking)}: run it as root (in a container: --cap-add "
                f"NET_ADMIN --cap-add SYS_ADMIN, or --privileged)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"the simulated cluster needs iproute2's ip and tc on PATH (missing: "
                f"{', '.join(missing)})")
    return None


def missing_capabilities() -> List[str]:
    """Which of CAP_NET_ADMIN (links, addresses, qdiscs) and CAP_SYS_ADMIN
    (``ip netns``' mounts, setns) this process's effective set lacks."""
    with open("/proc/self/status") as status:
        effective = next(int(line.split()[1], 16) for line in status
                         if line.startswith("CapEff:"))
    return [name for name, bit in CAPABILITIES if not effective >> bit & 1]


def _parse(text: str, units: Dict[str, float], what: str, example: str) -> float:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]+)\s*",
                         str(text))
    if not match or match.group(2).lower() not in units or float(match.group(1)) <= 0:
        raise ValueError(f"{what} must be a positive number with a unit of "
                         f"{', '.join(units)} (e.g. {example}), got {text!r}")
    return float(match.group(1)) * units[match.group(2).lower()]


def parse_rate(text: str) -> float:
    """A tc-style rate (``"1gbit"``, ``"100mbit"``, ``"125mbps"`` = bytes) in bit/s.

    Raises:
        ValueError: not a positive number with one of those units.
    """
    return _parse(text, _RATE_UNITS, "rate", "1gbit")


def parse_delay(text: str) -> float:
    """A delay (``"0.1ms"``, ``"100us"``) in seconds.

    Raises:
        ValueError: not a positive number with a unit of us, ms or s.
    """
    return _parse(text, _DELAY_UNITS, "delay", "0.1ms")


def _command(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    process = subprocess.run(list(argv), capture_output=True, text=True)
    if check and process.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {process.stderr.strip()}")
    return process


def namespaces() -> List[str]:
    """The network namespaces ``ip netns`` knows, by name."""
    out = _command(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> List[str]:
    """Delete the namespaces of every cluster whose creating process has ended
    (one ``up`` from the command line left, or a process killed before its
    cleanup ran); a live process's cluster is left alone. The names deleted."""
    stale = []
    for name in namespaces():
        match = re.fullmatch(rf"{PREFIX}-(\d+)-\d+-\w+", name)
        if match and not _pid_alive(int(match.group(1))):
            _command(["ip", "netns", "delete", name], check=False)
            stale.append(name)
    return stale


def netem_unavailable_reason() -> Optional[str]:
    """Why netem cannot delay packets here (tried in a namespace of its own), or None."""
    probe = f"{PREFIX}-{os.getpid()}-{next(_counter)}-netemcheck"
    _command(["ip", "netns", "add", probe])
    try:
        tried = _command(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem",
                          "delay", "1ms"], check=False)
    finally:
        _command(["ip", "netns", "delete", probe], check=False)
    if tried.returncode == 0:
        return None
    return (f"a link delay needs the kernel's netem qdisc (module sch_netem, "
            f"CONFIG_NET_SCH_NETEM), which this kernel lacks (tc: {tried.stderr.strip()}); "
            f"tbf/htb shape the rate but cannot add latency: run without --delay, or on a "
            f"kernel with sch_netem")


@dataclass(frozen=True)
class Node:
    """One simulated node: its namespace, its link's name and its address."""
    index: int
    namespace: str
    interface: str
    address: str


def _enter_namespace(namespace: str) -> None:
    """Move this process into ``namespace``'s network stack (sockets made from now on)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(os.path.join(NETNS_DIR, namespace)) as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {namespace}: {os.strerror(error)}")


def _enter_node(namespace: str, env: Dict[str, str]) -> None:
    """A rank's setup: into its node's namespace, with its launcher variables."""
    _enter_namespace(namespace)
    os.environ.update(env)


class Cluster:
    """N simulated nodes joined by shaped links, and gloo jobs across them.

    Args:
        nodes: how many nodes (namespaces), 1 to ``MAX_NODES``.
        ranks_per_node: the ranks ``run`` starts on each node.
        rate: each link's rate in both directions, tc-style (``"1gbit"``,
            ``"100mbit"``); None leaves the links unshaped.
        delay: one-way latency between two nodes (``"0.1ms"``), half on each
            node's link; needs the kernel's netem qdisc.

    Raises:
        ValueError: ``nodes``/``ranks_per_node`` out of range, or a malformed
            ``rate``/``delay`` (at construction, before anything is made).
        ClusterUnavailable: from ``up()``: not root, no ``ip``/``tc``, or
            ``delay`` without netem; nothing is left behind.

    Examples:
        >>> def total(rank, world_size):                         # doctest: +SKIP
        ...     t = torch.ones(1) * rank
        ...     torch.distributed.all_reduce(t)
        ...     return float(t)
        >>> with Cluster(nodes=2, ranks_per_node=2, rate="1gbit") as c:  # doctest: +SKIP
        ...     print(format_probe(c.probe()))
        ...     c.run(total)
        [6.0, 6.0, 6.0, 6.0]
    """

    def __init__(self, nodes: int, ranks_per_node: int = 1, rate: Optional[str] = "1gbit",
                 delay: Optional[str] = None) -> None:
        for name, value, high in (("nodes", nodes, MAX_NODES),
                                  ("ranks_per_node", ranks_per_node, None)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1 or (high is not None and value > high):
                raise ValueError(f"{name} must be in 1..{high or 'any'}, got {value}")
        self.rate_bits = parse_rate(rate) if rate is not None else None
        self.delay_s = parse_delay(delay) if delay is not None else None
        self.rate, self.delay = rate, delay
        self.ranks_per_node = ranks_per_node
        self.name = f"{PREFIX}-{os.getpid()}-{next(_counter)}"
        self.switch = f"{self.name}-switch"
        self.nodes = [Node(k, f"{self.name}-node{k}", INTERFACE, str(SUBNET[k + 1]))
                      for k in range(nodes)]
        self._runs = 0
        self.is_up = False

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.ranks_per_node

    @property
    def namespaces(self) -> List[str]:
        """Every namespace this cluster makes: the switch's, then each node's."""
        return [self.switch] + [node.namespace for node in self.nodes]

    def __enter__(self) -> "Cluster":
        return self.up()

    def __exit__(self, *exc_info) -> None:
        self.down()

    def up(self) -> "Cluster":
        """Make the namespaces, the bridge and the shaped links; returns self
        (a cluster already up is left as it is).

        Raises:
            ClusterUnavailable: what this machine lacks (nothing is made).
            RuntimeError: an ``ip``/``tc`` command failed (what was made is removed).
        """
        if self.is_up:
            return self
        reason = unavailable_reason()
        if reason is None and self.delay_s is not None:
            reason = netem_unavailable_reason()
        if reason is not None:
            raise ClusterUnavailable(reason)
        atexit.register(self.down)  # a failing test or script leaves nothing behind
        self.is_up = True
        try:
            ip = ["ip", "-n", self.switch]
            _command(["ip", "netns", "add", self.switch])
            _command(ip + ["link", "set", "lo", "up"])
            _command(ip + ["link", "add", BRIDGE, "type", "bridge"])
            _command(ip + ["link", "set", BRIDGE, "up"])
            for node in self.nodes:
                port = f"n{node.index}"
                _command(["ip", "netns", "add", node.namespace])
                # both ends made inside the cluster's namespaces: the host's sees nothing
                _command(["ip", "-n", node.namespace, "link", "add", node.interface, "type",
                          "veth", "peer", "name", port, "netns", self.switch])
                _command(["ip", "-n", node.namespace, "link", "set", "lo", "up"])
                _command(["ip", "-n", node.namespace, "addr", "add",
                          f"{node.address}/{SUBNET.prefixlen}",
                          "dev", node.interface])
                _command(["ip", "-n", node.namespace, "link", "set", node.interface, "up"])
                _command(ip + ["link", "set", port, "master", BRIDGE, "up"])
                for namespace, interface in ((node.namespace, node.interface),
                                             (self.switch, port)):
                    for argv in shaping_commands(namespace, interface, self.rate_bits,
                                                 self.delay_s):
                        _command(argv)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove every namespace this cluster made (their links and bridge go
        with them); idempotent, and a no-op before ``up``."""
        atexit.unregister(self.down)
        if not self.is_up:
            return
        present = set(namespaces())
        for namespace in self.namespaces:
            if namespace in present:
                _command(["ip", "netns", "delete", namespace])
        self.is_up = False

    def rank_env(self, rank: int, master_port: int) -> Dict[str, str]:
        """The environment torchrun would give ``rank``, plus gloo's interface."""
        node, local = divmod(rank, self.ranks_per_node)
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(self.ranks_per_node),
                "GROUP_RANK": str(node), "MASTER_ADDR": self.nodes[0].address,
                "MASTER_PORT": str(master_port), "GLOO_SOCKET_IFNAME": INTERFACE}

    def _next_port(self) -> int:
        self._runs += 1
        return MASTER_PORT + self._runs

    def _require_up(self) -> None:
        if not self.is_up:
            raise RuntimeError("the cluster is not up: call up() or use it in a with block")

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0,
            collective_timeout: float = 60.0,
            start_method: Optional[str] = None) -> List[Any]:
        """``[fn(rank, world_size, *args) for each rank]``, each rank a process in
        its node's namespace, inside an initialised gloo process group.

        Ranks are numbered node by node (ranks 0..L-1 on node 0). ``fn`` must be
        a module-level function and its result picklable. ``start_method`` is
        ``fusedreduce.local_ranks``'s (``"spawn"``, or ``"forkserver"``; default
        ``$FUSEDREDUCE_START_METHOD``, else ``"spawn"``).

        Raises:
            RuntimeError: the cluster is not up.
            ValueError: an unknown ``start_method``.
            fusedreduce.local_ranks.RankFailure: ranks raised (their tracebacks).
            TimeoutError: ranks did not finish within ``timeout`` (killed).
        """
        self._require_up()
        port = self._next_port()
        threads = max(1, (os.cpu_count() or 2) // self.world_size)
        ranks = []
        for rank in range(self.world_size):
            setup = functools.partial(_enter_node, self.nodes[rank // self.ranks_per_node]
                                      .namespace, self.rank_env(rank, port))
            ranks.append((rank, self.world_size, "env://", "gloo", collective_timeout, threads,
                          fn, args, setup))
        return run_rank_processes(join_and_run, ranks, timeout=timeout,
                                  start_method=start_method)

    def run_script(self, argv: Sequence[str], timeout: float = 3600.0) -> List[int]:
        """Run ``python *argv`` on every rank as torchrun would (the script calls
        ``init_process_group`` itself); each rank's exit status, in rank order.

        Raises:
            RuntimeError: the cluster is not up.
            TimeoutError: ranks still running after ``timeout`` (killed).
        """
        self._require_up()
        port = self._next_port()
        threads = str(max(1, (os.cpu_count() or 2) // self.world_size))
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", self.nodes[rank // self.ranks_per_node].namespace,
             sys.executable, *argv],
            env={**os.environ, "OMP_NUM_THREADS": threads, **self.rank_env(rank, port)})
            for rank in range(self.world_size)]
        deadline = time.monotonic() + timeout
        try:
            for proc in procs:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            late = [rank for rank, proc in enumerate(procs) if proc.poll() is None]
            raise TimeoutError(f"ranks {late} did not finish within {timeout} s") from None
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        return [proc.returncode for proc in procs]

    def probe(self, nbytes: int = 16 * 2 ** 20, repeats: int = 3,
              timeout: float = 300.0) -> Dict[str, Any]:
        """Measure the links: see ``probe_ranks``; rank 0's record, with the setup."""
        self._require_up()
        record = self.run(probe_ranks, self.ranks_per_node, nbytes, repeats,
                          timeout=timeout)[0]
        return {"nodes": len(self.nodes), "ranks_per_node": self.ranks_per_node,
                "rate": self.rate, "rate_bits": self.rate_bits, "delay": self.delay,
                **record}


def shaping_commands(namespace: str, interface: str, rate_bits: Optional[float],
                     delay_s: Optional[float]) -> List[List[str]]:
    """The tc commands that shape ``interface``'s egress in ``namespace``:
    ``rate_bits`` (tbf) and half of the one-way ``delay_s`` (netem at the root,
    tbf its child): a packet between two nodes leaves one node's link and one
    bridge port, so it meets the rate on both and the whole delay once."""
    tc = ["tc", "-n", namespace, "qdisc", "add", "dev", interface]
    commands, parent = [], ["root"]
    if delay_s is not None:
        commands.append(tc + ["root", "handle", "1:", "netem", "delay",
                              f"{delay_s / 2 * 1e6:.3f}us"])
        parent = ["parent", "1:1"]
    if rate_bits is not None:
        commands.append(tc + parent + ["handle", "10:", "tbf"] + tbf_options(rate_bits))
    return commands


def tbf_options(rate_bits: float) -> List[str]:
    """tbf's arguments for ``rate_bits``: a bucket of 1 ms at the rate (at least
    64 KiB, one GSO packet: a smaller bucket splits every large packet), and a
    queue of 100 ms, deep enough that TCP meets backpressure before drops."""
    burst = max(int(rate_bits / 8 / 1000), 64 * 1024)
    return ["rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "100ms"]


# ------------------------------------------------------------------ the probe

#: round trips timed for each latency figure (median kept)
RTT_REPEATS = 50


def _median_time(run: Callable[[], None], repeats: int) -> float:
    run()  # warm-up: connections, buffers
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def probe_ranks(rank: int, world_size: int, ranks_per_node: int, nbytes: int,
                repeats: int) -> Optional[Dict[str, Any]]:
    """On every rank of a cluster run: rank 0's record of what the links give.

    - ``inter``: rank 0 (node 0) and rank ``ranks_per_node`` (node 1);
      ``local``: ranks 0 and 1 (node 0), when a node has two ranks.
    - ``*_send``: one buffer of ``nbytes`` sent one way, answered by one
      element (the median time of ``repeats``); ``*_rtt_s``: the median round
      trip of one float32 through gloo (of ``RTT_REPEATS``); ``*_tcp_rtt_s``:
      the same on a plain TCP socket, the path's own latency.
    - ``*_all_reduce``: a float32 all_reduce of ``nbytes`` in the group of
      every node's first rank (inter) or of node 0's ranks (local); algbw =
      nbytes / time, busbw = algbw x 2 (n - 1) / n (what each link carries).
    Bandwidths in Gbit/s and GB/s (10^9).
    """
    import torch
    import torch.distributed as dist
    nodes = world_size // ranks_per_node
    node_groups = [dist.new_group(list(range(k * ranks_per_node, (k + 1) * ranks_per_node)))
                   for k in range(nodes)]
    leaders_group = dist.new_group([k * ranks_per_node for k in range(nodes)])
    big = torch.ones(nbytes // 4)
    tiny = torch.ones(1)
    pairs = {"inter": ranks_per_node if nodes > 1 else None,
             "local": 1 if ranks_per_node > 1 else None}
    groups = {"inter": leaders_group if nodes > 1 else None,
              "local": node_groups[0] if ranks_per_node > 1 else None}
    record: Dict[str, Any] = {"nbytes": nbytes, "repeats": repeats}
    for kind, peer in pairs.items():
        if peer is None:
            continue
        if rank in (0, peer):
            other = peer if rank == 0 else 0

            def ping_pong(buffer, answer=tiny, other=other):
                if rank == 0:
                    dist.send(buffer, other)
                    dist.recv(answer, other)
                else:
                    dist.recv(buffer, other)
                    dist.send(answer, other)

            seconds = _median_time(lambda: ping_pong(big), repeats)
            record[f"{kind}_send"] = _bandwidth(nbytes, seconds)
            record[f"{kind}_rtt_s"] = _median_time(lambda: ping_pong(tiny), RTT_REPEATS)
            record[f"{kind}_tcp_rtt_s"] = _tcp_round_trip(rank, other)
        dist.barrier()
    for kind, group in groups.items():
        if group is None:
            continue
        members = dist.get_process_group_ranks(group)
        if rank in members:
            seconds = _median_time(lambda: dist.all_reduce(big, group=group), repeats)
            entry = _bandwidth(nbytes, seconds)
            size = len(members)
            entry["bus_gbit_s"] = entry["gbit_s"] * 2 * (size - 1) / size
            entry["ranks"] = size
            record[f"{kind}_all_reduce"] = entry
        dist.barrier()
    return record if rank == 0 else None


def _tcp_round_trip(rank: int, other: int) -> Optional[float]:
    """The median round trip of 8 bytes on a plain TCP socket between rank 0
    (listening on node 0's address) and ``other``: the path's own latency,
    without gloo's per-operation cost; rank 0's measure, None on the other."""
    import socket

    import torch
    import torch.distributed as dist
    port = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        server = socket.create_server((os.environ["MASTER_ADDR"], 0))
        port[0] = server.getsockname()[1]
        dist.send(port, other)
        connection, _ = server.accept()
        server.close()
    else:
        dist.recv(port, other)
        connection = socket.create_connection((os.environ["MASTER_ADDR"], int(port)))
    with connection:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        message = b"x" * 8

        def round_trip():
            if rank == 0:
                connection.sendall(message)
                _receive(connection, len(message))
            else:
                _receive(connection, len(message))
                connection.sendall(message)

        seconds = _median_time(round_trip, RTT_REPEATS)
    return seconds if rank == 0 else None


def _receive(connection, nbytes: int) -> None:
    while nbytes:
        chunk = connection.recv(nbytes)
        if not chunk:
            raise ConnectionError("the probe's peer closed its socket")
        nbytes -= len(chunk)


def _bandwidth(nbytes: int, seconds: float) -> Dict[str, float]:
    return {"seconds": seconds, "gbit_s": nbytes * 8 / seconds / 1e9,
            "gb_s": nbytes / seconds / 1e9}


def format_probe(probe: Dict[str, Any]) -> str:
    """The probe's figures, a few lines to print beside every result."""
    shaped = (f"links shaped to {probe['rate']} ({probe['rate_bits'] / 1e9:.3g} Gbit/s) each way"
              if probe["rate"] else "links unshaped")
    delay = f", delay {probe['delay']} one way" if probe["delay"] else ", no added delay"
    lines = [f"# cluster: {probe['nodes']} nodes x {probe['ranks_per_node']} ranks, "
             f"{shaped}{delay}; probe: {probe['nbytes'] / 2 ** 20:g} MiB, median of "
             f"{probe['repeats']}"]
    names = {"inter": "between nodes", "local": "within a node"}
    for kind, where in names.items():
        if f"{kind}_send" in probe:
            send = probe[f"{kind}_send"]
            lines.append(f"#   {where:<13}: send {send['gbit_s']:8.3f} Gbit/s "
                         f"({send['gb_s']:.3f} GB/s); round trip: TCP "
                         f"{probe[f'{kind}_tcp_rtt_s'] * 1e6:,.0f} us, gloo "
                         f"{probe[f'{kind}_rtt_s'] * 1e6:,.0f} us")
        if f"{kind}_all_reduce" in probe:
            reduce = probe[f"{kind}_all_reduce"]
            lines.append(f"#   {where:<13}: all_reduce over {reduce['ranks']} ranks "
                         f"{reduce['gbit_s']:8.3f} Gbit/s algbw ({reduce['gb_s']:.3f} GB/s), "
                         f"busbw {reduce['bus_gbit_s']:.3f} Gbit/s")
    return "\n".join(lines)


# ------------------------------------------------------------- command line

ACTION_HELP = {
    "up": "make the cluster and leave it up (prints its namespaces, links and addresses)",
    "down": "remove every cluster whose creating process has ended (`up`'s, or a killed "
            "run's); a live process's cluster is left alone",
    "probe": "make a cluster, print what its links give, remove it",
    "run": "make a cluster, probe it, run SCRIPT on every rank as torchrun would (RANK, "
           "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, "
           "GLOO_SOCKET_IFNAME set), remove it",
}


def _node_count(text: str) -> int:
    """``--nodes``: an int from 1 to ``MAX_NODES`` (an argparse ``type``)."""
    count = common.positive_number(int)(text)
    if count > MAX_NODES:
        raise argparse.ArgumentTypeError(f"at most {MAX_NODES} nodes, got {count}")
    return count


OPTIONS = [
    ("--nodes", dict(type=_node_count, default=2, metavar="N",
                     help=f"nodes (network namespaces), 1 to {MAX_NODES}, default 2")),
    ("--ranks-per-node", dict(type=common.positive_number(int), default=2, metavar="L",
                              help="ranks on each node (probe, run), default 2")),
    ("--rate", dict(default="1gbit", help="each link's rate, both ways, tc-style (default "
                                          "1gbit; e.g. 100mbit, 10gbit); 'none': unshaped")),
    ("--delay", dict(metavar="TIME", help="one-way latency between nodes (e.g. 0.1ms); needs "
                                          "the kernel's netem qdisc (sch_netem)")),
    ("--probe-mb", dict(type=common.positive_number(float), default=16.0, metavar="MB",
                        help="the probe's buffer in MiB (default 16)")),
    ("--json", dict(type=output_files.output_file, metavar="PATH",
                    help="probe, run: write the probe here")),
]


def add_parser(subparsers) -> None:
    options = argparse.ArgumentParser(add_help=False)
    for flag, settings in OPTIONS:
        options.add_argument(flag, **settings)
    parser = subparsers.add_parser(
        NAME, help="a simulated multi-node cluster on this machine (network namespaces, "
                   "shaped links; needs root): up, down, probe, or run a script on it",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"options of up, probe and run ({NAME} ACTION --help): "
               f"{', '.join(flag for flag, _ in OPTIONS)}")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action in ACTIONS:
        sub = actions.add_parser(action, help=ACTION_HELP[action],
                                 description=ACTION_HELP[action],
                                 parents=[] if action == "down" else [options])
        if action == "run":
            sub.add_argument("script", metavar="SCRIPT", help="the Python script")
            sub.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                             help="the script's arguments")


def main(args: argparse.Namespace) -> int:
    if args.action == "down":
        removed = remove_stale()
        print(f"removed {len(removed)} namespace(s){': ' if removed else ''}"
              f"{' '.join(removed)}")
        return 0
    # checked here, not by the ranks: a missing script would fail on every
    # rank only after the namespaces and the probe
    if args.action == "run" and not os.path.isfile(args.script):
        raise SystemExit(f"cluster run: SCRIPT {args.script!r} is not a file")
    try:
        cluster = Cluster(args.nodes, args.ranks_per_node,
                          rate=None if args.rate == "none" else args.rate, delay=args.delay)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"cluster: {exc}") from None
    try:
        cluster.up()
    except ClusterUnavailable as exc:
        raise SystemExit(f"cluster: {exc}") from None
    if args.action == "up":
        atexit.unregister(cluster.down)  # left up on purpose: `cluster down` removes it
        for node in cluster.nodes:
            print(f"{node.namespace} {node.interface} {node.address}")
        print(f"{cluster.switch} {BRIDGE}")
        return 0
    try:
        probe = cluster.probe(int(args.probe_mb * 2 ** 20))
        print(format_probe(probe), flush=True)
        if args.json:
            import json
            with output_files.open_output(args.json) as handle:
                json.dump(probe, handle, indent=1)
        if args.action == "run":
            statuses = cluster.run_script([args.script, *args.script_args])
            failed = {rank: status for rank, status in enumerate(statuses) if status}
            if failed:
                print(f"# ranks failed (rank: exit status): {failed}", file=sys.stderr)
                return 1
    finally:
        cluster.down()
    return 0
