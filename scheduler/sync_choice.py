"""`--sync auto`: the sync mode, and how many copies of each vector, picked from the agents' measured links.

It picks exact sync, with two copies of every vector on radio-like links (some agent's link lost at least `LOSSY_PLR`
of its probes over a least round trip of `MIN_RTT_S` or more). Measured (master + 3 agents on the bed's emulated
links, eval/results/accuracy_bed_*.md, sweep_wifi_busy*.md, copies_*.md):
- Two copies turn most recoveries into nothing, in either mode: exact 0.80-0.82x / 0.69-0.75x its one-copy time on
  wifi-busy / wifi-bad, 0.99-1.04x on wifi-good, where a recovery is rare.
- HALO sync is not picked. On wifi-busy (SmolLM2, 30 layers) its deadlines dropped 3-5 % of the agents' partials:
  perplexity +11 %, 6 % of chat answers the single device's, for 0.94x exact's time. Looser deadlines kept perplexity
  within 1 % only where they no longer saved time (0.98x). Wired links never favoured it (1.2-1.5x exact's time).
  `--sync halo` stays for whoever chooses that trade.
Exact also gives one device's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from halo.scheduler.profiles import Cluster

MIN_RTT_S = 1e-3  # least round trip of a radio-like link (wired and loopback: ~0.1-0.2 ms)
LOSSY_PLR = 0.03  # probes lost (of 400) from which two copies paid (wifi-busy's 5 %; wifi-good's 1 %: no)
COPIES = 2  # copies of each vector on such links


@dataclass(frozen=True)
class SyncChoice:
    mode: str  # "exact" (the only pick today: see the module's docstring) or "halo"
    reason: str  # for people: what was measured and why this mode
    copies: int = 1  # SyncSettings.copies: each vector sent this many times once a link has shown loss

    def to_json(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "copies": self.copies}


def choose_sync(cluster: Cluster) -> SyncChoice:
    """The sync mode for a measured cluster (agents: every device but the master; plr and latency_s = half the least
    round trip, as measured_device sets them)."""
    agents = [d for i, d in enumerate(cluster.devices) if i != cluster.master]
    if not agents:
        return SyncChoice("exact", "no agents: nothing to synchronize")
    radio = [d for d in agents if d.plr >= LOSSY_PLR and 2 * d.latency_s >= MIN_RTT_S]
    worst = max(agents, key=lambda d: (d.plr, d.latency_s))
    measured = f"{worst.name}: {100 * worst.plr:.1f} % of probes lost, least round trip {2e3 * worst.latency_s:.2f} ms"
    if not radio:
        return SyncChoice("exact", f"no link both loses {100 * LOSSY_PLR:g} % of its datagrams or more and has a round "
                                   f"trip of {1e3 * MIN_RTT_S:g} ms or more (worst {measured}): recovering a loss costs "
                                   "little or is rare; exact gives one device's tokens")
    lossiest = max(radio, key=lambda d: (d.plr, d.latency_s))
    return SyncChoice("exact", f"{len(radio)} of {len(agents)} links lose datagrams with round trips of milliseconds "
                               f"({lossiest.name}: {100 * lossiest.plr:.1f} % of probes lost, least round trip "
                               f"{2e3 * lossiest.latency_s:.2f} ms): every vector goes out {COPIES} times on lossy "
                               "links (a burst of losses rarely takes both copies, where recovering costs a round "
                               "trip). Exact, not HALO: on such links HALO's deadlines dropped enough partials to "
                               "change most answers for a few percent of speed", COPIES)
