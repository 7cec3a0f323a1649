"""halo-agent: the daemon each edge device runs. Installed as halo.edge_agent."""
