"""The machine halo runs on: the cores this process may use, its memory (resident, charged, the cgroup's limit), and
the cache directory where downloads and measurements are kept."""
