"""Which stage engine a device runs: torch on CUDA where a GPU is present, else halo's CPU kernels."""

from __future__ import annotations

from halo.errors import ConfigError
from halo.model.weights import ModelWeights

from halo.pipeline.stage import StageEngine

DEVICES = ("auto", "cpu", "cuda", "torch-cpu")


def make_engine(weights: ModelWeights, start: int, stop: int, max_seq_len: int, fmt: str = "fp32",
                threads: int = 1, device: str = "auto"):
    """device "auto" or "cuda": torch on CUDA when available ("cuda" insists; fp16 weights for native and int8,
    fp32 for fp32); "cpu": halo's own kernels (the TP runtime's C decode steps for native and int8); "torch-cpu":
    the torch engine on the CPU (tests)."""
    if device not in DEVICES:
        raise ConfigError(f"unknown stage device {device!r}: choose auto, cpu, cuda or torch-cpu")
    if device in ("auto", "cuda", "torch-cpu"):
        from halo.pipeline.torch_stage import TorchStageEngine, cuda_available

        if device == "torch-cpu" or cuda_available():
            return TorchStageEngine(weights, start, stop, max_seq_len, "cpu" if device == "torch-cpu" else "cuda", fmt)
        if device == "cuda":
            raise ConfigError("--device cuda: torch with CUDA is not available here (pip install 'halo-edge[gpu]' "
                              "on a machine with an NVIDIA GPU and driver)")
    return StageEngine(weights, start, stop, max_seq_len, fmt, threads)
