"""ModelWeights: every tensor of a Llama model in one canonical layout.

Loaders (llama2.c, Hugging Face, GGUF) convert to this layout; everything else reads only this.
Matrices are row-major (out_features, in_features): float32 arrays, or `QuantizedMatrix` (GGUF
blocks kept compact, halo/model/quant.py; indexing one gives float32 rows). Norms are float32 vectors.
Rotary embeddings use the Hugging Face "rotate half" convention: within each head, the first half
of the q/k features pairs with the second half. llama2.c and GGUF checkpoints rotate adjacent pairs
and are permuted on load. Arrays may be read-only memory maps of the checkpoint (zero-copy loading).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from halo.errors import ModelFormatError
from halo.model.config import ModelConfig
from halo.model.quant import QuantizedMatrix, Weight


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (dim,)
    wq: Weight  # (n_heads * head_dim, dim)
    wk: Weight  # (n_kv_heads * head_dim, dim)
    wv: Weight  # (n_kv_heads * head_dim, dim)
    wo: Weight  # (dim, n_heads * head_dim)
    mlp_norm: np.ndarray  # (dim,)
    w_gate: Weight  # (hidden_dim, dim)   llama2.c w1
    w_up: Weight  # (hidden_dim, dim)     llama2.c w3
    w_down: Weight  # (dim, hidden_dim)   llama2.c w2


@dataclass
class ModelWeights:
    config: ModelConfig
    tok_embeddings: Weight  # (vocab, dim); a lookup table (a compact one dequantizes only the rows looked up)
    layers: list[LayerWeights]
    final_norm: np.ndarray  # (dim,)
    lm_head: Weight  # (vocab, dim); the same object as tok_embeddings when tied
    source: str = ""  # where the weights came from, for messages
    extra: dict = field(default_factory=dict)

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        return {
            "attn_norm": (c.dim,),
            "wq": (c.q_dim, c.dim),
            "wk": (c.kv_dim, c.dim),
            "wv": (c.kv_dim, c.dim),
            "wo": (c.dim, c.q_dim),
            "mlp_norm": (c.dim,),
            "w_gate": (c.hidden_dim, c.dim),
            "w_up": (c.hidden_dim, c.dim),
            "w_down": (c.dim, c.hidden_dim),
        }

    def validate(self) -> None:
        """Check every shape against the config; a loader calls this before handing weights out."""
        c = self.config
        checks = [("tok_embeddings", self.tok_embeddings, (c.vocab_size, c.dim)),
                  ("final_norm", self.final_norm, (c.dim,)),
                  ("lm_head", self.lm_head, (c.vocab_size, c.dim))]
        if len(self.layers) != c.n_layers:
            raise ModelFormatError(self.source, f"expected {c.n_layers} layers, found {len(self.layers)}")
        shapes = self.expected_shapes()
        for i, layer in enumerate(self.layers):
            for name, shape in shapes.items():
                checks.append((f"layers.{i}.{name}", getattr(layer, name), shape))
        for name, array, shape in checks:
            if tuple(array.shape) != shape:
                raise ModelFormatError(self.source, f"tensor {name}: expected shape {shape}, found {tuple(array.shape)}")
            if isinstance(array, QuantizedMatrix):
                if len(shape) != 2:
                    raise ModelFormatError(self.source, f"tensor {name}: a norm vector must be float32, found "
                                           f"{array.codec.name} blocks")
            elif not isinstance(array, np.ndarray) or array.dtype != np.float32:
                raise ModelFormatError(self.source, f"tensor {name}: expected float32 or quantized blocks after "
                                       f"loading, found {getattr(array, 'dtype', type(array).__name__)}")

    @property
    def compact(self) -> bool:
        """Whether any matrix is kept in a quantized block format (a GGUF file's Q4_0/Q4_1/Q8_0...)."""
        return any(isinstance(a, QuantizedMatrix) for a in self._arrays())

    def nbytes(self) -> int:
        """Bytes of distinct weight arrays as stored (a tied head counts once)."""
        arrays = {id(a): a for a in self._arrays()}
        return sum(a.nbytes for a in arrays.values())

    def _arrays(self):
        yield self.tok_embeddings
        yield self.final_norm
        yield self.lm_head
        for layer in self.layers:
            yield from vars(layer).values()
