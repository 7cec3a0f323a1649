"""ModelConfig: the shape of a Llama-family model, whatever file it came from."""

from __future__ import annotations

import math
from dataclasses import dataclass

from halo.errors import ConfigError

DEFAULT_CONTEXT = 2048  # KV-cache length when none is asked for (at most the model's own)


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama-3.1 `rope_scaling` (rope_type "llama3"): stretches low frequencies by `factor`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    dim: int  # hidden size D
    hidden_dim: int  # MLP intermediate size
    n_layers: int
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (GQA when < n_heads)
    vocab_size: int
    max_seq_len: int
    head_dim: int = 0  # 0: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    tied_embeddings: bool = False
    bos_id: int = 1
    eos_ids: tuple[int, ...] = (2,)

    def __post_init__(self):
        if self.head_dim == 0 and self.n_heads > 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        for name in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"model config: n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim={self.head_dim} must be even for rotary embeddings")
        for name in ("norm_eps", "rope_theta"):  # (a NaN epsilon or a zero base decoded token 0 forever)
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ConfigError(f"model config: {name} must be a positive finite number, got {value!r}")
        for name, ids in (("bos_id", () if self.bos_id is None else (self.bos_id,)), ("eos_ids", self.eos_ids)):
            if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
                raise ConfigError(f"model config: {name} {ids} must be token ids of the vocabulary "
                                  f"(0..{self.vocab_size - 1})")

    @property
    def kv_group(self) -> int:
        """How many query heads share one KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim
