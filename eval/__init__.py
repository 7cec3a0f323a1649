"""Benchmarks, accuracy runs and reports. Installed as halo.eval."""
