"""Relaxed synchronization, in one place: the sync modes and their policy (modes.py), what travels inside a
UDP vector (framing.py), when the master stops waiting (deadline.py) and what was lost (ledger.py).

Always exact in every mode: layer 0 and the LM head (no predictor ranks them; logits must be exact),
and every input (it feeds the KV caches). An agent handles attention inputs in order and never skips
one; one that never comes marks its caches incomplete and it answers Status.KV_GAP until the next
reset, which stops the master with an error. An agent that has sent nothing for the master's timeout
is reported as gone, even when all its partials were droppable. Attention heads stay where the plan
put them (their KV caches cannot move per token); in halo mode their predicted ranking decides
which attention partials are critical, and MLP groups are re-mapped per token.
"""

from halo.sync.deadline import AdaptiveDeadline
from halo.sync.framing import Epoch, FramingError, Point, Status, ranking_digest
from halo.sync.ledger import LossLedger
from halo.sync.modes import POLICIES, SYNC_MODES, ModePolicy, RoundPlan, SyncSettings, Transport, plan_round, ranks_next_layer_itself

__all__ = ["AdaptiveDeadline", "Epoch", "FramingError", "LossLedger", "ModePolicy", "POLICIES", "Point", "RoundPlan",
           "SYNC_MODES", "Status", "SyncSettings", "Transport", "plan_round", "ranking_digest", "ranks_next_layer_itself"]
