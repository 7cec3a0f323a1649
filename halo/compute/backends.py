"""Which implementation computes a block on this device: decided here, and held to one reference.

A Llama layer's math has one reference: numpy over float32 weights (halo/model/ops.py, and the shards' `forward` in
halo/compute/neuron_groups.py in the fp32 format), checked against transformers (tests/test_hf_parity.py). Every
other implementation computes the same block and is held to that reference by tests/test_backends.py:

| backend | what computes a block | chosen |
|---|---|---|
| "c-step" | halo/_nbits.c `attention_step` / `mlp_step`: the whole block in one C call | `block_backend`: every projection of the share is halo's C kernel (compact formats, where it was built) |
| "onnx-graph" | halo/compute/block_graph.py: the block as one onnxruntime graph over MatMulNBits | `block_backend`: every projection is one onnxruntime kernel (no C kernel, or linear.PREFER_C_KERNEL off) |
| "projections" | neuron_groups' `forward`: the projections called one by one, numpy in between | `block_backend`: fp32 (the reference itself), mixed kinds, a matrix over several kernels |
| "torch" | halo/pipeline/torch_stage.py: a pipeline stage's layers in torch (CUDA, fp16 where compact) | `stage_backend`: a stage worker with a GPU |
| "halo" | halo/pipeline/stage.py: a pipeline stage's layers through the shards above | `stage_backend`: a stage worker without one |

(A browser worker runs halo/pipeline/onnx_export.py's graph in onnxruntime-web; tests/test_backends.py holds it to the
reference too.)
"""

from __future__ import annotations

from halo.compute.linear import DequantKernel, KernelProjection, _nbits
from halo.errors import ConfigError

BLOCK_BACKENDS = ("c-step", "onnx-graph", "projections")
STAGE_DEVICES = ("auto", "cpu", "cuda", "torch-cpu")


def block_backend(*projections) -> str:
    """The backend of a block share made of these projections (made with open_session=False): "onnx-graph" when each
    is one unopened MatMulNBits kernel (the graph opens them); else they are opened here, and "c-step" when each is
    then one unpadded halo C kernel, "projections" otherwise."""
    if all(isinstance(p, KernelProjection) and len(p.kernels) == 1 and p.kernels[0].session is None
           and not p.kernels[0].in_c for p in projections):
        return "onnx-graph"
    for p in projections:
        if isinstance(p, KernelProjection):
            p.open()
    return "c-step" if c_weights(*projections) is not None else "projections"


def c_weights(*projections) -> tuple | None:
    """The C decode steps' weights of these projections (`DequantKernel.c_weight`), or None unless each is one kernel
    that halo's C kernel computes without padding its inputs."""
    weights = []
    for p in projections:
        kernel = p.kernels[0].session if isinstance(p, KernelProjection) and len(p.kernels) == 1 else None
        if not isinstance(kernel, DequantKernel) or kernel.padded or _nbits is None:
            return None
        weights.append(kernel.c_weight)
    return tuple(weights)


def cuda_available() -> bool:
    """Whether torch is installed and sees a CUDA device (torch imported only to ask)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def stage_backend(device: str) -> tuple[str, str]:
    """A pipeline stage worker's backend and torch device for `--device`: "auto" or "cuda": ("torch", "cuda") where
    CUDA is available ("cuda" insists); "cpu": ("halo", "cpu"), halo's own kernels (the TP runtime's C decode steps
    for native and int8); "torch-cpu": ("torch", "cpu"), the torch engine on the CPU (tests)."""
    if device not in STAGE_DEVICES:
        raise ConfigError(f"unknown stage device {device!r}: choose auto, cpu, cuda or torch-cpu")
    if device == "torch-cpu":
        return "torch", "cpu"
    if device in ("auto", "cuda") and cuda_available():
        return "torch", "cuda"
    if device == "cuda":
        raise ConfigError("--device cuda: torch with CUDA is not available here (pip install 'halo-edge[gpu]' "
                          "on a machine with an NVIDIA GPU and driver)")
    return "halo", "cpu"
