"""Plans for equal local devices by keyword (`--plan even`, `even-mlp`, `even-mlp-only`, `paired-mlp`): the
scheduler's min-max plan over devices of one speed, with chosen blocks kept whole on the master."""

from __future__ import annotations

from halo.compute.neuron_groups import GroupLayout
from halo.errors import ConfigError
from halo.model.config import DEFAULT_CONTEXT
from halo.model.weights import ModelWeights
from halo.scheduler.profiles import Cluster, DeviceProfile, model_profile
from halo.scheduler.tp_plan import build_plan, check_master_kinds, on_master as move, paired as pair

# even plans by keyword (--plan): the blocks kept whole on the master. "even-mlp": every head there, so a token syncs
# once a layer (its MLP) instead of twice; "even-mlp-only": the LM head too, so no logits slices cross the network;
# "paired-mlp": as even-mlp-only, each layer's MLP halved between the master and one agent in turn (PAIRED_PLANS)
EVEN_PLANS = {"even": (), "even-mlp": ("attention",), "even-mlp-only": ("attention", "lm_head"),
              "paired-mlp": ("attention", "lm_head")}
PAIRED_PLANS = ("paired-mlp",)  # scheduler/tp_plan.py `paired`: for agents that share the master's cores
PLAN_KEYWORDS = ("measured", *EVEN_PLANS)  # what --plan takes besides a plan file


def even_plan(weights: ModelWeights, layout: GroupLayout, n_devices: int, compute: list[float] | None = None,
              context: int = DEFAULT_CONTEXT, on_master: tuple[str, ...] = (), paired: bool = False,
              agent_share: float = 0.5):
    """A plan for n equal local devices (or devices with the given relative compute), all taking part; on_master:
    blocks kept whole on the master (scheduler/tp_plan.py `on_master`): "attention" (one sync round a layer),
    "lm_head" (no logits slices on the wire); paired: each layer's MLP halved between the master and one agent,
    the agents taking the layers in turn (tp_plan.py `paired`; `agent_share`: the agent's part, half by default)."""
    check_master_kinds(on_master)
    if paired and compute is not None:
        raise ConfigError("a paired plan halves each layer's MLP between the master and one agent: relative compute "
                          "figures do not apply (give an even plan with them)")

    compute = compute or [1.0] * n_devices
    if len(compute) != n_devices:
        raise ConfigError(f"{len(compute)} compute figures for {n_devices} devices")
    devices = tuple(DeviceProfile(f"device-{i}", 64e9, c * 1e9, is_master=i == 0) for i, c in enumerate(compute))
    profile = model_profile(weights.config, "fp32", mlp_group_size=layout.mlp_group_size,
                            vocab_group_size=layout.vocab_group_size)
    # every device stays a participant (one may get no groups): the caller has one agent per device
    plan = build_plan(Cluster(devices, context=context, weights="fp32"), profile, "minmax", prune=False)
    plan = move(plan, tuple(on_master)) if on_master and n_devices > 1 else plan
    return pair(plan, agent_share=agent_share) if paired else plan
