"""One pipeline stage: a contiguous range of plan units run on one device, with its own KV cache.

Plan units (scheduler/pipeline.py): unit 0 is the embedding, unit 1 + l is decoder layer l, unit
L + 1 is the head (final RMSNorm + LM head). A stage holding unit 0 takes token ids; any other
stage takes the residual stream [T, D]. A stage holding the head returns logits (or only what
sampling needs, see `HeadRequest`); any other stage returns the residual stream after its last layer.

The layers are built from halo/compute/neuron_groups.py shards holding every group of a block, so a stage
runs exactly the arithmetic of the single-process reference (`halo.compute.transformer.Transformer`): the same
kernels on the same inputs give the same bits, whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from halo.compute.neuron_groups import GroupLayout
from halo.compute.shares import Block, everything
from halo.compute.worker import DeviceWorker
from halo.errors import ConfigError
from halo.model.config import ModelConfig
from halo.model.weights import ModelWeights


def n_units(config: ModelConfig) -> int:
    """Embedding + one unit per layer + head."""
    return config.n_layers + 2


def check_units(config: ModelConfig, start: int, stop: int) -> None:
    if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start < stop <= n_units(config)):
        raise ConfigError(f"unit range [{start!r}, {stop!r}) is not a non-empty range within the model's "
                          f"{n_units(config)} units (embedding, {config.n_layers} layers, head)")


def unit_name(config: ModelConfig, unit: int) -> str:
    return "embedding" if unit == 0 else ("head" if unit == config.n_layers + 1 else f"layer {unit - 1}")


@dataclass(frozen=True)
class HeadRequest:
    """What the head stage sends back. top_k > 0: the k largest logits of the last position and their
    ids (k = 1 is the greedy token); top_k = 0: full logits of the last position; all_positions: full
    logits of every position (lm-eval scoring)."""

    top_k: int = 1
    all_positions: bool = False

    def to_json(self) -> dict:
        return {"top_k": self.top_k, "all_positions": self.all_positions}

    @classmethod
    def from_json(cls, raw) -> "HeadRequest":
        if not isinstance(raw, dict) or not isinstance(raw.get("top_k"), int) or raw["top_k"] < 0 \
                or not isinstance(raw.get("all_positions"), bool):
            raise ConfigError(f"bad head request {raw!r}: expected {{top_k: int >= 0, all_positions: bool}}")
        return cls(raw["top_k"], raw["all_positions"])


def top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest logits of a [V] vector and their ids, largest first, lower id first on ties
    (k = 1 is np.argmax)."""
    k = min(k, len(logits))
    ids = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
    ids = ids[np.lexsort((ids, -logits[ids]))]
    return ids.astype(np.int64), logits[ids].astype(np.float32)


def dense_from_top_k(ids: np.ndarray, values: np.ndarray, vocab_size: int) -> np.ndarray:
    """A [V] logit vector with -inf outside the top k: greedy and top-k sampling (k at most the
    number sent) choose from it exactly as from the full logits."""
    out = np.full(vocab_size, -np.inf, dtype=np.float32)
    out[ids] = values
    return out


class StageEngine:
    """Units [start, stop) of a model in numpy (CPU), with a KV cache for max_seq_len positions: a device
    worker holding every group of its layers (and of the LM head when it holds the head)."""

    engine = "numpy-cpu"
    weight_format = None  # the plan's own: halo's kernels hold the file's blocks (native) or what --weights says

    def __init__(self, weights: ModelWeights, start: int, stop: int, max_seq_len: int, fmt: str = "fp32",
                 threads: int = 1):
        c = self.config = weights.config
        check_units(c, start, stop)
        self.start, self.stop, self.max_seq_len = start, stop, max_seq_len
        self.layers = list(range(max(0, start - 1), min(c.n_layers, stop - 1)))
        self.embedding = weights.tok_embeddings if start == 0 else None
        self.has_head = stop == n_units(c)
        layout = GroupLayout.for_model(c)
        self.worker = DeviceWorker(weights, layout, everything(c, layout, self.layers, self.has_head), max_seq_len, fmt,
                                   threads)

    @property
    def takes_tokens(self) -> bool:
        return self.embedding is not None

    def forward(self, inputs: np.ndarray, start_pos: int, head: HeadRequest = HeadRequest()) -> list[np.ndarray]:
        """inputs: token ids [T] (a stage with the embedding) or the residual stream [T, D] at positions
        start_pos.. -> [residual [T, D]], or for the head stage [ids, values] (top_k > 0) or [logits]."""
        T = len(inputs)
        if T == 0 or start_pos < 0 or start_pos + T > self.max_seq_len:
            raise ConfigError(f"positions {start_pos}..{start_pos + T - 1} are outside the context "
                              f"of {self.max_seq_len} tokens")
        c = self.config
        if self.takes_tokens:
            if inputs.ndim != 1 or inputs.min() < 0 or inputs.max() >= c.vocab_size:
                raise ConfigError(f"token ids must be a 1-D array within 0..{c.vocab_size - 1}")
            x = np.array(self.embedding[inputs], dtype=np.float32)
        else:
            if inputs.ndim != 2 or inputs.shape[1] != c.dim:
                raise ConfigError(f"the residual stream has shape {inputs.shape}, expected [T, {c.dim}]")
            x = np.asarray(inputs, dtype=np.float32)
        for l in self.layers:
            x = x + self.worker.compute(Block("attention", l), x, start_pos)
            x = x + self.worker.compute(Block("mlp", l), x, start_pos)
        if not self.has_head:
            return [x]
        logits = self.worker.compute(Block("lm_head", c.n_layers), x if head.all_positions else x[-1:], start_pos)
        if head.all_positions or head.top_k == 0:
            return [logits]
        return list(top_k(logits[-1], head.top_k))

    def reset(self) -> None:
        self.worker.reset()

    @property
    def weight_nbytes(self) -> int:
        return self.worker.nbytes + (self.embedding.nbytes if self.embedding is not None else 0)


