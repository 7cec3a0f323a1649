"""`--sync auto`: exact or HALO sync, picked from the agents' measured links.

What the measurements say (eval/results/profiles_headline.md, master + 3 agents, TinyLlama shape): where a lost
datagram costs little to recover, i.e. a round trip well under a millisecond (wired links; the plain namespace bed
even at 2-5 % loss), HALO sync's predictors and re-mapping cost more than its relaxed deadline saves (1.16x exact's
time on the `ethernet` profile); on radio-like links, a round trip of milliseconds with losses in bursts, a recovery
costs a round trip and HALO's deadline wins (0.91x on `wifi-good`, 0.94x on `wifi-busy`), until losses are so frequent
(10 % on `wifi-bad`) that nearly every round waits for a critical partial's recovery anyway (1.02x). So: HALO where
some agent's link lost probes, at most `MAX_PLR` of them, and has a least round trip of at least `MIN_RTT_S`, and
predictors exist; exact everywhere else (exact also keeps one device's tokens, so it wins ties). One run per profile:
thresholds to revisit as runs accumulate.
"""

from __future__ import annotations

from dataclasses import dataclass

from halo.scheduler.profiles import Cluster

MIN_RTT_S = 1e-3  # least round trip of a radio-like link (wired and loopback: ~0.1-0.2 ms)
MIN_PLR = 0.0  # any measured loss (the planning probe: 400 datagrams)
MAX_PLR = 0.08  # beyond it (wifi-bad: 10 % in bursts of ~8) the critical partials' recoveries dominate: HALO 1.02x


@dataclass(frozen=True)
class SyncChoice:
    mode: str  # "exact" or "halo"
    reason: str  # for people: what was measured and why this mode

    def to_json(self) -> dict:
        return {"mode": self.mode, "reason": self.reason}


def choose_sync(cluster: Cluster, predictors: bool) -> SyncChoice:
    """The sync mode for a measured cluster (agents: every device but the master; plr and latency_s = half the least
    round trip, as measured_device sets them). predictors: whether the model has trained predictors (HALO needs them)."""
    agents = [d for i, d in enumerate(cluster.devices) if i != cluster.master]
    lossy = [d for d in agents if d.plr > MIN_PLR and 2 * d.latency_s >= MIN_RTT_S]
    if not agents:
        return SyncChoice("exact", "no agents: nothing to synchronize")
    worst = max(agents, key=lambda d: (d.plr, d.latency_s))
    measured = f"{worst.name}: {100 * worst.plr:.1f} % of probes lost, least round trip {2e3 * worst.latency_s:.2f} ms"
    if worst.plr > MAX_PLR:
        return SyncChoice("exact", f"a link loses more than {100 * MAX_PLR:g} % ({measured}): then most rounds wait for "
                                   "a critical partial's recovery anyway, and HALO sync measured no faster than exact")
    if not lossy:
        return SyncChoice("exact", f"no link both loses datagrams and has a round trip of {1e3 * MIN_RTT_S:g} ms or more "
                                   f"(worst {measured}): recovering a loss costs little, exact is as fast and gives one "
                                   "device's tokens")
    if not predictors:
        return SyncChoice("exact", f"lossy radio-like links ({measured}) favour HALO sync, but this model has no trained "
                                   "predictors (halo-train-predictors makes them)")
    radio = max(lossy, key=lambda d: (d.plr, d.latency_s))
    return SyncChoice("halo", f"{len(lossy)} of {len(agents)} links lose datagrams with round trips of milliseconds "
                              f"({radio.name}: {100 * radio.plr:.1f} % of probes lost, least round trip "
                              f"{2e3 * radio.latency_s:.2f} ms): a recovery costs a round trip, HALO's deadline drops only "
                              "unimportant partials instead")
