"""One way to build "a model over these agents with this plan", for the CLI, lm-eval, tests and benchmarks."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

from halo.arguments import check_insecure
from halo.compute.neuron_groups import GroupLayout
from halo.compute.shares import shares_from_plan
from halo.errors import ConfigError
from halo.model.config import DEFAULT_CONTEXT
from halo.model.weights import ModelWeights
from halo.scheduler.even import EVEN_PLANS, PAIRED_PLANS, PLAN_KEYWORDS, even_plan
from halo.scheduler.profiles import SPECIAL_ADDRESSES, check_plan_budget, check_plan_fits
from halo.sync import SyncSettings

from halo.distributed.master import DistributedModel
from halo.distributed.session import DEFAULT_TIMEOUT_S, MasterSettings, Session
from halo.distributed.survive import SurvivalSettings, SurvivingModel
from halo.runtime.local import LocalCluster

log = logging.getLogger("halo.master")


def cluster_model(weights: ModelWeights, endpoints: list[str], key=None, *, plan=None, compute: list[float] | None = None,
                  insecure: bool = False, layout: GroupLayout | None = None, heads: str = "index", select: bool = True,
                  fresh: bool = False, shares=None, reuse=None, same_machine: bool = False, agent_share: float = 0.5,
                  **settings) -> DistributedModel:
    """A master over running agents. plan:
    - "measured": profile the master and every agent (kernels, memory, link loss / RTT / bandwidth) and plan
      with the scheduler for the sync mode (cost.py); agents it leaves out are not used (select=False keeps
      everyone); fresh re-runs the devices' cached benchmarks; same_machine (local agents): the agents run on
      the master's hardware, so they take its kernel benchmark (one benchmark per agent on a busy machine only
      adds noise: one taken while the others ran once made a plan give an agent nothing);
    - None or "even": an even plan over all of them (`compute` gives relative speeds for an uneven one);
      "even-mlp": the same with every attention head on the master (one sync round a layer instead of two);
      "even-mlp-only": the LM head on the master too (no logits slices on the wire); "paired-mlp": as even-mlp-only
      with each layer's MLP halved between the master and one agent (agent_share: the agent's part), the agents
      taking the layers in turn (two processes a round: for agents that share the master's cores);
    - a TensorParallelPlan whose participants are the master and then the agents in `endpoints` order.
    heads: "index" (rank r = head r), "importance" (the predictors' profile puts the heads that matter most on
    the master and the most reliable links) or "auto" (importance in lossy sync, where static placement is
    what protects the important heads, when predictors exist: what `connect`, hence the CLI, uses).
    shares: the groups of each participant (plan order) where a plan object only counts them (a sticky re-plan,
    survive.py); reuse: the master's worker of the previous session. settings: MasterSettings fields (context,
    fmt, timeout_s, sync, ...). What was planned and why: `model.planning`."""
    from halo.compute.linear import resolve_format

    layout = layout or GroupLayout.for_model(weights.config)
    if "fmt" in settings:  # "native" on a float model means fp32: the cluster says so to every agent
        settings["fmt"] = resolve_format(settings["fmt"], weights)
    master_settings = MasterSettings(**settings)
    if master_settings.context <= 0:
        raise ConfigError(f"the context must be at least 1 token, got {master_settings.context}")
    context = min(weights.config.max_seq_len, master_settings.context)
    if isinstance(plan, str) and plan == "measured":
        plan, planning = measured_plan(weights, layout, master_settings, endpoints, key, insecure, select, fresh,
                                       same_machine=same_machine)
        endpoints = [d.address for d in plan.profiles()[1:]]
    elif plan is None or (isinstance(plan, str) and plan in EVEN_PLANS):
        on_master, pair = EVEN_PLANS[plan or "even"], plan in PAIRED_PLANS
        plan = even_plan(weights, layout, len(endpoints) + 1, compute, context=context * master_settings.slots,
                         on_master=on_master, paired=pair, agent_share=agent_share)
        planning = {"source": "even" if compute is None else "relative compute", "on_master": list(on_master),
                    "paired": pair, **({"agent_share": agent_share} if pair else {})}
    elif isinstance(plan, str):
        raise ConfigError(f"plan {plan!r}: give 'measured', {', '.join(repr(k) for k in EVEN_PLANS)} or a "
                          "TensorParallelPlan")
    else:
        check_plan_fits(plan.model, weights.config, layout)
        check_plan_budget(plan.cluster, weights, master_settings.fmt, context * master_settings.slots)
        planning = {"source": "given", "algorithm": plan.algorithm}
    if shares is None:
        order = head_order(weights, master_settings, layout, heads)
        planning["heads"] = "index" if order is None else "importance"
        shares = shares_from_plan(plan, weights.config.n_layers, order)
    model = DistributedModel(weights, shares, endpoints, key, insecure, layout, master_settings, reuse=reuse)
    model.plan, model.planning = plan, planning
    return model


def measured_plan(weights: ModelWeights, layout: GroupLayout, settings: MasterSettings, endpoints: list[str], key,
                  insecure: bool, select: bool = True, fresh: bool = False, take_over: bool = True,
                  same_machine: bool = False, algorithm: str = "minmax"):
    """(plan, planning report) from measured profiles; the plan's participants carry their endpoints."""
    cluster = measure_cluster(weights, layout, settings, endpoints, key, insecure, fresh, take_over, same_machine)
    return plan_measured(weights, layout, settings, cluster, select, algorithm)


def auto_plan(weights: ModelWeights, layout: GroupLayout, endpoints: list[str], key, select: bool, same_machine: bool,
              settings: dict):
    """--sync auto: (plan, SyncChoice, planning report) from one measurement of the agents: the mode picked from
    their links (scheduler/sync_choice.py; settings["sync"] is set to it), the plan made for it."""
    from halo.compute.linear import resolve_format
    from halo.scheduler.sync_choice import choose_sync

    master_settings = MasterSettings(**{k: settings[k] for k in ("context", "slots", "timeout_s", "sync", "predictors",
                                                                 "threads")},
                                     fmt=resolve_format(settings["fmt"], weights))
    cluster = measure_cluster(weights, layout, master_settings, endpoints, key, settings["insecure"],
                              same_machine=same_machine)
    chosen = choose_sync(cluster)
    log.info("--sync auto picked %s: %s", chosen.mode, chosen.reason)
    if settings["sync"].copies and settings["sync"].copies != chosen.copies:  # a --copies given (even 1) is kept,
        chosen = replace(chosen, copies=settings["sync"].copies,  # and the report says so (it said auto's pick)
                         reason=f"{chosen.reason}; --copies {settings['sync'].copies} as given (auto picked {chosen.copies})")
    settings["sync"] = replace(settings["sync"], mode=chosen.mode, copies=chosen.copies)  # the master's, every re-plan's
    master_settings = replace(master_settings, sync=settings["sync"])
    plan, planning = plan_measured(weights, layout, master_settings, cluster, select)
    return plan, chosen, planning


def plan_measured(weights: ModelWeights, layout: GroupLayout, settings: MasterSettings, cluster, select: bool = True,
                  algorithm: str = "minmax"):
    """(plan, planning report) over a measured cluster, for settings.sync's mode (minmax chooses the participants
    unless not select; another algorithm, `plan --algorithm`, plans over every device as the paper's do)."""
    from halo.compute.shares import planning_format
    from halo.scheduler.cost import estimate
    from halo.scheduler.plan_io import plan_summary
    from halo.scheduler.profiles import MEMORY_HEADROOM, model_profile
    from halo.scheduler.ratios import InsufficientMemory
    from halo.scheduler.tp_plan import plan_everyone, plan_tp

    profile = model_profile(weights.config, planning_format(settings.fmt, weights), mlp_group_size=layout.mlp_group_size,
                            vocab_group_size=layout.vocab_group_size, rows=settings.slots)  # a batch's passes
    mode = settings.sync.mode
    try:
        if algorithm == "exact":
            from halo.scheduler.milp import exact_plan

            plan = exact_plan(cluster, profile)
        else:
            plan = (plan_tp(cluster, profile, algorithm, mode=mode, sync=settings.sync)
                    if select or algorithm != "minmax" else plan_everyone(cluster, profile, mode, settings.sync))
    except InsufficientMemory as e:
        available = ", ".join(f"{d.name} {d.memory_bytes / 1e6:.1f} MB" for d in cluster.devices)
        raise InsufficientMemory(f"{e} (measured for the plan: {available}: the available memory less "
                                 f"{100 * (1 - MEMORY_HEADROOM):.0f} % headroom)") from None
    return plan, {"source": "measured", **plan_summary(plan, mode, estimate(plan, mode, sync=settings.sync))}


def measure_cluster(weights: ModelWeights, layout: GroupLayout, settings: MasterSettings, endpoints: list[str], key=None,
                    insecure: bool = False, fresh: bool = False, take_over: bool = True, same_machine: bool = False):
    """The scheduler's Cluster from measurements: the master (node 0, its own benchmark) and every agent
    (same_machine: agents on the master's hardware with its CPU limit and threads take its kernel benchmark; their
    memory and links stay their own)."""
    from halo.compute.shares import planning_format
    from halo.runtime.measure import measure_device
    from halo.scheduler.profiles import Cluster, measured_device

    own = measure_device(weights, layout, settings.fmt, settings.threads, "master", fresh)
    agents = Session.measure(weights, layout, settings, endpoints, key, insecure, take_over, fresh)

    def kernels(measured: dict) -> dict:
        alike = all(measured.get(k) == own.get(k) for k in ("cpu_limit", "threads", "format"))
        return {**measured, **{k: own[k] for k in ("compute_flops", "overhead_s", "message_s")}} \
            if same_machine and alike else measured

    devices = [measured_device(f"{a['name']}#{i}", kernels(a["measured"]), a["link"], a["endpoint"])
               for i, a in enumerate(agents, start=1)]
    fastest = max([d.bandwidth_bps for d in devices], default=0.0)
    master = measured_device("master", own, None, "", is_master=True)
    master = replace(master, bandwidth_bps=max(1e9, fastest))  # its own link is at least as fast as its best path
    context = min(weights.config.max_seq_len, settings.context) * settings.slots  # KV positions a device keeps
    return Cluster((master, *devices), context=context, weights=planning_format(settings.fmt, weights))


def head_order(weights: ModelWeights, settings: MasterSettings, layout: GroupLayout, heads: str = "auto"):
    """[L, H] heads by importance (halo/scheduler/importance.py), or None for index order."""
    if heads not in ("auto", "importance", "index"):
        raise ConfigError(f"heads={heads!r}: choose auto, importance or index")
    policy = settings.sync.policy
    if heads == "index" or (heads == "auto" and (policy.all_critical or policy.remap)):
        # exact modes drop nothing; halo modes already make every partial holding a predicted top head of the
        # token critical, so placing heads by mean importance only leaves agents droppable more often
        # (eval/results/cost_model.md, part 4): by importance where placement is the only protection (lossy)
        return None
    from halo.predictors.store import load_predictors
    from halo.scheduler.importance import cached_head_order

    try:
        predictors = load_predictors(weights, layout, settings.predictors)
    except ConfigError:
        if heads == "importance" or settings.predictors:  # (a --predictors DIR given and unusable was ignored)
            raise
        log.info("no predictors for %s: heads stay in index order", weights.source)
        return None
    return cached_head_order(weights, predictors)


def connect(weights: ModelWeights, stack, *, model_path: str | None = None, local_agents: int = 0,
            agents: list[str] | None = None, cluster: str | None = None, plan: str | None = None,
            key: str | None = "/etc/halo/cluster.key", insecure: bool = False, context: int | None = None,
            timeout: float = DEFAULT_TIMEOUT_S, fmt: str = "fp32", sync: SyncSettings | None = None,
            predictors: str | None = None, mode: str = "tp", pipeline: dict | None = None,
            survive: SurvivalSettings | None = SurvivalSettings(), insecure_lan: bool = False,
            authorized_agents: str | None = None, auto_sync: bool = False, slots: int = 1, threads: int = 1,
            busy_poll: str = "auto"):
    """A master over agents from one of: local_agents (started here, stopped when `stack` closes), agent
    addresses, a cluster file (planned here) or a saved plan. `stack` (an ExitStack) owns what it starts.
    plan: a plan file, or "measured" or a keyword of EVEN_PLANS. By default agents are measured and the scheduler plans
    for the sync mode; local agents are measured too but all take part (the user asked for N of them).
    mode "pipeline" (or a pipeline plan) builds a pipeline coordinator instead (halo/pipeline/connect.py; `pipeline`).
    survive: a tensor-parallel master re-plans over the agents left when one fails, and takes back agents
    that return (survive.py); None: an agent failure ends the generation with its error.
    insecure (plaintext) talks only to loopback agents unless insecure_lan (a trusted test bed) says otherwise.
    authorized_agents: a file of the agents' public keys and addresses (needed with a device key).
    auto_sync: measure the agents and pick exact or HALO sync from their links (scheduler/sync_choice.py; `sync` gives
    the other settings); what was picked and why: model.sync_auto. slots: KV caches per sequence (halo/compute/batch.py);
    threads: the master's compute threads for its own share; busy_poll: local agents' (--busy-poll)."""
    from halo.transport.reliable import master_key

    if insecure and agents:  # (the tensor-parallel path checks the addresses of a plan or cluster file too, below)
        check_insecure([a if a.startswith("tcp://") else f"tcp://{a}" for a in agents], insecure_lan,
                       "would talk plaintext to")
    if mode == "pipeline" or (plan and plan not in PLAN_KEYWORDS and plan_mode(plan) == "pipeline"):
        from halo.pipeline.connect import connect_pipeline

        return connect_pipeline(weights, stack, model_path=model_path, local_workers=local_agents, workers=agents,
                                cluster=cluster, plan=plan, key=key, insecure=insecure, context=context,
                                timeout=timeout, fmt=fmt, survive=survive, insecure_lan=insecure_lan,
                                authorized_agents=authorized_agents, slots=slots, **(pipeline or {}))

    layout = GroupLayout.for_model(weights.config)
    cluster_key, endpoints = None, None
    if local_agents:
        if local_agents < 0 or agents or cluster:
            raise ConfigError("--local-agents N starts its own agents: do not combine it with --agents or --cluster")
        local = start_local_agents(stack, local_agents, model_path, predictors, threads, busy_poll)
        endpoints, cluster_key = local.endpoints, local.key
    elif agents:
        endpoints = [a if a.startswith("tcp://") else f"tcp://{a}" for a in agents]
    if cluster_key is None and not insecure:
        cluster_key = master_key(key, authorized_agents)
    sync = sync or SyncSettings()
    plan_file = None if plan is None or plan in PLAN_KEYWORDS else plan
    tp_plan = _load_plan(weights, layout, plan_file, cluster, sync, slots, fmt) if plan_file or cluster else None
    context = run_context(weights, context, tp_plan, slots)
    if tp_plan is None and endpoints is None:
        raise ConfigError("no agents: give --local-agents N, --agents, --cluster or --plan FILE (lm-eval: local_agents=...)")
    if endpoints is None:
        endpoints = _plan_addresses(tp_plan)
    if insecure:
        check_plaintext(endpoints, insecure_lan)
    select = not (local_agents and plan in (None, "measured"))  # --local-agents N: the user asked for N agents
    settings = dict(insecure=insecure, layout=layout, heads="auto", context=context, timeout_s=timeout, fmt=fmt,
                    sync=sync, predictors=predictors, slots=slots, threads=threads)
    chosen = None
    if auto_sync:
        if tp_plan is not None or plan not in (None, "measured"):
            raise ConfigError("--sync auto picks the mode from the agents' measured links: use the measured plan (no "
                              "--plan, --cluster), or name the sync mode")
        tp_plan, chosen, planning = auto_plan(weights, layout, endpoints, cluster_key, select, bool(local_agents),
                                              settings)
        sync, endpoints = settings["sync"], _plan_addresses(tp_plan)
    model = cluster_model(weights, endpoints, cluster_key, plan=tp_plan or plan or "measured", select=select,
                          same_machine=bool(local_agents), **settings)
    if chosen is not None:
        model.planning = {**model.planning, **planning}  # measured, for the mode picked (model.sync_auto: which, why)
    if survive is not None:
        planner = Replanner(weights, layout, model.plan, model.planning.get("source") in ("even", "relative compute"),
                            select, sync, context * slots, tuple(model.planning.get("on_master", ())),
                            bool(model.planning.get("paired")))
        model = SurvivingModel(model, endpoints, planner,
                               lambda p, e, **how: cluster_model(weights, e, cluster_key, plan=p, **how, **settings),
                               cluster_key, insecure, survive)
    model.sync_auto = chosen.to_json() if chosen is not None else None  # kept across re-plans (the wrapper's own)
    stack.callback(model.close)
    return model


def check_plaintext(endpoints: list[str], insecure_lan: bool) -> None:
    """--insecure: only to loopback agents unless insecure_lan (a trusted test bed) says otherwise; said in the log."""
    check_insecure(endpoints, insecure_lan, "would talk plaintext to")
    log.warning("--insecure: plaintext to %s; anyone on the path can read and forge the cluster's traffic",
                ", ".join(endpoints))


def start_local_agents(stack, n: int, model_path, predictors, threads: int, busy_poll: str) -> LocalCluster:
    """--local-agents N, started with the master's --busy-poll (its help says agents take the same), owned by `stack`.
    A master with kernel threads beside agents that need more cores than there are is warned: its waiting threads
    spin on cores the agents need (measured: --threads 2 over 3 agents on 2 cores made a pass slower, not faster)."""
    local = stack.enter_context(LocalCluster(n, model_path, predictors=predictors,
                                             extra_args=("--busy-poll", busy_poll) if busy_poll != "auto" else ()))
    cores = os.cpu_count() or 1
    if threads > 1 and threads + n * local.threads > cores:
        log.warning("--threads %d beside local agents of %d thread(s) in all asks for more than this machine's %d "
                    "cores: on a shared machine --threads 1 is faster", threads, n * local.threads, cores)
    return local


def run_context(weights: ModelWeights, asked: int | None, tp_plan, slots: int) -> int:
    """The KV-cache length of a run: as asked, else the default, or the one a given plan budgets if shorter; at most
    the model's."""
    budgeted = tp_plan.cluster.context // slots if tp_plan is not None and asked is None else weights.config.max_seq_len
    return min(weights.config.max_seq_len, DEFAULT_CONTEXT if asked is None else asked, budgeted)


@dataclass
class Replanner:
    """How a running cluster is planned again (survive.py): over other agents (one lost, one back), or over the
    same agents from what they were observed to deliver (a straggler). An even plan stays even when agents
    come and go; a measured or declared one is planned again by the scheduler from the profiles it was made
    from (a device without one, i.e. never measured, is not used)."""

    weights: ModelWeights
    layout: GroupLayout
    first: object  # the first plan (TensorParallelPlan)
    even: bool
    select: bool  # the scheduler may leave agents out
    sync: SyncSettings
    context: int  # KV positions a device keeps: the context times the KV-cache slots
    on_master: tuple = ()  # an even plan's blocks kept on the master (EVEN_PLANS), kept when agents come and go
    paired: bool = False  # an even plan's MLP halved between the master and one agent a layer (PAIRED_PLANS), kept too

    def survivors(self, endpoints: list[str]):
        """(plan, its agents' endpoints in plan order) over the master and `endpoints`."""
        from halo.scheduler.tp_plan import plan_everyone, plan_tp

        if self.even:
            return even_plan(self.weights, self.layout, len(endpoints) + 1, context=self.context,
                             on_master=self.on_master, paired=self.paired), list(endpoints)
        cluster = self.first.cluster
        master = cluster.devices[cluster.master]
        known = {_address(d): d for d in cluster.devices if d is not master and d.address}
        survivors = replace(cluster, devices=(master, *(known[e] for e in endpoints if e in known)))
        plan = (plan_tp(survivors, self.first.model, mode=self.sync.mode, sync=self.sync) if self.select
                else plan_everyone(survivors, self.first.model, self.sync.mode, self.sync))
        return plan, _plan_addresses(plan)

    def adopt(self, plan) -> None:
        """A plan from `observed` is in use: later losses and joins plan from its (observed) profiles (the scheduler's,
        neither even nor paired)."""
        self.first, self.even, self.paired = plan, False, False

    def observed(self, model: DistributedModel, addresses: dict[int, str] | None = None):
        """(plan, endpoints, predicted s/token of the current plan, of the new one) from the running estimates
        (estimates.py: each device's median compute, link loss, message cost calibrated to the observed pace);
        where the scheduler may leave agents out (not with --local-agents N, where all take part) a
        persistently slow one may go, else it keeps fewer groups. addresses: the devices' endpoints by index in
        the plan's cluster, the absent ones' too (the survival layer's last full plan)."""
        from halo.scheduler.cost import estimate
        from halo.scheduler.plan import TensorParallelPlan
        from halo.scheduler.tp_plan import plan_everyone, plan_tp

        plan = model.plan
        observed = model.estimates.updated_cluster(plan, self.sync.mode, self.sync)
        address = {i: d.address for i, d in enumerate(observed.devices) if d.address} | (addresses or {})
        address |= {index: model.agents[j].endpoint for j, index in enumerate(plan.devices) if j}
        # every device carries its address, so that a later loss or join re-plans from these profiles (adopt)
        everyone = replace(observed, devices=tuple(replace(d, address=address.get(i, d.address))
                                                   for i, d in enumerate(observed.devices)))
        # planned over the participants only (an agent out of the plan, lost or waiting to rejoin, comes back through
        # a join; planning over it crashed the generation with a KeyError), returned over every device (so it can)
        present = replace(everyone, devices=tuple(everyone.devices[i] for i in plan.devices))
        current = TensorParallelPlan(present, plan.model, plan.algorithm, list(range(len(plan.devices))), plan.counts)
        new = (plan_tp(present, plan.model, mode=self.sync.mode, sync=self.sync) if self.select
               else plan_everyone(present, plan.model, self.sync.mode, self.sync))
        endpoints = [present.devices[i].address for i in new.devices[1:]]
        adopted = TensorParallelPlan(everyone, plan.model, new.algorithm, [plan.devices[i] for i in new.devices],
                                     new.counts)
        return adopted, endpoints, estimate(current, self.sync.mode, sync=self.sync).total_s, \
            estimate(new, self.sync.mode, sync=self.sync).total_s


def _load_plan(weights: ModelWeights, layout: GroupLayout, plan: str | None, cluster: str | None, sync: SyncSettings,
               slots: int = 1, fmt: str = "native"):
    """A saved plan, a plan over a cluster file's devices (for the sync mode, its links' loss included, and the
    batch's slots), or None (measure the given agents)."""
    if plan:
        from halo.scheduler import plan_io

        tp_plan = plan_io.load(plan)
        if isinstance(tp_plan, tuple):
            raise ConfigError(f"{plan} is a pipeline plan; generate needs a tensor-parallel (--mode tp) plan")
        if tp_plan.oom:  # (--algorithm vanilla, the paper's baseline, ignores memory: a table, not a plan to run)
            raise ConfigError(f"{plan} gives {', '.join(tp_plan.oom)} more than its memory budget (planned with "
                              f"{tp_plan.algorithm or 'an algorithm'} that ignores memory): plan again with "
                              "--algorithm minmax")
        return tp_plan
    if cluster:
        from halo.compute.shares import planning_format
        from halo.scheduler.profiles import load_cluster, model_profile
        from halo.scheduler.tp_plan import plan_tp

        cluster_file = load_cluster(cluster, planning_format(fmt, weights))  # (no [cluster] weights: this run's)
        profile = model_profile(weights.config, cluster_file.weights, mlp_group_size=layout.mlp_group_size,
                                vocab_group_size=layout.vocab_group_size, rows=slots)  # a batch's passes, KV per slot
        return plan_tp(replace(cluster_file, context=cluster_file.context * slots), profile, mode=sync.mode, sync=sync)
    return None


def plan_mode(path: str) -> str | None:
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
        if not d.address or d.address in SPECIAL_ADDRESSES:
            has = f"address {d.address!r} (pipeline mode only)" if d.address else "no address"
            raise ConfigError(f"device {d.name!r} of the plan has {has}; give --agents or set address = \"HOST:PORT\"")
        endpoints.append(_address(d))
    return endpoints


def _address(device) -> str:
    return device.address if device.address.startswith("tcp://") else f"tcp://{device.address}"
