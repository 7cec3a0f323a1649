"""`GET /metrics`: Prometheus text format through prometheus_client.

Request-level figures are native metrics updated as requests finish; cluster figures (agent
liveness, per-device time per token, what relaxed sync dropped) are read from the engine's latest
snapshot at scrape time. Each app has its own registry (several servers may live in one process).
Rates come from counters: tokens/s = rate(halo_generated_tokens_total[1m]).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, engine):
        self.engine = engine
        self.registry = CollectorRegistry()
        self.requests = Counter("halo_requests", "HTTP generation requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.generated = Counter("halo_generated_tokens", "tokens generated", registry=self.registry)
        self.prompt = Counter("halo_prompt_tokens", "prompt tokens processed", registry=self.registry)
        self.time_per_token = Histogram("halo_time_per_token_seconds", "decode time per output token",
                                        buckets=TOKEN_BUCKETS, registry=self.registry)
        self.ttft = Histogram("halo_time_to_first_token_seconds", "arrival to first streamed text (queue included)",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.registry.register(_SnapshotCollector(engine))

    def on_generation(self, outcome, decode_ms: list[float], ttft_s: float | None) -> None:
        """Called by the engine thread when a generation completes."""
        self.count_tokens(outcome.prompt_tokens, outcome.completion_tokens)
        for ms in decode_ms:
            self.time_per_token.observe(ms / 1e3)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)

    def count_tokens(self, prompt: int, completion: int) -> None:
        """Tokens processed, whether or not their request completed (the engine thread)."""
        self.generated.inc(completion)
        self.prompt.inc(prompt)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector:
    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.snapshot or {}
        queue = self.engine.queue_state()
        yield _gauge("halo_queue_waiting", "requests waiting for the cluster", queue.get("waiting", 0))
        yield _gauge("halo_queue_limit", "--max-queue", queue.get("limit", 0))
        yield _gauge("halo_generating", "1 while a generation runs", 1 if queue.get("running") else 0)
        yield _gauge("halo_slots", "--slots: requests decoded together (each device keeps a KV cache per slot)",
                     queue.get("slots", 1))
        yield _gauge("halo_slots_busy", "slots a running request holds", queue.get("slots_busy", 0))
        yield _gauge("halo_cluster_up", "1 when the cluster is built and answered its last ping",
                     0 if s.get("state") == "down" else 1)
        totals = s.get("totals", {})
        yield _gauge("halo_tokens_per_second", "decode speed of the last completed generation",
                     totals.get("tokens_per_s") or 0.0)
        if totals.get("rounds_per_token") is not None:
            yield _gauge("halo_sync_rounds_per_token", "sync rounds a token in the last completed generation (fewer "
                         "with --speculate: a pass verifies several)", totals["rounds_per_token"])
        for name, what in (("drafted_tokens", "tokens drafted for verification (--speculate)"),
                           ("accepted_tokens", "drafted tokens the model accepted (acceptance rate: accepted / drafted)"),
                           ("passes", "forward passes after the prompts with --speculate (tokens a pass: completion "
                                      "tokens / passes)")):
            counter = CounterMetricFamily(f"halo_speculative_{name}", what)
            counter.add_metric([], totals.get(f"speculative_{name}", 0))
            yield counter
        rebuilds = CounterMetricFamily("halo_cluster_rebuilds", "cluster re-connected (and re-planned) after a failure")
        rebuilds.add_metric([], totals.get("rebuilds", 0))
        yield rebuilds
        replans = CounterMetricFamily("halo_cluster_replans", "re-plans inside the running cluster: an agent lost "
                                      "(the history replayed on the agents left) or one taken back")
        replans.add_metric([], (s.get("replans") or {}).get("count", 0))
        yield replans
        up = GaugeMetricFamily("halo_agent_up", "1 while the device answers", labels=["device", "role"])
        compute = GaugeMetricFamily("halo_device_compute_seconds_per_token",
                                    "compute per decode step, current or last generation", labels=["device"])
        wait = GaugeMetricFamily("halo_device_sync_wait_seconds_per_token",
                                 "master's wait for the device's replies per decode step", labels=["device"])
        recovered = CounterMetricFamily("halo_chunks_recovered", "UDP chunks recovered (parity or NACK)",
                                        labels=["device"])
        dropped = CounterMetricFamily("halo_datagrams_dropped",
                                      "chunks zero-filled at the deadline (cause=deadline) and datagrams discarded "
                                      "on receipt (stale, duplicate, forged, malformed, ...)", labels=["cause"])
        causes: dict[str, float] = {}
        for d in s.get("devices", []):
            up.add_metric([d["name"], d["role"]], 1 if d.get("alive") else 0)
            if d.get("compute_ms_per_token") is not None:
                compute.add_metric([d["name"]], d["compute_ms_per_token"] / 1e3)
            if d.get("wait_ms_per_token") is not None:
                wait.add_metric([d["name"]], d["wait_ms_per_token"] / 1e3)
            if d.get("chunks_recovered") is not None:
                recovered.add_metric([d["name"]], d["chunks_recovered"])
            for cause, n in (d.get("rejected") or {}).items():
                causes[cause] = causes.get(cause, 0) + n
        loss = s.get("loss") or {}
        causes["deadline"] = loss.get("chunks_missing", 0)
        for cause, n in sorted(causes.items()):
            dropped.add_metric([cause], n)
        groups = CounterMetricFamily("halo_groups_dropped", "neuron groups lost by relaxed sync (x missing fraction)",
                                     labels=["kind"])
        for kind in ("attention", "mlp"):
            groups.add_metric([kind], sum(v.get(kind, 0.0) for v in (loss.get("dropped_by_layer") or {}).values()))
        partials = CounterMetricFamily("halo_partials_dropped", "partial sums with at least one chunk zero-filled")
        partials.add_metric([], loss.get("partials_dropped", 0))
        yield from (up, compute, wait, recovered, dropped, groups, partials)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, documentation)
    g.add_metric([], value)
    return g
