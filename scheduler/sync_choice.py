"""`--sync auto`: exact or HALO sync, and how many copies of each vector, picked from the agents' measured links.

What the measurements say (master + 3 agents, TinyLlama shape, 8 layers, Q4_0, emulated links;
eval/results/profiles_headline.md, copies_*.md, halo_deadlines_wifi_busy.md; one to three runs each): where a lost
datagram costs little to recover, a round trip well under a millisecond (wired links; the plain namespace bed even at
2-5 % loss), HALO sync's predictors and re-mapping cost more than its deadline saves (1.2-1.5x exact's time on
`ethernet`); at 1 % loss in bursts over ~4 ms round trips (`wifi-good`) the two tie (0.97-1.07x); from 5 % in bursts
over ~10 ms (`wifi-busy`) HALO's per-agent deadlines cut the rounds a recovery would stretch (0.79-0.86x exact), at
10 % over ~20 ms (`wifi-bad`) too (0.87x). Sending every vector twice once a link has shown loss
(SyncSettings.copies) turns most of those recoveries into nothing, for both modes: exact 0.80-0.82x / 0.69-0.75x its
one-copy time on wifi-busy / wifi-bad, but 0.99-1.04x on wifi-good, where a recovery is rare. So: HALO where some
agent's link lost at least `HALO_PLR` of its probes and has a least round trip of `MIN_RTT_S` or more, and predictors
exist; exact everywhere else (exact also keeps one device's tokens, so it wins ties); two copies on such links
whichever mode is picked.
Thresholds from a few runs per profile: to revisit as runs accumulate.
"""

from __future__ import annotations

from dataclasses import dataclass

from halo.scheduler.profiles import Cluster

MIN_RTT_S = 1e-3  # least round trip of a radio-like link (wired and loopback: ~0.1-0.2 ms)
HALO_PLR = 0.03  # probes lost (of 400) from which HALO and two copies paid (wifi-busy's 5 %; wifi-good's 1 %: no)
COPIES = 2  # copies of each vector on such links


@dataclass(frozen=True)
class SyncChoice:
    mode: str  # "exact" or "halo"
    reason: str  # for people: what was measured and why this mode
    copies: int = 1  # SyncSettings.copies: each vector sent this many times once a link has shown loss

    def to_json(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "copies": self.copies}


def choose_sync(cluster: Cluster, predictors: bool) -> SyncChoice:
    """The sync mode for a measured cluster (agents: every device but the master; plr and latency_s = half the least
    round trip, as measured_device sets them). predictors: whether the model has trained predictors (HALO needs them)."""
    agents = [d for i, d in enumerate(cluster.devices) if i != cluster.master]
    if not agents:
        return SyncChoice("exact", "no agents: nothing to synchronize")
    radio = [d for d in agents if d.plr >= HALO_PLR and 2 * d.latency_s >= MIN_RTT_S]
    worst = max(agents, key=lambda d: (d.plr, d.latency_s))
    measured = f"{worst.name}: {100 * worst.plr:.1f} % of probes lost, least round trip {2e3 * worst.latency_s:.2f} ms"
    if not radio:
        return SyncChoice("exact", f"no link both loses {100 * HALO_PLR:g} % of its datagrams or more and has a round trip "
                                   f"of {1e3 * MIN_RTT_S:g} ms or more (worst {measured}): recovering a loss costs little "
                                   "or is rare, exact is as fast and gives one device's tokens")
    copies = (f"; every vector goes out {COPIES} times on lossy links (a burst of losses rarely takes both copies, "
              "where recovering costs a round trip)")
    if not predictors:
        return SyncChoice("exact", f"lossy radio-like links ({measured}) favour HALO sync, but this model has no trained "
                                   "predictors (halo-train-predictors makes them)" + copies, COPIES)
    lossiest = max(radio, key=lambda d: (d.plr, d.latency_s))
    return SyncChoice("halo", f"{len(radio)} of {len(agents)} links lose datagrams with round trips of milliseconds "
                              f"({lossiest.name}: {100 * lossiest.plr:.1f} % of probes lost, least round trip "
                              f"{2e3 * lossiest.latency_s:.2f} ms): a recovery costs a round trip, HALO's deadline drops "
                              "only unimportant partials instead" + copies, COPIES)
