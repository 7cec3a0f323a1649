"""Emulated radio links for the test bed: one-way delay, jitter, bursty loss and rate per link and direction.

This machine's kernel has no netem, so a link is a small compiled forwarder (rpi/linkemu.c, built on first use with
the system's C compiler) between the device's veth and the bridge: raw Ethernet frames in, each direction its own
first-in-first-out queue that holds a frame for its delay plus uniform jitter, a two-state Gilbert-Elliott chain
that loses frames in bursts (stepped per frame and per 100 us of silence: a burst lasts a time, so sparse traffic
sees the loss rate with short bursts, not seconds-long outages), and a serialization rate.

    with LossyTestbed(n_agents=3, links="wifi-busy") as bed:    # every agent's link to the access point
        ...
    LossyTestbed(n_agents=3, links={"agent-1": "wifi-bad"})    # per device; the master stays wired unless named

A profile is a device's link to the access point: master -> agent crosses that agent's link once (the master is
wired unless it is named), so `wifi-busy` gives 5 +- 3 ms one way and a 10 +- 6 ms round trip between them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

SOURCE = Path(__file__).with_name("linkemu.c")


@dataclass(frozen=True)
class LinkProfile:
    """One direction's behaviour (both directions of a link alike). jitter: uniform +- jitter_ms around delay_ms;
    loss: mean fraction of frames lost, in bursts of `burst` frames on average (1: independent); rate_mbit: None
    for unlimited."""

    name: str
    delay_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0
    burst: float = 1.0
    rate_mbit: float | None = None

    def __post_init__(self):
        if not (0 <= self.jitter_ms <= self.delay_ms and 0 <= self.loss < 1 and self.burst >= 1
                and (self.rate_mbit is None or self.rate_mbit > 0)):
            raise ValueError(f"link profile {self.name}: need 0 <= jitter <= delay, 0 <= loss < 1, burst >= 1 and a "
                             f"positive rate (got {self})")

    def describe(self) -> str:
        """For people: '5 +- 3 ms one way, 5 % lost in bursts of ~5, 100 Mbit/s'."""
        parts = [f"{self.delay_ms:g}" + (f" +- {self.jitter_ms:g}" if self.jitter_ms else "") + " ms one way"]
        if self.loss:
            parts.append(f"{100 * self.loss:g} % lost" + (f" in bursts of ~{self.burst:g}" if self.burst > 1 else ""))
        if self.rate_mbit:
            parts.append(f"{self.rate_mbit:g} Mbit/s")
        return ", ".join(parts)

    def spec(self) -> str:
        """linkemu's SPEC: delay_us,jitter_us,loss,burst,rate_kbit."""
        return (f"{self.delay_ms * 1e3:.0f},{self.jitter_ms * 1e3:.0f},{self.loss:g},{self.burst:g},"
                f"{(self.rate_mbit or 0) * 1e3:.0f}")


PROFILES = {p.name: p for p in (
    LinkProfile("ethernet", 0.1),
    LinkProfile("wifi-good", 2.0, 1.0, 0.01, 3.0),
    LinkProfile("wifi-busy", 5.0, 3.0, 0.05, 5.0, rate_mbit=100.0),
    LinkProfile("wifi-bad", 10.0, 5.0, 0.10, 8.0),
)}
# each radio link without its losses: its delay, jitter and rate alone, what any sync mode that waits for every
# partial pays at least on it (the most HALO's dropping could save is what the losses add beyond this)
PROFILES.update({f"{name}-lossless": replace(PROFILES[name], name=f"{name}-lossless", loss=0.0, burst=1.0)
                 for name in ("wifi-good", "wifi-busy", "wifi-bad")})


def profile(name_or_profile) -> LinkProfile:
    if isinstance(name_or_profile, LinkProfile):
        return name_or_profile
    if name_or_profile not in PROFILES:
        raise ValueError(f"unknown link profile {name_or_profile!r}; choose one of {', '.join(PROFILES)}")
    return PROFILES[name_or_profile]


def linkemu_binary(cache: Path | None = None) -> Path:
    """The forwarder, compiled once per source version into the halo cache (a C compiler is needed once)."""
    from halo.model.catalog import cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    target = (cache or cache_dir().parent / "bin") / f"halo-linkemu-{digest}"
    if target.exists():
        return target
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("emulated links need a C compiler once to build rpi/linkemu.c (apt-get install gcc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")  # its own: concurrent first builds renamed
    # one shared .partial from under each other (FileNotFoundError, "Text file busy")
    done = subprocess.run([compiler, "-O2", "-o", str(partial), str(SOURCE), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {SOURCE.name} failed: {done.stderr.strip()[-800:]}")
    partial.rename(target)
    return target


class Forwarder:
    """A running linkemu between two interfaces of the root namespace (a: the device's side, b: the bridge's)."""

    def __init__(self, a: str, b: str, link: LinkProfile, seed: int = 0):
        self.link, self.counters = link, None
        self.process = subprocess.Popen([str(linkemu_binary()), a, b, link.spec(), link.spec(), str(seed)],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True, env={**os.environ, "HALO_LINKEMU_PARENT": str(os.getpid())})
        ready = self.process.stderr.readline()
        self.realtime = "real-time priority" in ready  # root's forwarders are; wake-ups come late otherwise
        if "ready" not in ready:
            self.process.kill()
            raise RuntimeError(f"the link emulator between {a} and {b} did not start: {ready.strip()} "
                               f"{self.process.stderr.read().strip()[-400:]}")

    def stop(self) -> dict[str, dict[str, int]]:
        """End it (once; later calls give the same); its counters per direction (to the bridge: a2b, to the device:
        b2a)."""
        if self.counters is not None:
            return self.counters
        if self.process.poll() is None:
            self.process.terminate()
        try:
            _, err = self.process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        self.counters = {}
        for line in err.splitlines():
            words = line.split()
            if words and words[0] in ("a2b", "b2a"):
                self.counters[words[0]] = {k: int(v) for k, v in zip(words[1::2], words[2::2])}
        return self.counters


def measure(bed, source: str, destination: str, count: int = 20000, interval_us: float = 250.0,
            port: int = 7300) -> dict:
    """One direction of a path between two bed hosts, measured with the bed's own probes (rpi/linkprobe.py):
    one-way delay, its spread, loss and the mean length of loss bursts."""
    module = [sys.executable, "-P", "-m", "halo.rpi.linkprobe"]
    receiver = bed.popen(destination, [*module, "recv", str(port), str(count), "3"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if receiver.stdout.readline().strip() != "listening":
        receiver.kill()
        raise RuntimeError(f"the probe receiver in {destination} did not start: {receiver.stderr.read()[-400:]}")
    sender = bed.popen(source, [*module, "send", bed.address(destination), str(port), str(count), str(interval_us)],
                       stderr=subprocess.PIPE, text=True)
    if sender.wait(timeout=60 + count * interval_us / 1e6) != 0:
        raise RuntimeError(f"the probe sender in {source} failed: {sender.stderr.read()[-400:]}")
    out, err = receiver.communicate(timeout=60)
    if receiver.returncode != 0:
        raise RuntimeError(f"the probe receiver in {destination} failed: {err[-400:]}")
    return json.loads(out.strip().splitlines()[-1])
