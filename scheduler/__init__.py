"""Scheduler: neuron-group plans for tensor-parallel and pipeline mode. Installed as halo.scheduler."""
