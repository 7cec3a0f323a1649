"""Building a pipeline coordinator from the command line's choices.

Sources of workers (any mix): `local_workers` N halo-stage-worker processes started here (an even
split, so every one has work), `workers` addresses of running ones, a cluster file (devices with
addresses; the master device without one computes its stages itself), a saved pipeline plan, and
browser tabs that open the worker page (`browser_workers`). Without a plan, the coordinator probes
every worker (self-benchmark, memory, link) and plans with scheduler/pipeline.py's DP; `--plan`
overrides.
"""

from __future__ import annotations

from halo.arguments import check_insecure
from halo.errors import ConfigError

from halo.pipeline.coordinator import PipelineModel, measure_profiles
from halo.pipeline.links import LocalStage, NativeStage
from halo.pipeline.replan import Stage, even_stages

DEFAULT_TIMEOUT_S = 2.0


def local_stage_workers(n: int, model_path: str | None = None, startup_timeout_s: float = 60.0):
    """N halo-stage-worker processes on loopback (a LocalCluster of stage workers). BLAS threads: cores // N
    each; stages run one after another, so that leaves no core idle and oversubscribes none."""
    import os

    from halo.runtime.local import LocalCluster

    if n <= 0:
        raise ConfigError(f"the number of local stage workers must be positive, got {n}")
    return LocalCluster(n, model_path, startup_timeout_s, module="halo.edge_agent.stage_worker", name="stage",
                        threads=max(1, (os.cpu_count() or 1) // n), extra_args=("--device", "cpu"))


def _endpoint(address: str) -> str:
    return address if address.startswith("tcp://") else f"tcp://{address}"


def connect_pipeline(weights, stack, *, model_path: str | None = None, local_workers: int = 0,
                     workers: list[str] | None = None, cluster: str | None = None, plan: str | None = None,
                     browser_workers: int = 0, serve: str | None = None, key: str | None = "/etc/halo/cluster.key",
                     insecure: bool = False, context: int | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                     fmt: str = "fp32", head_top_k: int = 1, threads: int = 1,
                     browser_timeout_s: float = 600.0, survive=None, tls_cert: str | None = None,
                     tls_key: str | None = None, insecure_lan: bool = False,
                     authorized_agents: str | None = None, slots: int = 1) -> PipelineModel:
    """A coordinator over stage workers; `stack` (an ExitStack) owns whatever this starts. `survive`:
    halo/runtime/replanning.py's settings (None: a lost worker ends the generation, naming it). insecure (plaintext)
    talks to loopback workers only, unless insecure_lan; authorized_agents: the workers' own public keys (device keys)."""
    import zmq

    from halo.model.config import DEFAULT_CONTEXT
    from halo.model.loader import model_fingerprint
    from halo.scheduler.profiles import check_plan_budget
    from halo.transport.reliable import master_key

    if slots != 1:
        raise ConfigError("a pipeline carries one sequence at a time: --slots above 1 needs tensor-parallel mode")
    asked, context = context, min(weights.config.max_seq_len, context or DEFAULT_CONTEXT)
    sha = model_fingerprint(weights.source)
    zmq_context = zmq.Context()
    stack.callback(zmq_context.destroy, linger=0)
    links, stages, cluster_key = [], None, None
    devices_by_name = {}
    if local_workers:
        if workers or cluster or plan:
            raise ConfigError("--local-agents N starts its own stage workers: do not combine it with --agents, "
                              "--cluster or --plan")
        local = stack.enter_context(local_stage_workers(local_workers, model_path))
        cluster_key = local.key
        links = [NativeStage(zmq_context, e, cluster_key, False, timeout, sha) for e in local.endpoints]
        if not browser_workers:
            stages = even_stages(weights.config, local_workers)
    needs_key = not local_workers and (workers or cluster or plan)
    if needs_key and not insecure:
        cluster_key = master_key(key, authorized_agents)
    if workers:
        links += [NativeStage(zmq_context, _endpoint(a), cluster_key, insecure, timeout, sha) for a in workers]
    planned_names, browser_names = None, []
    if plan or cluster:
        cluster_file, planned_names = _load_cluster(weights, plan, cluster, fmt)
        # its budgets hold: a run without --context takes the file's, one that needs more memory is refused
        context = context if asked else min(context, cluster_file.context)
        check_plan_budget(cluster_file, weights, fmt, context)
        browser_names = _add_cluster_links(weights, links, devices_by_name, zmq_context, cluster_file, cluster_key,
                                           insecure, timeout, sha, threads, insecure_lan)
        browser_workers += len(browser_names)
    if browser_workers:
        from halo.pipeline.browser import BrowserHub

        hub = stack.enter_context(BrowserHub(weights, serve or "127.0.0.1:8765", context, tls_cert, tls_key,
                                             tabs=browser_workers))
        tabs = hub.wait_for_workers(browser_workers, browser_timeout_s)
        for tab, name in zip(tabs, browser_names):
            tab.device_name = name
        links += tabs
    if not links:
        raise ConfigError("no stage workers: give --local-agents N, --agents, --cluster, --plan or --browser-workers")
    for link in links:
        stack.callback(link.close)
    profiles = measure_profiles(links, fmt)
    if planned_names is not None:
        stages = _stages_from_plan(planned_names, links)
    for i, link in enumerate(links):  # a cluster file's memory budget caps what the worker reported
        device = devices_by_name.get(getattr(link, "device_name", None) or "")
        if device is not None:
            profiles[i].memory_bytes = min(profiles[i].memory_bytes, device.memory_bytes)
    model = PipelineModel(weights, links, stages, context, fmt, head_top_k, recover=survive is not None,
                          profiles=profiles, survive=survive)
    stack.callback(model.close)
    return model


def _load_cluster(weights, plan, cluster, fmt: str):
    """(the cluster file, the plan's stages by device name or None) of a pipeline plan or cluster file."""
    from halo.compute.shares import planning_format
    from halo.scheduler import plan_io
    from halo.scheduler.profiles import check_plan_fits, load_cluster

    if not plan:
        return load_cluster(cluster, planning_format(fmt, weights)), None  # (no [cluster] weights: this run's)
    loaded = plan_io.load(plan)
    if not isinstance(loaded, tuple):
        raise ConfigError(f"{plan} is a tensor-parallel plan; --mode pipeline needs one written by "
                          "`halo-master plan --mode pipeline --out`")
    pipeline_plan, cluster_file, made_for = loaded
    check_plan_fits(made_for, weights.config)  # layers and width: its stages' memory is that model's
    if pipeline_plan.n_units != weights.config.n_layers + 2:
        raise ConfigError(f"{plan} splits {pipeline_plan.n_units} units but this model has "
                          f"{weights.config.n_layers + 2} (embedding, {weights.config.n_layers} layers, head)")
    if not pipeline_plan.complete:
        raise ConfigError(f"{plan} is a partial plan (units 0..{pipeline_plan.covered - 1} of "
                          f"{pipeline_plan.n_units}): add workers to the cluster and plan again")
    return cluster_file, [(cluster_file.devices[w].name, a, b) for w, a, b in pipeline_plan.stages]


def _add_cluster_links(weights, links: list, devices_by_name: dict, zmq_context, cluster_file, cluster_key, insecure,
                       timeout, sha, threads, insecure_lan: bool = False) -> list[str]:
    """Links to a cluster file's devices (appended to `links`); returns the names of devices that are browser tabs.
    Plaintext (insecure) only to loopback addresses unless insecure_lan, checked before any link opens (as
    tensor-parallel mode checks a cluster file's)."""
    browser_names = []
    if insecure:
        check_insecure([_endpoint(d.address) for d in cluster_file.devices if d.address not in ("", "local", "browser")],
                       insecure_lan, "would talk plaintext to")
    for i, d in enumerate(cluster_file.devices):
        devices_by_name[d.name] = d
        if d.address in ("", "local") and i == cluster_file.master:
            links.append(LocalStage(weights, d.name, threads))
        elif d.address == "browser":
            browser_names.append(d.name)  # a tab that will open the worker page
            continue
        elif d.address:
            links.append(NativeStage(zmq_context, _endpoint(d.address), cluster_key, insecure, timeout, sha))
        else:
            raise ConfigError(f"device {d.name!r} has no address: set address = \"HOST:PORT\" (a halo-stage-worker), "
                              "\"browser\" (a tab on the worker page) or leave it empty on the master device")
        links[-1].device_name = d.name
    return browser_names


def _stages_from_plan(planned_names, links) -> list[Stage]:
    """The plan names cluster devices; every link made from the cluster file carries its device's name."""
    index = {getattr(link, "device_name", None): i for i, link in enumerate(links)}
    stages = []
    for name, a, b in planned_names:
        if name not in index:
            raise ConfigError(f"the plan's worker {name!r} did not answer")
        stages.append(Stage(index[name], a, b))
    return stages
