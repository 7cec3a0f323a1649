"""Planning stages over the workers at hand, and re-planning when one is lost.

One planner: scheduler/pipeline.py's Algorithm 5.1 DP with its worker-order search, fed with measured
profiles (halo/pipeline/profile.py). `plan_stages` is the entry point the coordinator calls at start
and after a worker disappears (with the survivors); it knows nothing about links or sessions, so
other runtimes (tensor-parallel fault tolerance) can call it with their own device profiles.
"""

from __future__ import annotations

from dataclasses import dataclass

from halo.compute.shares import BYTES_PER_WEIGHT
from halo.errors import ConfigError
from halo.model.config import ModelConfig
from halo.scheduler.pipeline import PipelinePlan, model_units, plan_units
from halo.scheduler.profiles import DeviceProfile, ModelProfile, model_profile

from halo.pipeline.stage import n_units, unit_name


@dataclass(frozen=True)
class Stage:
    worker: int  # index into the coordinator's worker list
    start: int  # first plan unit
    stop: int  # one past the last


def model_costs(config: ModelConfig, fmt: str) -> ModelProfile:
    """fmt: a planning format (halo/compute/shares.py planning_format: "native" resolved to the file's block type,
    e.g. "Q4_0"); an unresolved "native" is priced as int8."""
    return model_profile(config, fmt if fmt in BYTES_PER_WEIGHT else "int8")


def plan_stages(devices: list[DeviceProfile], config: ModelConfig, fmt: str, context: int,
                seed: int = 0) -> tuple[list[Stage], PipelinePlan]:
    """The cheapest complete plan over `devices` (indices into that list); ConfigError naming what is
    missing when they cannot hold the model together."""
    if not devices:
        raise ConfigError("no stage workers left to plan over: start a halo-stage-worker or open the worker page")
    units = model_units(model_costs(config, fmt), context)
    plan = plan_units(list(devices), units)
    if not plan.complete:
        needed = units.memory.sum() / 1e6
        have = sum(d.memory_bytes for d in devices) / 1e6
        raise ConfigError(f"the {len(devices)} workers ({', '.join(d.name for d in devices)}) hold only units "
                          f"0..{plan.covered - 1} of {plan.n_units} ({unit_name(config, plan.covered)} does not fit): "
                          f"the model needs {needed:.0f} MB with a {context}-token cache, they offer {have:.0f} MB; "
                          "add a worker or lower --context")
    return [Stage(w, a, b) for w, a, b in plan.stages], plan


def even_stages(config: ModelConfig, n: int) -> list[Stage]:
    """n stages of (nearly) equal numbers of units on workers 0..n-1: for tests and benchmarks."""
    total = n_units(config)
    if not 0 < n <= total:
        raise ConfigError(f"{n} stages cannot split {total} units")
    bounds = [round(i * total / n) for i in range(n + 1)]
    return [Stage(i, a, b) for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]


def validate_stages(stages: list[Stage], config: ModelConfig, workers: list[str]) -> None:
    """A plan must cover the model's units in order, without gaps or overlaps, each worker at most once,
    every worker one that answered."""
    total, position, seen = n_units(config), 0, set()
    if not stages:
        raise ConfigError("the pipeline plan has no stages")
    for k, s in enumerate(stages):
        if not 0 <= s.worker < len(workers):
            raise ConfigError(f"stage {k}: worker #{s.worker} is not among the {len(workers)} workers that answered")
        if s.worker in seen:
            raise ConfigError(f"stage {k}: worker {workers[s.worker]} appears twice")
        if s.start != position or not s.start < s.stop <= total:
            raise ConfigError(f"stage {k} ({workers[s.worker]}): units [{s.start}, {s.stop}) leave a gap or overlap "
                              f"after unit {position}, or go beyond the model's {total} units")
        seen.add(s.worker)
        position = s.stop
    if position != total:
        raise ConfigError(f"the plan covers units 0..{position - 1} of {total}: {unit_name(config, position)} "
                          "and after have no worker (a partial plan cannot generate)")


def predicted_s(stages: list[Stage], devices: list[DeviceProfile], config: ModelConfig, fmt: str,
                context: int) -> float:
    """The cost model's time per token for a given plan (the sum of its stage costs)."""
    from halo.scheduler.pipeline import stage_costs

    units = model_units(model_costs(config, fmt), context)
    return float(sum(stage_costs(devices[s.worker], units)[s.start, s.stop] for s in stages))
