"""A lossy edge cluster on one Linux machine: network namespaces, veths into a bridge, nftables loss.

    with LossyTestbed(n_agents=4) as bed:
        bed.set_loss(0.05)                       # 5 % silent loss on every agent link, both directions
    LossyTestbed(n_agents=4, links="wifi-busy")  # or radio links: delay, jitter, bursty loss, rate (rpi/links.py)
        bed.set_losses({"agent-1": 0.02})        # or per link (the others lose nothing)
        p = bed.popen("agent-1", ["python", ...])  # run a program inside an agent's namespace
        bed.drop_counters()                      # frames actually dropped, per link

Layout: namespace `<prefix>-m` (the master, 10.77.0.1) and `<prefix>-a<i>` (agent i, 10.77.0.<10+i>),
each with one veth whose peer sits in the bridge `<prefix>-br` of the root namespace (which has no
address: nothing leaves the machine). Loss is a `bridge`-family nftables table whose forward chain drops
`numgen random mod 1000 < K` frames entering or leaving each agent's veth: frames vanish in transit,
as on a radio link, and the sender's sendto() still succeeds (an output-hook drop would fail it with
EPERM, which no real link does). Segmentation offloads are off so loss applies to real frames, ARP
entries are pinned (loss hits data, not address resolution), and
TCP uses the same congestion control (cubic) in every namespace. Everything is removed on exit,
also after errors. Needs root, iproute2, nftables, ethtool and nsenter; `available()` says why not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field

SUBNET = "10.77.0"


def available() -> tuple[bool, str]:
    """(can we build the test bed here, why not)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    for tool in ("ip", "nft", "ethtool", "nsenter"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' is not installed (apt-get install iproute2 nftables ethtool util-linux)"
    name = f"halo-probe-{os.getpid()}"  # a name of its own: concurrent callers collided on one ("File exists")
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return False, f"cannot create network namespaces: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True, ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(argv), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


@dataclass
class LossyTestbed:
    n_agents: int
    prefix: str = "halo"
    rate_mbit: float | dict | None = None  # optional tc tbf cap on agent links, both ways (a dict: per agent)
    # emulated radio links (rpi/links.py): a profile name or LinkProfile for every agent, or a dict per host (the
    # master too, where named); delay, jitter, bursty loss and rate, each link in both directions
    links: object = None
    hosts: dict = field(default_factory=dict)  # name -> (namespace, address, host-side veth)
    forwarders: dict = field(default_factory=dict)  # host -> links.Forwarder
    processes: list = field(default_factory=list)  # what popen started: ended with the bed

    def __post_init__(self):
        import re

        if not 1 <= self.n_agents <= 200:
            raise ValueError("between 1 and 200 agents")
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", self.prefix):  # (nft took "1rvw" for a number, last of all)
            raise ValueError(f"prefix {self.prefix!r}: a letter, then letters and digits")
        longest = f"{self.prefix}-v{self.n_agents}" + ("d" if self.links else "")
        if len(longest) > 15:  # the kernel's interface names (IFNAMSIZ - 1): "Attribute failed policy validation"
            raise ValueError(f"prefix {self.prefix!r}: interface names such as {longest} pass Linux's 15 characters "
                             f"with {self.n_agents} agents; give a shorter prefix")
        rates = self.rate_mbit.values() if isinstance(self.rate_mbit, dict) else [self.rate_mbit]
        if any(r is not None and not 0.001 <= r for r in rates):  # (a negative rate lifted the cap: tbf 18446744Tbit)
            raise ValueError(f"rate_mbit {self.rate_mbit}: at least 0.001 (1 kbit/s), or None for no cap")
        from halo.rpi.links import profile

        if self.links is not None and not isinstance(self.links, dict):
            self.links = {f"agent-{i}": self.links for i in range(1, self.n_agents + 1)}
        self.links = {host: profile(p) for host, p in (self.links or {}).items()}  # a bad name fails here
        hosts = {"master", *(f"agent-{i}" for i in range(1, self.n_agents + 1))}
        if unknown := sorted(set(self.links) - hosts):  # (a KeyError after the whole bed was built)
            raise ValueError(f"links for {unknown}: this bed's hosts are master and agent-1..agent-{self.n_agents}")
        self.bridge = f"{self.prefix}-br"
        self.table = f"{self.prefix}_loss"
        self.hosts["master"] = (f"{self.prefix}-m", f"{SUBNET}.1", f"{self.prefix}-vm")
        for i in range(1, self.n_agents + 1):
            self.hosts[f"agent-{i}"] = (f"{self.prefix}-a{i}", f"{SUBNET}.{10 + i}", f"{self.prefix}-v{i}")

    def address(self, host: str) -> str:
        return self.hosts[host][1]

    def __enter__(self) -> "LossyTestbed":
        import threading

        if self.links and threading.current_thread() is not threading.main_thread():
            raise RuntimeError("build a bed with emulated links in the main thread: a link's forwarder ends with the "
                               "thread that started it (PR_SET_PDEATHSIG), and the link went silent with it")
        self._claim()  # before anything is removed: another process's live bed of this prefix is not a leftover
        self._on_sigterm()  # before the build: a SIGTERM while building left its namespaces and links behind
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _claim(self) -> None:
        """An exclusive lock on the prefix for the bed's life: a second bed of the same prefix removed a live one's
        namespaces and links without a word (its forwarders died, its master heard nothing)."""
        import fcntl

        folder = "/run/lock" if os.path.isdir("/run/lock") else "/tmp"
        self._lock = open(os.path.join(folder, f"halo-bed-{self.prefix}.lock"), "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            self._lock = None
            raise RuntimeError(f"a test bed with prefix {self.prefix!r} is up in another process: give this one "
                               "another prefix") from None

    def _on_sigterm(self) -> None:
        """SIGTERM (timeout, a CI cancel, systemctl stop) ends the program through the `with` block, so the bed is
        removed (its default action left every namespace, link and nft table behind)."""
        import signal
        import threading

        self._sigterm = None
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def leave(signum, frame):
                raise SystemExit(128 + signum)

            self._sigterm = signal.signal(signal.SIGTERM, leave)

    def _build(self) -> None:
        self._remove()  # leftovers of a crashed run (this prefix is ours: _claim)
        self._remove_strays()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        for name, (ns, address, veth) in self.hosts.items():
            _run("ip", "netns", "add", ns)
            if name in self.links:  # eth0 <-> device side | linkemu | wire side <-> veth in the bridge
                device_side, wire_side = self._link_ends(veth)
                _run("ip", "link", "add", device_side, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", wire_side)
                for end in (device_side, wire_side):
                    _run("sysctl", "-qw", f"net.ipv6.conf.{end}.disable_ipv6=1", check=False)  # no frames of its own
                    _run("ip", "link", "set", end, "up")
                    _run("ip", "link", "set", end, "promisc", "on")
                    for features in (("tso", "off", "gso", "off", "gro", "off"), ("tx-udp-segmentation", "off"),
                                     ("tx-gso-list", "off")):
                        _run("ethtool", "-K", end, *features, check=False)
            else:
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            for where in ((), ("ip", "netns", "exec", ns)):
                dev = veth if not where else "eth0"
                if name in self.links:  # checksums computed by the sender: a frame the link emulator re-sends from a
                    # raw socket carries what the kernel left in it (an offloaded checksum: garbage, dropped on receipt)
                    _run(*where, "ethtool", "-K", dev, "tx", "off", check=False)
                # UDP segmentation too: with it on, a segmented send (the UDP endpoint's GSO) crossed the bridge as one
                # frame and the drop rule lost all of its datagrams or none (measured: never a partial vector at 5 %)
                for features in (("tso", "off", "gso", "off", "gro", "off"), ("tx-udp-segmentation", "off"),
                                 ("tx-gso-list", "off")):  # one call each: an ethtool without a name changes nothing
                    _run(*where, "ethtool", "-K", dev, *features, check=False)
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_congestion_control=cubic", check=False)
            rate = self.rate_mbit.get(name) if isinstance(self.rate_mbit, dict) else self.rate_mbit
            if rate and name != "master":
                for where, dev in (((), veth), (("ip", "netns", "exec", ns), "eth0")):  # into and out of the agent
                    # a one-datagram bucket: every byte beyond it waits for the rate, as on a real link (a
                    # bigger bucket lets each round's few datagrams through at line rate, unlike any radio)
                    _run(*where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate}mbit",
                         "burst", "1600", "latency", "50ms")
        self._pin_neighbours()
        from halo.rpi.links import Forwarder

        for i, (name, link) in enumerate(sorted(self.links.items())):
            self.forwarders[name] = Forwarder(*self._link_ends(self.hosts[name][2]), link, seed=i + 1)
        _run("nft", "add", "table", "bridge", self.table)
        _run("nft", "add", "chain", "bridge", self.table, "forward",
             "{ type filter hook forward priority 0 ; policy accept ; }")

    def _pin_neighbours(self) -> None:
        """Permanent ARP entries between all hosts: a lost ARP request would otherwise make the kernel
        discard whole bursts while it re-resolves, which is not the loss being emulated."""
        macs = {}
        for name, (ns, address, _) in self.hosts.items():
            link = json.loads(_run("ip", "-n", ns, "-j", "link", "show", "eth0").stdout)[0]
            macs[name] = (address, link["address"])
        for name, (ns, _, _) in self.hosts.items():
            for other, (address, mac) in macs.items():
                if other != name:
                    _run("ip", "-n", ns, "neigh", "replace", address, "lladdr", mac, "dev", "eth0", "nud", "permanent")

    def set_loss(self, plr: float, hosts: list[str] | None = None) -> None:
        """Silent random loss with probability plr on the links of `hosts` (default: every agent), both ways."""
        every = [h for h in self.hosts if h != "master"]
        self.set_losses({host: plr for host in (every if hosts is None else hosts)})  # ([]: none, not every agent)

    def set_losses(self, plrs: dict[str, float]) -> None:
        """Silent random loss per agent link (host -> plr), both ways; links not named lose nothing. Checked whole
        before the rules change (a bad host or rate left the old rules flushed and half the new ones in)."""
        if unknown := sorted(set(plrs) - set(self.hosts)):
            raise ValueError(f"no host {unknown} in this bed ({', '.join(self.hosts)})")
        if not all(plr == 0 or 0.001 <= plr <= 0.999 for plr in plrs.values()):
            raise ValueError(f"plr {plrs}: 0, or from 0.001 to 0.999 (the rules drop whole thousandths)")
        _run("nft", "flush", "chain", "bridge", self.table, "forward")
        for host, plr in plrs.items():
            per_mille = int(round(plr * 1000))
            if per_mille == 0:
                continue
            veth = self.hosts[host][2]
            for direction in ("iifname", "oifname"):
                _run("nft", "add", "rule", "bridge", self.table, "forward", direction, f'"{veth}"',
                     "numgen", "random", "mod", "1000", "<", str(per_mille), "counter", "drop")

    def drop_counters(self) -> dict[str, int]:
        """Frames dropped so far per agent link (both directions together)."""
        out = _run("nft", "-j", "list", "chain", "bridge", self.table, "forward")
        dropped: dict[str, int] = {}
        for item in json.loads(out.stdout).get("nftables", []):
            rule = item.get("rule")
            if not rule:
                continue
            veth = next((e["match"]["right"] for e in rule["expr"] if "match" in e
                         and e["match"]["left"].get("meta", {}).get("key") in ("iifname", "oifname")), None)
            packets = next((e["counter"]["packets"] for e in rule["expr"] if "counter" in e), 0)
            host = next((h for h, (_, _, v) in self.hosts.items() if v == veth), str(veth))
            dropped[host] = dropped.get(host, 0) + packets
        return dropped

    @staticmethod
    def _link_ends(veth: str) -> tuple[str, str]:
        """An emulated link's two root-namespace interfaces: the device's side and the bridge's side."""
        return veth + "d", veth + "w"

    def link_counters(self) -> dict[str, dict]:
        """Each emulated link's forwarder counters (frames received, lost, sent per direction), stopping them:
        call at the end (teardown does it too)."""
        return {host: forwarder.stop() for host, forwarder in self.forwarders.items()}

    def popen(self, host: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Run a program in a host's network namespace (ended with the bed). nsenter enters only the network
        namespace: `ip netns exec` also remounts /sys, which hides /sys/fs/cgroup, so a process could not see its own
        memory or CPU limit."""
        process = subprocess.Popen(["nsenter", f"--net=/run/netns/{self.hosts[host][0]}", *argv], **kwargs)
        self.processes.append(process)
        return process

    def _remove_strays(self) -> None:
        """Namespaces and links of this prefix a crashed run with more agents left (teardown knows this bed's)."""
        import re

        ours = re.compile(rf"{re.escape(self.prefix)}-(a\d+|m|v\d+[dw]?|vm[dw]?|br)")
        for ns in _run("ip", "netns", "list", check=False).stdout.split():
            if ours.fullmatch(ns):
                _run("ip", "netns", "del", ns, check=False)
        for link in json.loads(_run("ip", "-j", "link", "show", check=False).stdout or "[]"):
            if ours.fullmatch(link.get("ifname", "")):
                _run("ip", "link", "del", link["ifname"], check=False)

    def teardown(self) -> None:
        """Everything the bed made removed, what it started ended, the prefix given back."""
        self._remove()
        if getattr(self, "_sigterm", None) is not None:
            import signal

            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None
        if getattr(self, "_lock", None) is not None:  # (released last: the prefix is free once all of it is gone)
            self._lock.close()
            self._lock = None

    def _remove(self) -> None:
        for process in self.processes:  # (one left running held its namespace alive, unlisted)
            if process.poll() is None:
                process.kill()
                process.wait()
        self.processes = []
        for forwarder in self.forwarders.values():
            forwarder.stop()
        self.forwarders = {}
        _run("nft", "delete", "table", "bridge", self.table, check=False)
        for _, (ns, _, veth) in self.hosts.items():
            for link in (veth, *self._link_ends(veth)):
                _run("ip", "link", "del", link, check=False)
            _run("ip", "netns", "del", ns, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
