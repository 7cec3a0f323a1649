"""One way to build "a model over these agents with this plan", for the CLI, lm-eval, tests and benchmarks."""

from __future__ import annotations

from halo.errors import ConfigError
from halo.config import DEFAULT_CONTEXT
from halo.neuron_groups import GroupLayout
from halo.shares import even_plan, shares_from_plan
from halo.sync import SyncSettings
from halo.weights import ModelWeights

from .local import LocalCluster
from .master import DistributedModel
from .session import DEFAULT_TIMEOUT_S, MasterSettings


def cluster_model(weights: ModelWeights, endpoints: list[str], key=None, *, plan=None, compute: list[float] | None = None,
                  insecure: bool = False, layout: GroupLayout | None = None, **settings) -> DistributedModel:
    """A master over running agents. plan: a TensorParallelPlan whose participants are the master and then
    the agents in `endpoints` order (default: an even plan over all of them; `compute` gives relative
    speeds for an uneven one). settings: MasterSettings fields (context, fmt, timeout_s, sync, ...)."""
    from halo.linear import resolve_format

    layout = layout or GroupLayout.for_model(weights.config)
    if "fmt" in settings:  # "native" on a float model means fp32: the cluster says so to every agent
        settings["fmt"] = resolve_format(settings["fmt"], weights)
    master_settings = MasterSettings(**settings)
    if master_settings.context <= 0:
        raise ConfigError(f"the context must be at least 1 token, got {master_settings.context}")
    if plan is None:
        context = min(weights.config.max_seq_len, master_settings.context)
        plan = even_plan(weights, layout, len(endpoints) + 1, compute, context=context)
    shares = shares_from_plan(plan, weights.config.n_layers)
    return DistributedModel(weights, shares, endpoints, key, insecure, layout, master_settings)


def connect(weights: ModelWeights, stack, *, model_path: str | None = None, local_agents: int = 0,
            agents: list[str] | None = None, cluster: str | None = None, plan: str | None = None,
            key: str | None = "/etc/halo/cluster.key", insecure: bool = False, context: int | None = None,
            timeout: float = DEFAULT_TIMEOUT_S, fmt: str = "fp32", sync: SyncSettings | None = None,
            predictors: str | None = None, mode: str = "tp", pipeline: dict | None = None):
    """A master over agents from one of: local_agents (started here, stopped when `stack` closes), agent
    addresses, a cluster file (planned here) or a saved plan. `stack` (an ExitStack) owns what it starts.
    mode "pipeline" (or a pipeline plan) builds a pipeline coordinator over stage workers instead
    (halo/pipeline/connect.py; `pipeline` holds its own options)."""
    from halo.transport.reliable import load_key

    if mode == "pipeline" or (plan and _plan_mode(plan) == "pipeline"):
        from halo.pipeline.connect import connect_pipeline

        return connect_pipeline(weights, stack, model_path=model_path, local_workers=local_agents, workers=agents,
                                cluster=cluster, plan=plan, key=key, insecure=insecure, context=context,
                                timeout=timeout, fmt=fmt, **(pipeline or {}))

    layout = GroupLayout.for_model(weights.config)
    context = min(weights.config.max_seq_len, DEFAULT_CONTEXT if context is None else context)
    cluster_key, endpoints = None, None
    if local_agents:
        if local_agents < 0 or agents or cluster:
            raise ConfigError("--local-agents N starts its own agents: do not combine it with --agents or --cluster")
        local = stack.enter_context(LocalCluster(local_agents, model_path, predictors=predictors))
        endpoints, cluster_key = local.endpoints, local.key
    elif agents:
        endpoints = [a if a.startswith("tcp://") else f"tcp://{a}" for a in agents]
    if cluster_key is None and not insecure:
        cluster_key = load_key(key)
    tp_plan = _load_plan(weights, layout, plan, cluster)
    if tp_plan is None and endpoints is None:
        raise ConfigError("no agents: give local_agents, agent addresses, a cluster file or a plan")
    if endpoints is None:
        endpoints = _plan_addresses(tp_plan)
    model = cluster_model(weights, endpoints, cluster_key, plan=tp_plan, insecure=insecure, layout=layout,
                          context=context, timeout_s=timeout, fmt=fmt, sync=sync or SyncSettings(),
                          predictors=predictors)
    stack.callback(model.close)
    return model


def _load_plan(weights: ModelWeights, layout: GroupLayout, plan: str | None, cluster: str | None):
    """A saved plan, a plan over a cluster file's devices, or None (an even plan over the given agents)."""
    if plan:
        from halo.scheduler import plan_io

        tp_plan = plan_io.load(plan)
        if isinstance(tp_plan, tuple):
            raise ConfigError(f"{plan} is a pipeline plan; generate needs a tensor-parallel (--mode tp) plan")
        return tp_plan
    if cluster:
        from halo.scheduler.profiles import load_cluster, model_profile
        from halo.scheduler.tp_plan import plan_tp

        cluster_file = load_cluster(cluster)
        profile = model_profile(weights.config, cluster_file.weights, mlp_group_size=layout.mlp_group_size,
                                vocab_group_size=layout.vocab_group_size)
        return plan_tp(cluster_file, profile)
    return None


def _plan_mode(path: str) -> str | None:
    """A plan file's mode, or None where it cannot be read (plan_io.load then says why)."""
    import json
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text()).get("mode")
    except (OSError, ValueError, AttributeError):
        return None


def _plan_addresses(tp_plan) -> list[str]:
    endpoints = []
    for d in tp_plan.profiles()[1:]:
        if not d.address:
            raise ConfigError(f"device {d.name!r} of the plan has no address; give --agents or set address =")
        endpoints.append(d.address if d.address.startswith("tcp://") else f"tcp://{d.address}")
    return endpoints
