"""Which attention heads matter most: the predictors' profile, for placing heads by importance.

Heads cannot move per token (their KV caches stay where they are), so the plan's one lever for them is
where they sit: the heads the predictors rate highest on average go to the master and the most
reliable links (halo/compute/shares.py turns the plan's rank ranges into heads with `head_order`).

The profile: run calibration text through the model once, and for every layer l >= 1 average the
predictors' scores of its heads (they read the residual stream entering layer l - 1, as at run time).
Layer 0 has no predictor; it is always synchronized exactly (halo/sync), so its heads keep index
order. The calibration text is the predictors' own training text when it is readable (their manifest
names it), else the model's greedy continuation of BOS. The result is cached per model and predictor
set, beside the device benchmarks (halo/host/cache.py `device_cache_dir`: halo's cache, devices/).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np

from halo.errors import ConfigError

log = logging.getLogger("halo.scheduler")
CALIBRATION_TOKENS = 512
WINDOW = 128


def head_order(importance: np.ndarray) -> np.ndarray:
    """[L, H] mean importance -> [L, H] heads of every layer, the most important first (ties: lower
    index first, so a flat profile gives index order)."""
    importance = np.asarray(importance, dtype=np.float64)
    if importance.ndim != 2:
        raise ConfigError(f"a head-importance profile is [layers, heads], got shape {importance.shape}")
    return np.argsort(-importance, axis=1, kind="stable")


def mean_head_scores(predictors, entering: list[np.ndarray], n_layers: int, n_heads: int) -> np.ndarray:
    """[L, H] mean predicted score of every head; entering[l]: [T, D] residual streams entering layer l.
    Layers without a predictor get zeros (index order)."""
    scores = np.zeros((n_layers, n_heads))
    for layer in range(1, n_layers):
        if layer in predictors.sessions:
            scores[layer] = predictors.scores(layer, entering[layer - 1])[:, :n_heads].mean(axis=0)
    return scores


def calibration_tokens(weights, tokenizer, predictors, n_tokens: int = CALIBRATION_TOKENS) -> list[list[int]]:
    """Windows of calibration tokens (each starting with BOS): the predictors' training text if readable,
    else the model's own greedy text."""
    bos = tokenizer.bos_id if tokenizer.bos_id is not None else 0
    window = min(WINDOW, weights.config.max_seq_len)
    text_path = Path(str(predictors.manifest.get("data", {}).get("text", "")))
    if text_path.is_file():
        tokens = tokenizer.encode(text_path.read_text(encoding="utf-8")[:20 * n_tokens], bos=False)[:n_tokens]
        return [[bos] + tokens[i:i + window - 1] for i in range(0, len(tokens), window - 1) if tokens[i:i + window - 1]]
    from halo.compute.transformer import Transformer

    model, token, out = Transformer(weights, max_seq_len=window), bos, [bos]
    for _ in range(window - 1):
        token = int(np.argmax(model.forward([token])))
        out.append(token)
    return [out]


def profile_heads(weights, predictors, windows: list[list[int]]) -> np.ndarray:
    """[L, H] mean predicted importance over the calibration windows."""
    from halo.compute.transformer import Transformer

    class Recording(Transformer):
        def layer(self, i, x, start):
            entering[i].append(x)
            return super().layer(i, x, start)

    c = weights.config
    entering: list[list[np.ndarray]] = [[] for _ in range(c.n_layers)]
    model = Recording(weights, max_seq_len=max(len(w) for w in windows))
    for tokens in windows:
        model.reset()
        model.forward(tokens)
    return mean_head_scores(predictors, [np.concatenate(e) for e in entering], c.n_layers, c.n_heads)


def cached_head_order(weights, predictors, tokenizer=None) -> np.ndarray:
    """The heads of every layer by importance, from the cache or computed once (seconds) and cached."""
    from halo.host.cache import device_cache_dir
    from halo.model.loader import load_tokenizer, model_fingerprint

    digest = hashlib.sha256(json.dumps(predictors.manifest, sort_keys=True).encode()).hexdigest()[:16]
    path = device_cache_dir() / f"head-importance-{model_fingerprint(weights.source)[:16]}-{digest}.json"
    try:
        return head_order(np.array(json.loads(path.read_text())["importance"]))
    except (OSError, ValueError, KeyError, ConfigError):
        pass  # not cached yet (or unreadable): compute it
    tokenizer = tokenizer or load_tokenizer(weights)
    importance = profile_heads(weights, predictors, calibration_tokens(weights, tokenizer, predictors))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"model": str(weights.source), "importance": importance.tolist()}))
    except OSError as e:
        log.warning("could not cache the head-importance profile at %s: %s", path, e)
    return head_order(importance)
