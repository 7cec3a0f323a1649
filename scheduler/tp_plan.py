"""Tensor-parallel plans: integer neuron-group counts per device, layer and block, and priority ranks.

From ratios (ratios.py) to a plan:
1. Integer counts. Device i should take r_i * N groups of each layer. Per layer, the cumulative
   targets are rounded with a phase that shifts from layer to layer, so every layer sums exactly to
   N and every device's total over the layers is within one group of r_i * N * L.
2. Memory repair. A device whose groups, KV cache, predictors (and, on the master, embeddings)
   exceed its budget hands groups, one at a time, to the device with room that would finish that
   layer's block soonest. When nobody has room, planning fails naming the shortfall.
3. Priority ranks (Algorithm 3). Within every layer and block, devices sorted by packet loss rate
   take consecutive ranks: the most reliable link gets ranks 0, 1, ... (the most important groups),
   the least reliable the last ranks.

Device selection (`plan_tp` default): every participant adds synchronizations, so the default
planner also chooses who takes part, minimizing Eq. 1 over candidate subsets (see `select_devices`).
Given a sync mode it also weighs `on_master` (every attention head on the master: one sync round a layer
instead of two; the LM head there: no logits slices on the wire) with the cost model, as `plan_everyone` does
when nobody may be left out.
"""

from __future__ import annotations

import numpy as np

from halo.errors import ConfigError

from halo.scheduler.objective import compute_seconds, eq1_objective, transfer_seconds
from halo.scheduler.plan import TP_KINDS, TensorParallelPlan, fixed_bytes
from halo.scheduler.profiles import Cluster, ModelProfile
from halo.scheduler.ratios import ALGORITHMS, InsufficientMemory, check_capacity, exact_threshold

def round_counts(ratios: np.ndarray, n_groups: int, n_layers: int) -> np.ndarray:
    """[n, L] integer counts: each layer sums to n_groups; device totals within one group of r*N*L."""
    cumulative = np.cumsum(ratios) * n_groups
    cumulative[-1] = n_groups
    phases = (np.arange(n_layers) + 0.5) / n_layers
    edges = np.floor(cumulative[:, None] + phases[None, :] + 1e-9)  # [n, L]
    edges = np.vstack([np.zeros((1, n_layers)), edges])
    return np.diff(edges, axis=0).astype(np.int64)


def _layer_patterns(counts: np.ndarray) -> dict[tuple, list[int]]:
    """Layers grouped by identical per-device counts: work scales with distinct patterns, not layers."""
    patterns: dict[tuple, list[int]] = {}
    for layer, column in enumerate(counts.T.tolist()):
        patterns.setdefault(tuple(column), []).append(layer)
    return patterns


def _block_counts(plan: TensorParallelPlan, kind: str) -> np.ndarray:
    counts = plan.counts[kind]
    return counts[:, None] if counts.ndim == 1 else counts  # a view: edits land in plan.counts


def repair_memory(plan: TensorParallelPlan) -> None:
    """Relieve devices over budget (in place): repeatedly move the groups whose move lengthens the
    token least per byte freed (block finishing time after - before, over group bytes) to the device
    with room that finishes them soonest. Raises, naming the shortfall, when nobody has room."""
    budgets = np.array([d.memory_bytes for d in plan.profiles()])
    compute = np.array([d.compute_flops for d in plan.profiles()])
    m, ctx = plan.model, plan.cluster.context
    used = plan.memory_used()
    while True:
        over = used - budgets
        i = int(np.argmax(over))
        if over[i] <= 1e-6:
            return
        best = None
        for kind in TP_KINDS + ("lm_head",):
            block = getattr(m, kind)
            size = m.group_bytes(block, ctx)
            room = budgets - used >= size
            room[i] = False
            if not room.any():
                continue
            for key, layers in _layer_patterns(_block_counts(plan, kind)).items():
                pattern = np.array(key, dtype=float)
                if pattern[i] == 0:
                    continue
                times = block.flops * pattern / compute
                receive = np.where(room, block.flops * (pattern + 1) / compute, np.inf)
                j = int(np.argmin(receive))
                after = times.copy()
                after[i] -= block.flops / compute[i]
                after[j] = receive[j]
                score = (after.max() - times.max()) / size
                if best is None or score < best[0]:
                    best = (score, kind, size, layers, j)
        if best is None:
            raise InsufficientMemory(
                f"device {plan.profiles()[i].name!r} needs {over[i] / 1e6:.1f} MB more than its budget and no other "
                f"participant has room for one more neuron group: add memory or devices, or shorten the context")
        _, kind, size, layers, j = best
        k = min(len(layers), int(np.ceil(over[i] / size)), int((budgets[j] - used[j]) // size))
        counts = _block_counts(plan, kind)
        counts[i, layers[:k]] -= 1
        counts[j, layers[:k]] += 1
        used[i] -= k * size
        used[j] += k * size


def greedy_counts(compute: np.ndarray, n_groups: int, n_layers: int) -> np.ndarray:
    """[n, L] counts that minimize every layer's finishing time, memory ignored: each group goes to the
    device that would finish it soonest (the same split in every layer)."""
    assigned = np.floor(n_groups * compute / compute.sum()).astype(np.int64)  # never above the optimum
    for _ in range(n_groups - int(assigned.sum())):  # at most n more, each where it finishes soonest
        assigned[int(np.argmin((assigned + 1) / compute))] += 1
    return np.repeat(assigned[:, None], n_layers, axis=1)


def build_plan(cluster: Cluster, model: ModelProfile, algorithm: str = "minmax",
               devices: list[int] | None = None, prune: bool = True) -> TensorParallelPlan:
    """Ratios from `algorithm` over `devices` (default: all), rounded, repaired, as a plan."""
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    devices = list(range(len(cluster.devices))) if devices is None else list(devices)
    if cluster.master not in devices:
        raise ConfigError("the master must take part in every plan")
    devices.sort(key=lambda i: (i != cluster.master, i))
    profiles = [cluster.devices[i] for i in devices]
    fixed = fixed_bytes(cluster, model, devices)
    if fixed[0] > profiles[0].memory_bytes:
        raise InsufficientMemory(f"the master {profiles[0].name!r} has {profiles[0].memory_bytes / 1e6:.0f} MB but must hold "
                                 f"the embeddings and predictors ({fixed[0] / 1e6:.0f} MB): make a device with more "
                                 "memory the master (master = true in the cluster file)")
    usable = np.array([d.memory_bytes for d in profiles]) - fixed
    unfit = [i for i, room in zip(devices[1:], usable[1:]) if room <= 0]
    if prune and unfit:  # a device without room for its predictors takes no part (it was charged for them holding
        # nothing, the repair had nothing to move, and every plan of the cluster failed)
        return build_plan(cluster, model, algorithm, [i for i in devices if i not in unfit], prune)
    compute = whole_model_speed(profiles, model)
    ctx = cluster.context
    demand = model.total_bytes(ctx) - model.embedding_bytes
    if algorithm != "vanilla":
        check_capacity(np.maximum(usable, 0), demand)
    ratios = ALGORITHMS[algorithm](np.maximum(usable, 0), compute, demand)
    counts = {kind: round_counts(ratios, getattr(model, kind).count, model.n_layers) for kind in TP_KINDS}
    counts["lm_head"] = round_counts(ratios, model.lm_head.count, 1)[:, 0]
    plan = TensorParallelPlan(cluster, model, algorithm, devices, counts)
    if algorithm == "vanilla":  # the baseline ignores memory: report, do not fix
        over = plan.memory_used() > np.array([d.memory_bytes for d in profiles])
        plan.oom = [p.name for p, o in zip(profiles, over) if o]
    else:
        repair_memory(plan)
        if algorithm == "minmax":
            polish(plan)  # Min-Max's own objective, finished in integers: rounding alone can lose to Galaxy's
    return prune_idle(plan) if prune else plan


MASTER_KINDS = ("attention", "lm_head")  # blocks a plan may keep whole on the master (`on_master`)
MASTER_PLACEMENTS = (("attention",), ("lm_head",), MASTER_KINDS)  # what plan_tp and plan_everyone weigh


def on_master(plan: TensorParallelPlan, kinds=("attention",)) -> TensorParallelPlan:
    """The plan with every group of the block kinds `kinds` ("attention", "lm_head") on the master, the other shares
    as they were. A block whose groups all sit on the master needs no sync round (the runtime sends nothing:
    halo/distributed/master.py). Attention: a token takes L + 1 rounds instead of 2L + 1, for the heads' compute on
    the master. The LM head: one round fewer, and no logits slices on the wire (SmolLM2's: 12k values an agent, 35
    datagrams each) for the whole head's compute on the master. The cost model (cost.py) prices both, and `plan_tp`
    keeps whichever is faster: with per-round costs of a millisecond (Wi-Fi latency, or this machine's four
    processes on two cores) the fewer rounds win. Raises InsufficientMemory when the master cannot hold them and
    its KV cache besides its share."""
    check_master_kinds(kinds)
    counts = {kind: c.copy() for kind, c in plan.counts.items()}
    for kind in kinds:
        total = counts[kind].sum(axis=0)
        counts[kind][:] = 0
        counts[kind][0] = total  # participants are listed master first
    moved = TensorParallelPlan(plan.cluster, plan.model, plan.algorithm, list(plan.devices), counts)
    master = moved.profiles()[0]
    used = moved.memory_used()[0]
    if used > master.memory_bytes:
        what = " and ".join({"attention": "every attention head", "lm_head": "the whole LM head"}[k] for k in kinds)
        raise InsufficientMemory(f"the master {master.name!r} would need {used / 1e6:.0f} MB to hold {what} "
                                 f"besides its share, and has {master.memory_bytes / 1e6:.0f} MB")
    return moved


def check_master_kinds(kinds) -> None:
    """ConfigError unless every kind is one a plan can keep whole on the master (MASTER_KINDS)."""
    for kind in kinds:
        if kind not in MASTER_KINDS:
            raise ConfigError(f"{kind!r}: only the attention heads and the LM head ({', '.join(MASTER_KINDS)}) can "
                              "stay whole on the master")


def paired(plan: TensorParallelPlan, kind: str = "mlp", agent_share: float = 0.5) -> TensorParallelPlan:
    """The plan with each layer's `kind` groups split between the master and one agent (`agent_share` of them,
    rounded down; the master the rest), the agents taking the layers in turn (agent 1 layer 0, agent 2 layer 1, ...);
    the other blocks as they were. Every round of that kind then engages two processes (a layer whose agent part
    rounds to nothing stays whole on the master: no round), and each agent holds its layers' part. Why: on a
    machine whose
    agents share the master's cores (the namespace test bed, --local-agents on two cores), a round that engages every
    agent time-slices them all on the same cores for no more parallelism than two, and pays each one's round
    overhead (its wake-up, Python, datagrams) in every round (eval/results/halo_speed_tinyllama_q4.md). On
    devices with cores of their own, the even split engages them all at once and is the better plan."""
    if kind not in TP_KINDS:
        raise ConfigError(f"{kind!r}: only the per-layer blocks ({', '.join(TP_KINDS)}) can be paired")
    if not 0 < agent_share <= 0.5:
        raise ConfigError(f"a paired plan's agent share must be in (0, 0.5] (the master takes the rest), not {agent_share}")
    if plan.n < 2:
        return plan
    counts = {k: c.copy() for k, c in plan.counts.items()}
    total = counts[kind].sum(axis=0)
    counts[kind][:] = 0
    layers = np.arange(total.size)
    agent = np.floor(total * agent_share + 1e-9).astype(np.int64)
    counts[kind][0] = total - agent
    counts[kind][1 + layers % (plan.n - 1), layers] = agent
    pairs = TensorParallelPlan(plan.cluster, plan.model, plan.algorithm, list(plan.devices), counts)
    for device, used in zip(pairs.profiles(), pairs.memory_used()):
        if used > device.memory_bytes:
            raise InsufficientMemory(f"{device.name!r} would need {used / 1e6:.0f} MB for its part of the {kind} "
                                     f"of a paired plan and has {device.memory_bytes / 1e6:.0f} MB: use an even plan")
    return pairs


def whole_model_speed(profiles, model: ModelProfile) -> np.ndarray:
    """The FLOP/s each device would deliver computing the whole model, its per-block overheads included: the
    speed the ratio algorithms balance by (without overheads it is compute_flops; for a tiny model whose
    blocks are all overhead, devices come out about equal, as they are)."""
    blocks = (model.attention, model.mlp, model.lm_head)
    repeats = (model.n_layers, model.n_layers, 1)
    work = sum(b.flops * b.count * r for b, r in zip(blocks, repeats))
    return np.array([work / (work / d.compute_flops + sum(o * r for o, r in zip(d.overhead_s, repeats)))
                     for d in profiles])


def prune_idle(plan: TensorParallelPlan) -> TensorParallelPlan:
    """Drop participants left with no groups (Computation-Greedy's unused devices); the master stays."""
    busy = [j for j, i in enumerate(plan.devices)
            if i == plan.cluster.master or any(plan.counts[k][j].sum() > 0 for k in plan.counts)]
    if len(busy) == plan.n:
        return plan
    plan.devices = [plan.devices[j] for j in busy]
    plan.counts = {k: v[busy] for k, v in plan.counts.items()}
    return plan


def polish(plan: TensorParallelPlan) -> None:
    """Integer local search (in place): in every layer and block, move one group at a time from the
    device that finishes last to the device that would finish earliest with it, while that lowers
    the block's finishing time and the receiver has memory. Rounding fixed ratios can miss the best
    integer split when groups are coarse; this recovers it per block."""
    budgets = np.array([d.memory_bytes for d in plan.profiles()])
    compute = np.array([d.compute_flops for d in plan.profiles()])
    m, ctx = plan.model, plan.cluster.context
    used = plan.memory_used()
    for kind in TP_KINDS + ("lm_head",):
        block = getattr(m, kind)
        size = m.group_bytes(block, ctx)
        counts = _block_counts(plan, kind)
        while True:
            moved = False
            for key, same in _layer_patterns(counts).items():
                pattern = np.array(key)
                finish = block.flops * pattern / compute
                i = int(np.argmax(finish))
                room = np.floor((budgets - used) / size)
                after = np.where(room >= 1, block.flops * (pattern + 1) / compute, np.inf)
                after[i] = np.inf
                j = int(np.argmin(after))
                if not after[j] < finish[i]:
                    continue
                layers = same[: int(room[j])]
                counts[i, layers] -= 1
                counts[j, layers] += 1
                used[i] -= size * len(layers)
                used[j] += size * len(layers)
                moved = True
            if not moved:
                break


BALANCE_EVALUATIONS = 200  # cost-model evaluations balance() may spend on one plan


def balance(plan: TensorParallelPlan, objective, budget: int = BALANCE_EVALUATIONS) -> TensorParallelPlan:
    """Shift split blocks' groups between the master and each agent, one group of every layer at a time, while the
    objective (the cost model's expected time per token) falls: the ratio algorithms balance compute alone, but an
    agent's partial also waits for its input's arrival, its own send and the link (message_s, latency), which the
    master's share does not, so the master's share of a round should be larger by about that much. The cost model
    prices it: with two pinned nodes on loopback, 3 of TinyLlama's 22 MLP groups a layer move to the master. A block
    kept whole on the master stays there; memory budgets hold. Returns the best plan found (the input if none).
    For devices with cores of their own: the cost model does not price agents that share the master's cores."""
    best, best_cost = plan, objective(plan)
    budgets = np.array([d.memory_bytes for d in plan.profiles()])
    spent, improved = 1, True
    while improved and spent < budget:
        improved = False
        for kind in (*TP_KINDS, "lm_head"):
            if best.whole_on_master(kind):
                continue
            for agent in range(1, best.n):
                for giver, taker in ((agent, 0), (0, agent)):
                    trial = TensorParallelPlan(best.cluster, best.model, best.algorithm, list(best.devices),
                                               {k: c.copy() for k, c in best.counts.items()})
                    moved = _block_counts(trial, kind)
                    if not moved[giver].all():  # every layer must have a group to give
                        continue
                    moved[giver] -= 1
                    moved[taker] += 1
                    if (trial.memory_used() > budgets).any() or spent >= budget:
                        continue
                    cost, spent = objective(trial), spent + 1
                    if cost < best_cost * (1 - 1e-9):
                        best, best_cost, improved = trial, cost, True
    return best


def _block_times(plan: TensorParallelPlan, kind: str, compute: np.ndarray) -> np.ndarray:
    return getattr(plan.model, kind).flops * _block_counts(plan, kind) / compute[:, None]  # [n, L]


def trade_memory(plan: TensorParallelPlan, max_rounds: int = 200) -> None:
    """Exchange local search for memory-bound devices (in place).

    A device whose memory is full may still shorten the token by holding *other* groups: give up
    groups where that costs the least time per byte (another device with room takes them) to take a
    group where it saves the most time per byte (from the block's slowest device). Each exchange is
    kept only when Eq. 1's computation time drops."""
    budgets = np.array([d.memory_bytes for d in plan.profiles()])
    compute = np.array([d.compute_flops for d in plan.profiles()])
    m, ctx = plan.model, plan.cluster.context
    kinds = TP_KINDS + ("lm_head",)
    sizes = {k: m.group_bytes(getattr(m, k), ctx) for k in kinds}
    current = compute_seconds(plan)
    for _ in range(max_rounds):
        used = plan.memory_used()
        improved = False
        for i in np.argsort(budgets - used):  # the fullest devices first
            free = budgets[i] - used[i]
            if free >= max(sizes.values()):
                break
            gains, costs = [], []
            for kind in kinds:
                flops, size = getattr(m, kind).flops, sizes[kind]
                counts = _block_counts(plan, kind)
                times = _block_times(plan, kind, compute)
                top = times.max(axis=0)
                slowest = times.argmax(axis=0)
                # take one group from the slowest device of each layer
                add = times.copy()
                cols = np.arange(times.shape[1])
                add[slowest, cols] -= flops / compute[slowest]
                add[i] += flops / compute[i]
                gain = np.where(slowest != i, top - add.max(axis=0), 0.0)
                for layer in np.flatnonzero(gain > 0):
                    gains.append((gain[layer] / size, kind, int(layer), int(slowest[layer])))
                # give one group away, to the device with room that finishes it soonest
                room = budgets - used >= size
                room[i] = False
                if counts[i].max() == 0 or not room.any():
                    continue
                receive = np.where(room[:, None], flops * (counts + 1) / compute[:, None], np.inf)
                j = receive.argmin(axis=0)
                drop = times.copy()
                drop[i] -= flops / compute[i]
                drop[j, cols] = receive[j, cols]
                cost = drop.max(axis=0) - top
                for layer in np.flatnonzero(counts[i] > 0):
                    costs.append((cost[layer] / size, kind, int(layer), int(j[layer])))
            if not gains or not costs:
                continue
            _, kind_in, layer_in, giver = max(gains)
            need = sizes[kind_in] - free
            moves, freed = [], 0.0
            for _, kind_out, layer_out, taker in sorted(costs):
                if (kind_out, layer_out) == (kind_in, layer_in) or freed >= need:
                    continue
                moves.append((kind_out, layer_out, taker))
                freed += sizes[kind_out]
            if freed < need:
                continue
            snapshot = {k: v.copy() for k, v in plan.counts.items()}
            for kind_out, layer_out, taker in moves:
                counts = _block_counts(plan, kind_out)
                counts[i, layer_out] -= 1
                counts[taker, layer_out] += 1
            counts = _block_counts(plan, kind_in)
            counts[giver, layer_in] -= 1
            counts[i, layer_in] += 1
            after = compute_seconds(plan)
            if after < current - 1e-12 and (plan.memory_used() <= budgets + 1e-6).all():
                current, improved = after, True
                break
            plan.counts = snapshot
        if not improved:
            return


def _fractional_objective(usable: list[float], compute: list[float], demand: float, work: float,
                          sync_s: float) -> float:
    """Eq. 1 for Min-Max ratios before rounding, for one participant set (plain floats: it scores many sets).

    The Min-Max threshold T solves sum(min(u_i, T c_i)) = demand exactly (piecewise linear in T); the
    slowest participant then needs work * max(share_i / c_i) / sum(share)."""
    if sum(usable) < demand:
        return float("inf")
    t = exact_threshold(usable, compute, demand)
    slowest = max(min(u, t * c) / c for u, c in zip(usable, compute))
    return work * slowest / demand + (len(usable) - 1) * sync_s


def candidate_subsets(cluster: Cluster, model: ModelProfile, keep: int = 2) -> list[list[int]]:
    """Participant sets worth rounding: the best `keep` found by growing the set fastest-first,
    by greedy addition and by greedy removal, scored with the fractional Eq. 1."""
    master = cluster.master
    sync_s = (2 * model.n_layers + 1) * transfer_seconds(cluster, model)
    n = len(cluster.devices)
    fixed = fixed_bytes(cluster, model, list(range(n)))
    usable = [max(d.memory_bytes - f, 0.0) for d, f in zip(cluster.devices, fixed)]
    compute = [d.compute_flops for d in cluster.devices]
    demand = model.total_bytes(cluster.context) - model.embedding_bytes
    work = model.n_layers * sum(b.flops * b.count for b in model.tp_blocks) + model.lm_head.flops * model.lm_head.count
    scores: dict[tuple[int, ...], float] = {}

    def score(subset) -> float:
        key = tuple(sorted(subset))
        if key not in scores:
            scores[key] = _fractional_objective([usable[i] for i in key], [compute[i] for i in key], demand, work, sync_s)
        return scores[key]

    everyone = list(range(n))
    others = sorted((i for i in everyone if i != master), key=lambda i: -compute[i])
    for k in range(len(others) + 1):  # fastest-first prefixes
        score([master] + others[:k])
    current = [master]  # greedy addition
    while len(current) < n:
        best = min(([*current, i] for i in everyone if i not in current), key=score)
        if score(best) >= score(current) and score(current) < float("inf"):
            break
        current = best
    current = everyone  # greedy removal
    while len(current) > 1:
        best = min(([i for i in current if i != drop] for drop in current if drop != master), key=score)
        if score(best) >= score(current):
            break
        current = best
    ranked = sorted((item for item in scores.items() if item[1] < float("inf")), key=lambda item: item[1])
    return [list(subset) for subset, _ in ranked[:keep]]


def plan_tp(cluster: Cluster, model: ModelProfile, algorithm: str = "minmax", select: bool = True,
            mode: str | None = None, sync=None) -> TensorParallelPlan:
    """The default planner: Min-Max over the participant set that minimizes the objective.

    The objective is Eq. 1 (mode None: the paper's, loss ignored) or, given a sync mode, the cost
    model's expected time per token in that mode with every link's packet loss (cost.py): a lossy
    device is then left out where its recoveries cost more than its compute saves. With select=False
    (or any algorithm but minmax) every device takes part, as in the paper's algorithms."""
    if not select or algorithm != "minmax":
        return build_plan(cluster, model, algorithm)
    objective = eq1_objective if mode is None else _expected_time(mode, sync)
    subsets = (candidate_subsets(cluster, model) if mode is None else _subsets_by_estimate(cluster, model, objective))
    plans = []
    for subset in subsets or [list(range(len(cluster.devices)))]:
        for start in (build_plan, _greedy_start, _lp_start):
            try:
                plans.append(start(cluster, model, "minmax", subset))
            except InsufficientMemory:
                continue  # no room after rounding on this subset; another start or set may fit
    if not plans:
        return build_plan(cluster, model, "minmax")  # raises the informative shortfall
    for plan in plans:
        polish(plan)
    finalists = sorted(plans, key=objective)[:2]
    for plan in finalists:
        trade_memory(plan)
        polish(plan)
    if mode is not None:  # selection must never lose to every device taking part
        finalists.append(build_plan(cluster, model, "minmax"))
        finalists += _with_blocks_on_master(finalists)  # fewer sync rounds, priced by the cost model
        finalists += _paired_variants(finalists)  # fewer processes a round, priced the same way
        finalists = [balance(plan, objective) for plan in finalists]  # rounds' fixed costs, priced the same way
    best = min(finalists, key=objective)
    best.algorithm = "minmax+select" if mode is None else f"minmax+select ({mode})"
    return best


def plan_everyone(cluster: Cluster, model: ModelProfile, mode: str | None = None, sync=None) -> TensorParallelPlan:
    """Min-Max over every device, none left out (`--local-agents N`: the user asked for N), with the attention heads
    and the LM head split or on the master (`on_master`), and the MLP split or paired (`paired`), whichever the cost
    model prices lower in sync `mode` (None: split)."""
    plan = build_plan(cluster, model, "minmax", prune=False)
    if mode is None:
        return plan
    # not balanced: the agents of `--local-agents` share the master's cores, which the cost model does not price
    # (moving groups to the master there measured 1.05x slower, TinyLlama shape, 3 local agents on 2 cores)
    candidates = [plan, *_with_blocks_on_master([plan])]
    return min(candidates + _paired_variants(candidates), key=_expected_time(mode, sync))


def _with_blocks_on_master(plans: list[TensorParallelPlan]) -> list[TensorParallelPlan]:
    """Each plan with agents in it with its attention, its LM head, or both on the master (`on_master`), where the
    master has the memory and the plan does not already have them there."""
    moved = []
    for plan in plans:
        if plan.n < 2:
            continue
        for kinds in MASTER_PLACEMENTS:
            if all(map(plan.whole_on_master, kinds)):
                continue  # already there
            try:
                moved.append(on_master(plan, kinds))
            except InsufficientMemory:
                continue
    return moved


def _paired_variants(plans: list[TensorParallelPlan]) -> list[TensorParallelPlan]:
    """Each plan with agents in it with its MLP paired (`paired`: every MLP round engages the master and one agent),
    where the devices have the memory. The cost model prices its fewer messages a round against the master's larger
    half: for SmolLM2 over 3 local agents on 2 cores it predicts 6.3 against 10.5 ms a token (measured 10.6 against
    15) and, for a 16-row batch, 41 against 61 ms (measured 36 against 56). (With one agent the even split is
    already a pair.)"""
    out = []
    for plan in plans:
        if plan.n < 3:
            continue
        try:
            out.append(paired(plan))
        except InsufficientMemory:
            continue
    return out


def _expected_time(mode: str, sync):
    from halo.scheduler.cost import estimate

    return lambda plan: estimate(plan, mode, sync=sync).total_s


def _subsets_by_estimate(cluster: Cluster, model: ModelProfile, objective, keep: int = 2,
                         exhaustive_up_to: int = 8) -> list[list[int]]:
    """The best `keep` participant sets by the objective of their Min-Max plan: every set with the master
    for up to `exhaustive_up_to` devices, else the Eq. 1 candidates grown and shrunk greedily."""
    import itertools

    master, n = cluster.master, len(cluster.devices)
    others = [i for i in range(n) if i != master]
    if n <= exhaustive_up_to:
        subsets = [[master, *extra] for k in range(n) for extra in itertools.combinations(others, k)]
    else:
        subsets = candidate_subsets(cluster, model, keep=4)
        subsets += [[i for i in s if i != drop] for s in subsets for drop in s if drop != master]
    scored = []
    for subset in subsets:
        try:
            scored.append((objective(build_plan(cluster, model, "minmax", subset)), subset))
        except InsufficientMemory:
            continue
    return [subset for _, subset in sorted(scored, key=lambda item: item[0])[:keep]]


def _lp_start(cluster: Cluster, model: ModelProfile, algorithm: str, devices: list[int]) -> TensorParallelPlan:
    """Third starting point: per-block ratios from the LP relaxation (memory kept, integrality dropped).

    Unlike one ratio for every block, the LP lets a fast device with little memory specialize in the
    blocks with the most FLOPs per byte (MLP groups carry no KV cache), which the exact optimum does."""
    from scipy.optimize import linprog

    devices = sorted(devices, key=lambda i: (i != cluster.master, i))
    profiles = [cluster.devices[i] for i in devices]
    compute = np.array([d.compute_flops for d in profiles])
    usable = np.array([d.memory_bytes for d in profiles]) - fixed_bytes(cluster, model, devices)
    kinds = TP_KINDS + ("lm_head",)
    blocks = [getattr(model, k) for k in kinds]
    repeats = [model.n_layers, model.n_layers, 1]
    n, K = len(devices), len(kinds)
    cost = np.concatenate([np.zeros(n * K), repeats])  # x[i, k] then T[k]
    upper, upper_b = [], []
    for k, b in enumerate(blocks):  # T_k >= time of device i's share
        for i in range(n):
            row = np.zeros(n * K + K)
            row[i * K + k] = b.flops * b.count / compute[i]
            row[n * K + k] = -1
            upper.append(row)
            upper_b.append(0.0)
    for i in range(n):  # memory
        row = np.zeros(n * K + K)
        for k, b in enumerate(blocks):
            row[i * K + k] = repeats[k] * b.count * model.group_bytes(b, cluster.context)
        upper.append(row)
        upper_b.append(max(usable[i], 0.0))
    equal = np.zeros((K, n * K + K))
    for k in range(K):
        equal[k, [i * K + k for i in range(n)]] = 1
    result = linprog(cost, A_ub=np.array(upper), b_ub=upper_b, A_eq=equal, b_eq=np.ones(K),
                     bounds=[(0, 1)] * (n * K) + [(0, None)] * K, method="highs")
    if result.status != 0:
        raise InsufficientMemory("the LP relaxation has no solution on this participant set")
    x = np.clip(result.x[:n * K].reshape(n, K), 0, None)
    x /= x.sum(axis=0, keepdims=True)
    counts = {kind: round_counts(x[:, k], blocks[k].count, repeats[k]) for k, kind in enumerate(kinds)}
    counts["lm_head"] = counts["lm_head"][:, 0]
    plan = TensorParallelPlan(cluster, model, algorithm, devices, counts)
    repair_memory(plan)
    return prune_idle(plan)


def _greedy_start(cluster: Cluster, model: ModelProfile, algorithm: str, devices: list[int]) -> TensorParallelPlan:
    """Second starting point: every block split by compute alone (integer-optimal per layer), then memory
    repaired group by group. Memory-poor devices keep the blocks where their groups matter most,
    which one ratio for all blocks cannot express."""
    devices = sorted(devices, key=lambda i: (i != cluster.master, i))
    compute = np.array([cluster.devices[i].compute_flops for i in devices])
    counts = {kind: greedy_counts(compute, getattr(model, kind).count, model.n_layers) for kind in TP_KINDS}
    counts["lm_head"] = greedy_counts(compute, model.lm_head.count, 1)[:, 0]
    plan = TensorParallelPlan(cluster, model, algorithm, devices, counts)
    repair_memory(plan)
    return prune_idle(plan)
