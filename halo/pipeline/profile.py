"""Measured worker profiles: what the planner knows about each stage worker.

A worker times its own engine on the model it holds (thesis 000 §4.3.2): decode steps through one
layer and through k (up to 3), so per-layer time = (tk - t1) / (k - 1) and session overhead = t1 -
per-layer time; it reports its free memory. The coordinator adds the link: round-trip time of a ping and bandwidth of
an echoed payload. `to_device` turns that into the scheduler's DeviceProfile: compute speed =
layer FLOPs / per-layer time, and the fixed per-stage costs (overhead + RTT) as its latency, so
scheduler/pipeline.py's cost (overhead + FLOPs / speed + delta + latency + bytes / bandwidth) is the
measured model.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from halo.compute.shares import BYTES_PER_WEIGHT
from halo.errors import ConfigError
from halo.scheduler.profiles import DeviceProfile, ModelProfile


@dataclass
class WorkerProfile:
    name: str
    engine: str  # numpy-cpu, torch-cuda, onnx-webgpu, onnx-wasm ...
    memory_bytes: float  # what it may use for weights and KV cache
    layer_s: float  # one decoder layer, one token (decode)
    overhead_s: float = 0.0  # fixed cost of a call into the engine
    rtt_s: float = 0.0  # coordinator <-> worker round trip
    bandwidth_bps: float = 1e9
    weight_format: str | None = None  # what the engine holds weights in (a GPU's fp16, a tab's fp32); None: as planned

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, name: str, raw: dict) -> "WorkerProfile":
        try:
            profile = cls(name, str(raw["engine"]), float(raw["memory_bytes"]), float(raw["layer_s"]),
                          float(raw.get("overhead_s", 0.0)), float(raw.get("rtt_s", 0.0)),
                          float(raw.get("bandwidth_bps", 1e9)), raw.get("weight_format"))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"worker {name}: malformed profile {raw!r} ({e!r})") from None
        if profile.weight_format is not None and profile.weight_format not in BYTES_PER_WEIGHT:
            raise ConfigError(f"worker {name}: unknown weight format {profile.weight_format!r} in its profile")
        if not (profile.memory_bytes > 0 and profile.layer_s > 0 and profile.bandwidth_bps > 0):
            raise ConfigError(f"worker {name}: profile needs positive memory, layer time and bandwidth: {raw!r}")
        return profile

    def to_device(self, model: ModelProfile, plan_format: str | None = None) -> DeviceProfile:
        """The scheduler's view. An engine that holds weights in a wider format than the plan prices (a GPU's fp16
        where the plan counts Q4_0 blocks) offers proportionally less memory in the plan's terms (KV cache
        included: conservative), so the planner never gives it more layers than it can hold."""
        layer_flops = sum(b.count * b.flops for b in model.tp_blocks)
        memory = self.memory_bytes
        if self.weight_format is not None and plan_format in BYTES_PER_WEIGHT:
            memory *= min(1.0, BYTES_PER_WEIGHT[plan_format] / BYTES_PER_WEIGHT[self.weight_format])
        return DeviceProfile(self.name, memory, layer_flops / self.layer_s, 0.0, self.bandwidth_bps,
                             max(0.0, self.overhead_s) + self.rtt_s)


def time_engine(make_engine, n_layers: int, dim: int, tokens: int = 8, warmup: int = 2,
                span: int = 3) -> tuple[float, float]:
    """(per-layer seconds, overhead seconds) from decode steps through 1 layer and through `span` layers (units
    [1, 2) and [1, 1 + span), span capped by the model). make_engine(start, stop) builds an engine; the fastest
    of `tokens` timed steps after `warmup` (the minimum: other processes on the device only ever add time). The
    difference is divided over span - 1 layers, so a disturbed sample moves the per-layer time that much less."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, dim)).astype(np.float32)
    span = max(1, min(span, n_layers))
    times = []
    for stop in sorted({2, 1 + span}):
        engine = make_engine(1, stop)
        samples = []
        for pos in range(warmup + tokens):
            t = time.perf_counter()
            engine.forward(x, pos)
            samples.append(time.perf_counter() - t)
        times.append(float(np.min(samples[warmup:])))
        del engine
    if len(times) == 1:
        return times[0], 0.0
    per_layer = max((times[1] - times[0]) / (span - 1), 0.2 * times[1] / span)  # noise can make it tiny or negative
    return per_layer, max(0.0, times[0] - per_layer)
