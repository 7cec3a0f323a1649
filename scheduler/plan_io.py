"""Versioned JSON plans for both modes, and loading them back with validation.

Schema (version 1), common fields: {"format": "halo-plan", "version": 1, "mode": "tp" | "pipeline",
"model": {...profile...}, "cluster": {"context", "weights", "devices": [{name, address, memory_bytes,
compute_flops, plr, bandwidth_bps, latency_s, overhead_s, message_s, master}]}} (the last three optional).

mode "tp" adds: "algorithm"; "participants": [device names, master first]; "counts": {"attention":
[[groups per layer] per participant], "mlp": same, "lm_head": [groups per participant]};
"priority": {"attention" | "mlp": [[[start, stop] per layer] per participant], "lm_head":
[[start, stop] per participant]} (Algorithm 3 rank ranges, rank 0 = most important);
"estimate": {sync mode ("ideal" = Eq. 1, or a runtime --sync mode): {ms_per_token, compute_ms, comm_ms, loss_ms}}.

mode "pipeline" adds: "units": [unit names]; "stages": [{"worker": name, "start": i, "stop": j}]
(half-open unit ranges in order); "complete": bool; "cost_ms".
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from halo.arguments import check_integer, check_number
from halo.errors import ConfigError

from halo.scheduler.cost import ESTIMATE_MODES, estimate
from halo.scheduler.pipeline import PipelinePlan
from halo.scheduler.plan import TP_KINDS, TensorParallelPlan
from halo.scheduler.profiles import BlockProfile, Cluster, DeviceProfile, ModelProfile

FORMAT, VERSION = "halo-plan", 1


def _cluster_json(cluster: Cluster) -> dict:
    return {"context": cluster.context, "weights": cluster.weights, "devices": [
        {"name": d.name, "address": d.address, "memory_bytes": d.memory_bytes, "compute_flops": d.compute_flops,
         "plr": d.plr, "bandwidth_bps": d.bandwidth_bps, "latency_s": d.latency_s, "overhead_s": list(d.overhead_s),
         "message_s": d.message_s, "master": i == cluster.master} for i, d in enumerate(cluster.devices)]}


def _model_json(model: ModelProfile) -> dict:
    blocks = {b.kind: {"count": b.count, "bytes": b.bytes, "flops": b.flops, "kv_bytes_per_token": b.kv_bytes_per_token}
              for b in (model.attention, model.mlp, model.lm_head)}
    return {"name": model.name, "n_layers": model.n_layers, "dim": model.dim, "blocks": blocks,
            "embedding_bytes": model.embedding_bytes, "predictor_bytes": model.predictor_bytes, "rows": model.rows}


def tp_plan_json(plan: TensorParallelPlan) -> dict:
    names = [d.name for d in plan.profiles()]
    priority = {kind: plan.priority_ranks(kind).tolist() for kind in TP_KINDS}
    priority["lm_head"] = plan.priority_ranks("lm_head")[:, 0].tolist()
    return {"format": FORMAT, "version": VERSION, "mode": "tp", "algorithm": plan.algorithm,
            "model": _model_json(plan.model), "cluster": _cluster_json(plan.cluster), "participants": names,
            "counts": {k: v.tolist() for k, v in plan.counts.items()}, "priority": priority,
            "memory_used_bytes": plan.memory_used().tolist(), "oom": plan.oom,
            "estimate": {mode: estimate(plan, mode).to_json() for mode in ESTIMATE_MODES}}


def plan_summary(plan: TensorParallelPlan, mode: str, cost=None) -> dict:
    """What a plan does and why, per device of its cluster (participant or left out): the figures it was
    planned from, its share per block (groups per layer, mean) and its Algorithm-3 rank range (lowest start,
    highest stop over the layers; rank 0 = most important), and the estimate for the sync mode; for a device
    left out, the estimates of Min-Max and of an even split with it taking part too (`with_it`)."""
    cost = cost or estimate(plan, mode)
    position = {i: j for j, i in enumerate(plan.devices)}
    rows = []
    for i, d in enumerate(plan.cluster.devices):
        row = {"name": d.name, "address": d.address, "master": i == plan.cluster.master, "memory_mb": d.memory_bytes / 1e6,
               "gflops": d.compute_flops / 1e9, "overhead_ms": [1e3 * o for o in d.overhead_s],
               "message_ms": 1e3 * d.message_s, "plr": d.plr, "latency_ms": 1e3 * d.latency_s,
               "bandwidth_mbps": d.bandwidth_bps / 1e6, "participant": i in position}
        if i not in position:  # why: the plan with it as well (Min-Max over the participants and it)
            row["with_it"] = _estimate_with(plan, i, mode)
        else:
            j = position[i]
            row["memory_used_mb"] = float(plan.memory_used()[j]) / 1e6
            for kind in TP_KINDS + ("lm_head",):
                ranks = plan.priority_ranks(kind)[j]
                held = ranks[:, 1] > ranks[:, 0]
                row[kind] = {"groups_per_layer": float(np.mean(plan.counts[kind][j])),
                             "ranks": [int(ranks[held, 0].min()), int(ranks[held, 1].max())] if held.any() else None}
        rows.append(row)
    return {"algorithm": plan.algorithm, "mode": mode, "estimate": cost.to_json(), "sync_rounds": plan.sync_rounds(),
            "devices": rows}


def _estimate_with(plan: TensorParallelPlan, device: int, mode: str) -> dict:
    """Why a device was left out: the estimates of Min-Max (and its groups there) and of an even split over
    the participants and it."""
    from halo.scheduler.ratios import InsufficientMemory
    from halo.scheduler.tp_plan import build_plan

    out = {}
    for algorithm in ("minmax", "vanilla"):
        try:
            other = build_plan(plan.cluster, plan.model, algorithm, [*plan.devices, device], prune=False)
        except InsufficientMemory:
            continue
        out[f"{algorithm}_ms"] = 1e3 * estimate(other, mode).total_s
        out[f"{algorithm}_groups"] = int(sum(other.counts[k][-1].sum() for k in other.counts))
    return out


def pipeline_plan_json(plan: PipelinePlan, cluster: Cluster, model: ModelProfile) -> dict:
    return {"format": FORMAT, "version": VERSION, "mode": "pipeline", "model": _model_json(model),
            "cluster": _cluster_json(cluster), "units": plan.unit_names,
            "stages": [{"worker": plan.workers[w].name, "start": a, "stop": b} for w, a, b in plan.stages],
            "complete": plan.complete, "cost_ms": 1e3 * plan.cost_s if plan.complete else None}


def check_writable(path: str | Path) -> None:
    """Where a plan will be written can take it: checked before planning (a MILP or a measurement takes a while)."""
    path = Path(path)
    folder = path.parent
    if path.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
        why = "is a directory" if path.is_dir() else f"{folder} is not a directory this user can write"
        raise ConfigError(f"--out {path}: {why}; give a file path in a writable directory")


def save(document: dict, path: str | Path) -> None:
    try:
        Path(path).write_text(json.dumps(document, indent=1) + "\n")
    except OSError as e:
        raise ConfigError(f"cannot write the plan to {path}: {e.strerror or e}") from None


def _require(condition: bool, where: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{where}: {message}")


def load(path: str | Path) -> TensorParallelPlan | tuple[PipelinePlan, Cluster, ModelProfile]:
    """Read a plan file back; every inconsistency is an error naming the field."""
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"{where}: no such plan file") from e
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the plan file ({e})") from e
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting beyond the stack
        raise ConfigError(f"{where}: not valid JSON ({type(e).__name__}: {e})") from e
    _require(isinstance(doc, dict) and doc.get("format") == FORMAT, where, f"not a {FORMAT} file")
    _require(doc.get("version") == VERSION, where,
             f"plan version {doc.get('version')!r} is not supported (this halo reads version {VERSION}); re-run halo-master plan")
    try:
        cluster = Cluster(tuple(DeviceProfile(d["name"], d["memory_bytes"], d["compute_flops"], d["plr"], d["bandwidth_bps"],
                                              d["latency_s"], d.get("address", ""), bool(d.get("master")),
                                              tuple(d.get("overhead_s", (0.0,) * 3)), float(d.get("message_s", 0.0)))
                                for d in doc["cluster"]["devices"]),
                          check_integer(doc["cluster"]["context"], "cluster.context", 1), doc["cluster"]["weights"])
        mj = doc["model"]
        blocks = {k: BlockProfile(k, check_integer(mj["blocks"][k]["count"], f"model.blocks.{k}.count", 1),
                                  *(check_number(mj["blocks"][k][f], f"model.blocks.{k}.{f}", 0)
                                    for f in ("bytes", "flops", "kv_bytes_per_token")))
                  for k in ("attention", "mlp", "lm_head")}
        model = ModelProfile(str(mj["name"]), check_integer(mj["n_layers"], "model.n_layers", 1),
                             check_integer(mj["dim"], "model.dim", 1), blocks["attention"], blocks["mlp"], blocks["lm_head"],
                             check_number(mj["embedding_bytes"], "model.embedding_bytes", 0),
                             check_number(mj["predictor_bytes"], "model.predictor_bytes", 0),
                             check_integer(mj.get("rows", 1), "model.rows", 1))  # (plans saved before batching: 1)
    except (KeyError, TypeError, IndexError) as e:
        raise ConfigError(f"{where}: malformed model or cluster section ({e!r:.200})") from e
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    if doc.get("mode") == "tp":
        return _load_tp(doc, cluster, model, where)
    if doc.get("mode") == "pipeline":
        return _load_pipeline(doc, cluster, model, where), cluster, model
    raise ConfigError(f"{where}: mode {doc.get('mode')!r} is neither 'tp' nor 'pipeline'")


def _load_tp(doc: dict, cluster: Cluster, model: ModelProfile, where: str) -> TensorParallelPlan:
    index = {d.name: i for i, d in enumerate(cluster.devices)}
    names = doc.get("participants", [])
    _require(isinstance(names, list) and all(isinstance(n, str) for n in names), where,
             "participants must be a list of device names")
    _require(len(set(names)) == len(names) and all(n in index for n in names), where,
             f"participants {names} must be distinct devices of the cluster")
    _require(bool(names) and index[names[0]] == cluster.master, where, "the master must be the first participant")
    counts = {}
    for kind in TP_KINDS + ("lm_head",):
        block = getattr(model, kind)
        try:
            array = np.asarray(doc["counts"][kind])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: counts.{kind} is missing or not integers") from e
        _require(array.dtype.kind in "iu" or array.size == 0, where, f"counts.{kind} must hold integers")
        array = array.astype(np.int64)
        shape = (len(names), model.n_layers) if kind != "lm_head" else (len(names),)
        _require(array.shape == shape, where, f"counts.{kind} has shape {array.shape}, expected {shape}")
        _require((array >= 0).all(), where, f"counts.{kind} has negative entries")
        sums = array.sum(axis=0)
        _require(np.all(sums == block.count), where,
                 f"counts.{kind} do not sum to the {block.count} groups per layer (found {sorted(set(np.atleast_1d(sums).tolist()))})")
        counts[kind] = array
    plan = TensorParallelPlan(cluster, model, str(doc.get("algorithm", "")), [index[n] for n in names], counts)
    for kind in TP_KINDS + ("lm_head",):
        expected = plan.priority_ranks(kind)
        priority = doc.get("priority", {})
        _require(isinstance(priority, dict), where, "priority must map block kinds to rank ranges")
        try:
            given = np.asarray(priority.get(kind, []))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: priority.{kind} is not a regular array of rank ranges") from e
        if kind == "lm_head":
            given = given[:, None] if given.ndim == 2 else given
        _require(given.shape == expected.shape and np.array_equal(given, expected), where,
                 f"priority.{kind} ranges do not match the counts and link loss rates (overlapping or missing ranks)")
    over = plan.memory_used() > np.array([d.memory_bytes for d in plan.profiles()]) * (1 + 1e-9)
    plan.oom = [d.name for d, o in zip(plan.profiles(), over) if o]  # from the counts (the file's list was dropped)
    return plan


def _load_pipeline(doc: dict, cluster: Cluster, model: ModelProfile, where: str) -> PipelinePlan:
    index = {d.name: i for i, d in enumerate(cluster.devices)}
    units = doc.get("units", [])
    _require(isinstance(units, list) and all(isinstance(u, str) for u in units), where, "units must be a list of names")
    _require(isinstance(doc.get("stages", []), list), where, "stages must be a list")
    _require(len(units) == model.n_layers + 2, where, f"expected {model.n_layers + 2} units, found {len(units)}")
    stages, position, seen = [], 0, set()
    for k, stage in enumerate(doc.get("stages", [])):
        try:
            worker = stage["worker"]
            start, stop = (check_integer(stage[end], f"stage {k} {end}") for end in ("start", "stop"))
        except (KeyError, TypeError, IndexError, ConfigError) as e:
            raise ConfigError(f"{where}: stage {k} is malformed ({e!r:.200})") from e
        _require(isinstance(worker, str) and worker in index, where, f"stage {k}: unknown worker {worker!r}")
        _require(worker not in seen, where, f"stage {k}: worker {worker!r} appears twice")
        _require(start == position, where, f"stage {k}: range [{start}, {stop}) overlaps or leaves a gap after unit {position}")
        _require(start < stop <= len(units), where, f"stage {k}: range [{start}, {stop}) is empty or beyond {len(units)} units")
        seen.add(worker)
        stages.append((index[worker], start, stop))
        position = stop
    cost = doc.get("cost_ms")
    _require(cost is None or (isinstance(cost, (int, float)) and not isinstance(cost, bool)), where,
             f"cost_ms must be a number or null, got {cost!r:.50}")
    return PipelinePlan(stages, len(units), cost / 1e3 if cost is not None else float("inf"), list(cluster.devices), units)
