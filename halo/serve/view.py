"""The cluster view: who computes what, how fast, what the links lose and what relaxed sync dropped.

`build_snapshot` turns the runtime's own reports (`DistributedModel.report()` per agent,
`sync_report()` with the loss ledger) plus the serving engine's counters into one JSON-ready dict;
the web page and `halo-master status --watch --server URL` show that dict, `render` as a rich table.

Per-token figures are deltas over the decode steps of the current (or last) generation, the prefill
excluded: compute = what the device reports computing; wait = how long its partial sums took to come
back: on the control connection, the master's wait for the reply (tcp modes), over UDP, the time from
sending a round's input to holding the device's whole partial or giving up on it (UDP modes);
sync = wait - compute, i.e. link round trip + queueing. `sync_ms_p50` adds the median of the UDP
gathers the device took part in.
"""

from __future__ import annotations

import math
import time

GAPS: tuple[str, ...] = ()  # figures the runtime does not expose yet (the page lists them)


def reports(model) -> tuple[list[dict], list[dict]]:
    """(tensor-parallel agents' rows, pipeline stages' rows) of a model's report (a single process: neither). A
    pipeline's report is a dict of stages: read as agent rows, `serve --mode pipeline` died at start."""
    report = model.report() if hasattr(model, "report") else []
    return ([], report["stages"]) if isinstance(report, dict) else (report, [])


def counters(model) -> dict:
    """Cumulative per-device counters now (engine thread only)."""
    agents, stages = reports(model)
    out = {row["name"]: {"compute_ms": float(row.get("compute_ms", 0.0)),
                         "wait_ms": float(row.get("wait_ms", 0.0)) + float(row.get("reply_ms", 0.0))} for row in agents}
    out.update({stage["worker"]: {"compute_ms": float(stage.get("compute_ms", 0.0)),
                                  "wait_ms": float(stage.get("wall_ms", 0.0))} for stage in stages})
    out["master"] = {"compute_ms": float(getattr(model, "own_compute_ms", 0.0)), "wait_ms": 0.0}
    return out


def _groups_total(config) -> tuple[int, int, int]:
    from halo.compute.neuron_groups import GroupLayout

    layout = GroupLayout.for_model(config)
    return config.n_layers * layout.n_heads, config.n_layers * layout.n_mlp_groups, layout.n_vocab_groups


def _groups(device: dict) -> str:
    """heads/MLP/vocabulary groups of a tensor-parallel device ("-" for a pipeline stage: it holds whole layers)."""
    counts = [device.get(k) for k in ("heads", "mlp_groups", "vocab_groups")]
    return "-" if None in counts else "/".join(map(str, counts))


def _r(value, digits: int = 3):
    return None if value is None or not math.isfinite(value) else round(float(value), digits)


def build_snapshot(engine, state: str, live=None, final: bool = False, previous: dict | None = None) -> dict:
    """live: (counters at the end of the prefill, decode steps since (a batch: tokens chosen since), seconds since) or
    None (idle)."""
    previous = previous or {}
    model = engine.model
    t = engine.totals
    snapshot = {
        "time": time.time(), "model": engine.model_name, "sync": engine.sync_mode, "state": state,
        "queue": engine.queue_state(),
        "totals": {"requests": dict(t.requests), "prompt_tokens": t.prompt_tokens,
                   "completion_tokens": t.completion_tokens, "rebuilds": t.rebuilds,
                   "tokens_per_s": _r(t.last_tokens_per_s, 2), "ms_per_token": _r(t.last_ms_per_token, 2),
                   "last_error": t.last_error, "speculative_drafted_tokens": t.speculative_drafted_tokens,
                   "speculative_accepted_tokens": t.speculative_accepted_tokens,
                   "speculative_passes": t.speculative_passes, "rounds_per_token": t.last_rounds_per_token},
        "gaps": list(GAPS),
    }
    if model is None:  # down: keep the last known devices, marked
        devices = [dict(d) for d in previous.get("devices", [])]
        for d in devices:
            d["alive"] = d["role"] == "master" or d["name"] not in engine.agent_errors
            d["error"] = engine.agent_errors.get(d["name"])
        snapshot.update(devices=devices, loss=previous.get("loss"), current=previous.get("current"),
                        replans=previous.get("replans"))
        return snapshot

    rows, stages = reports(model)
    heads, mlp, vocab = _groups_total(engine.weights.config)
    total = heads + mlp + vocab
    per_token, current = _per_token(engine, counters(model), live, final)
    current = current or previous.get("current")
    old = {d["name"]: d for d in previous.get("devices", [])}

    def figures(name: str) -> dict:
        if name in per_token:
            return per_token[name]
        return {k: old.get(name, {}).get(k) for k in ("compute_ms_per_token", "wait_ms_per_token", "sync_ms_per_token")}

    devices = []
    if stages:  # a pipeline: each stage worker runs a range of units (embedding, layers, head)
        units = engine.weights.config.n_layers + 2
        for st in stages:
            devices.append({"name": st["worker"], "role": "stage", "endpoint": f"units {st['start']}..{st['stop'] - 1}"
                            f" on {st.get('engine', '?')}", "alive": st["worker"] not in engine.agent_errors,
                            "error": engine.agent_errors.get(st["worker"]), "heads": None, "mlp_groups": None,
                            "vocab_groups": None, "share": _r((st["stop"] - st["start"]) / units),
                            **figures(st["worker"])})
    elif not rows:  # a single process: the master computes everything
        devices.append({"name": "master", "role": "master", "endpoint": "this process", "alive": True, "error": None,
                        "heads": heads, "mlp_groups": mlp, "vocab_groups": vocab, "share": 1.0,
                        **figures("master")})
        if "master" not in per_token and current:
            devices[0]["compute_ms_per_token"] = current["ms_per_token"]
    else:
        agents_groups = [r["heads"] + r["mlp_groups"] + r["vocab_groups"] for r in rows]
        devices.append({"name": "master", "role": "master", "endpoint": "this process", "alive": True, "error": None,
                        "heads": heads - sum(r["heads"] for r in rows),
                        "mlp_groups": mlp - sum(r["mlp_groups"] for r in rows),
                        "vocab_groups": vocab - sum(r["vocab_groups"] for r in rows),
                        "share": _r((total - sum(agents_groups)) / total), **figures("master")})
        for r, groups in zip(rows, agents_groups):
            devices.append({**_agent_row(engine, r), "share": _r(groups / total), **figures(r["name"])})
    snapshot["devices"] = devices
    if hasattr(model, "survival_report"):  # agents lost and taken back inside the running cluster
        recoveries = model.survival_report()["recoveries"]
        snapshot["replans"] = {"count": len(recoveries), "last": recoveries[-1] if recoveries else None}
    snapshot["current"] = current
    sync = model.sync_report() if hasattr(model, "sync_report") else None
    snapshot["loss"] = sync["loss"] if sync else None
    if sync and "predict_ms" in sync:
        snapshot["predict_ms"], snapshot["load_ms"] = sync["predict_ms"], sync["load_ms"]
    return snapshot


def _per_token(engine, now: dict, live, final: bool) -> tuple[dict, dict | None]:
    """Per device compute / wait / sync per decode step since the prefill, and the generation's pace."""
    if live is None or live[1] <= 0:
        return {}, None
    base, steps, seconds = live
    per_token = {}
    for name, c in now.items():
        b = base.get(name, {"compute_ms": 0.0, "wait_ms": 0.0})
        since = {k: c[k] - b[k] if c[k] >= b[k] else c[k] for k in c}  # counters restart with a re-plan's new master
        compute, wait = since["compute_ms"] / steps, since["wait_ms"] / steps
        per_token[name] = {"compute_ms_per_token": _r(compute), "wait_ms_per_token": _r(wait),
                           "sync_ms_per_token": _r(max(0.0, wait - compute)) if name != "master" else None}
    current = {"decode_steps": steps, "ms_per_token": _r(1e3 * seconds / steps, 2),
               "tokens_per_s": _r(steps / seconds, 2) if seconds else None, "finished": final}
    return per_token, current


def _agent_row(engine, r: dict) -> dict:
    """What the view shows of one agent: its share, its link as probed, and what its UDP traffic lost."""
    link = (r.get("profile") or {}).get("link") or {}
    if not link.get("echoed"):  # no probe came back: not measured
        link = {}
    udp = r.get("udp") or {}
    return {"name": r["name"], "role": "agent", "endpoint": r["endpoint"],
            "alive": r["name"] not in engine.agent_errors, "error": engine.agent_errors.get(r["name"]),
            "heads": r["heads"], "mlp_groups": r["mlp_groups"], "vocab_groups": r["vocab_groups"],
            "link_plr": _r(link.get("plr"), 4), "rtt_ms": _r(link.get("rtt_ms_p50")),
            "observed_plr": _r(udp.get("observed_plr"), 4) if udp else None,
            "chunks_missing": udp.get("chunks_missing"),
            "chunks_recovered": (udp.get("chunks_recovered_parity", 0) + udp.get("chunks_recovered_nack", 0)
                                 if udp else None),
            "sync_ms_p50": _r(udp.get("sync_ms_p50")), "rejected": udp.get("rejected") or {}}


# ---- the terminal ------------------------------------------------------------------------------------------------
def _fmt(value, unit: str = "", digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}"


def _sync_cell(d: dict) -> str:
    if d.get("role") == "master":
        return "-"
    if d.get("sync_ms_per_token") is None and d.get("sync_ms_p50") is not None:
        return f"[dim]gather p50[/dim] {d['sync_ms_p50']:.2f}"
    return _fmt(d.get("sync_ms_per_token"), "", 3)


def render(snapshot: dict):
    """The snapshot as rich renderables (a devices table, loss by layer, a summary line)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = snapshot.get("totals", {})
    cur = snapshot.get("current") or {}
    state = snapshot.get("state", "?")
    colour = {"idle": "green", "generating": "cyan", "down": "red"}.get(state, "yellow")
    head = Text.assemble(
        (f"{snapshot.get('model', '?')} ", "bold"), f"· sync {snapshot.get('sync', '?')} · ", (state, colour),
        f" · slots {snapshot.get('queue', {}).get('slots_busy', 0)}/{snapshot.get('queue', {}).get('slots', 1)}"
        f" · queue {snapshot.get('queue', {}).get('waiting', 0)}/{snapshot.get('queue', {}).get('limit', 0)}"
        f" · {_fmt(cur.get('ms_per_token'), ' ms/token')} ({_fmt(cur.get('tokens_per_s'), ' tokens/s')})"
        f" · requests {sum(t.get('requests', {}).values())} · rebuilds {t.get('rebuilds', 0)}"
        f" · re-plans {(snapshot.get('replans') or {}).get('count', 0)}")
    table = Table(title="devices", expand=False)
    for column in ("device", "up", "share\nheads/MLP/vocab", "compute\nms/token", "sync\nms/token", "link\nloss, RTT",
                   "observed\nloss", "recovered /\nzero-filled"):
        table.add_column(column, justify="left" if column == "device" else "right", no_wrap=True)
    for d in snapshot.get("devices", []):
        up = "[green]yes[/green]" if d.get("alive") else "[red]no[/red]"
        share = _fmt(100 * d["share"] if d.get("share") is not None else None, " %", 1)
        link = "-" if d.get("link_plr") is None else f"{100 * d['link_plr']:.1f} %, {_fmt(d.get('rtt_ms'), ' ms', 2)}"
        table.add_row(f"{d['name']}\n[dim]{d.get('endpoint', '')}[/dim]", up,
                      f"{share}\n[dim]{_groups(d)}[/dim]",
                      _fmt(d.get("compute_ms_per_token"), "", 3),
                      _sync_cell(d), link,
                      _fmt(100 * d["observed_plr"] if d.get("observed_plr") is not None else None, " %", 2),
                      "-" if d.get("chunks_recovered") is None else f"{d['chunks_recovered']} / {d['chunks_missing']}")
    parts = [head, table]
    for d in snapshot.get("devices", []):
        if d.get("error"):
            parts.append(Text(f"{d['name']}: {d['error']}", style="red"))
    loss = snapshot.get("loss")
    if loss and snapshot.get("sync") not in ("tcp", "exact"):
        by_layer = loss.get("dropped_by_layer") or {}
        drops = Table(title="dropped by relaxed sync (groups x missing fraction)", expand=False)
        drops.add_column("layer")
        drops.add_column("attention heads", justify="right")
        drops.add_column("MLP groups", justify="right")
        for layer, kinds in by_layer.items():
            drops.add_row(layer, f"{kinds.get('attention', 0):.2f}", f"{kinds.get('mlp', 0):.2f}")
        parts.append(drops if by_layer else Text("nothing dropped so far", style="green"))
        parts.append(Text(f"partial sums dropped {loss['partials_dropped']}/{loss['partials']} · chunks zero-filled "
                          f"{loss['chunks_missing']}/{loss['chunks_expected']} · predicted rank of dropped groups: "
                          f"mean {_fmt(loss.get('dropped_rank_mean'), '', 1)}, best {_fmt(loss.get('dropped_rank_min'), '', 0)} "
                          f"(0 = most important)"))
    if t.get("last_error"):
        parts.append(Text(f"last error: {t['last_error']}", style="yellow"))
    return Group(*parts)
