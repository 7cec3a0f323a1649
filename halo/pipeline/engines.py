"""A pipeline stage worker's engine, on the backend halo/compute/backends.py `stage_backend` chooses for its device."""

from __future__ import annotations

from halo.compute.backends import stage_backend
from halo.model.weights import ModelWeights
from halo.pipeline.stage import StageEngine


def make_engine(weights: ModelWeights, start: int, stop: int, max_seq_len: int, fmt: str = "fp32",
                threads: int = 1, device: str = "auto"):
    """The engine of layers start..stop: torch (fp16 weights for native and int8, fp32 for fp32) on CUDA or, for
    tests, the CPU; else halo's own kernels (the TP runtime's C decode steps for native and int8)."""
    backend, torch_device = stage_backend(device)
    if backend == "torch":
        from halo.pipeline.torch_stage import TorchStageEngine

        return TorchStageEngine(weights, start, stop, max_seq_len, torch_device, fmt)
    return StageEngine(weights, start, stop, max_seq_len, fmt, threads)
