"""Transport: reliable control plane, lossy deadline sync, fast reliable UDP path. Installed as halo.transport."""
