"""The master side of a tensor-parallel cluster, by concern:

- remote.py: `RemoteAgent`, one object per agent (address, node id, share, stats, liveness);
- session.py: the control plane of a session (hello, UDP endpoint, link probes, reset, bye);
- rounds.py: `MasterRound`, one block's synchronization as the sync policy plans it;
- master.py: `DistributedModel`, a device worker plus the coordinator of the forward pass;
- connect.py: `cluster_model` / `connect`, the one way to build a master over agents with a plan, and
  `Replanner` (planning a running cluster again);
- survive.py: `SurvivingModel`, the master that re-plans when an agent is lost, comes back or straggles;
- `LocalCluster`, agents started on this machine, lives in halo/runtime/local.py (the pipeline starts them too) and
  is re-exported here.
"""

from halo.distributed.connect import cluster_model, connect
from halo.distributed.master import DistributedModel
from halo.distributed.remote import AgentError, RemoteAgent
from halo.distributed.session import DEFAULT_TIMEOUT_S, MasterSettings
from halo.runtime.local import AgentProcess, LocalCluster, agent_command, module_command, stop_processes

__all__ = ["AgentError", "AgentProcess", "DEFAULT_TIMEOUT_S", "DistributedModel", "LocalCluster", "MasterSettings",
           "RemoteAgent", "agent_command", "cluster_model", "connect", "module_command", "stop_processes"]
