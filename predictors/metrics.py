"""How well a ranking of neuron groups matches their true importance.

Spearman and top-k recall are hand-written (numpy; the runtime's tests use them); NDCG is
scikit-learn's `ndcg_score` (the `train` extra), with the true norms as graded relevance: it weighs a
mistake at the top of the ranking, where the critical partials are chosen, more than one at the bottom."""

from __future__ import annotations

import numpy as np


def ranks(x: np.ndarray) -> np.ndarray:
    """Rank of each entry within its row (0 = smallest)."""
    return np.argsort(np.argsort(x, axis=-1, kind="stable"), axis=-1, kind="stable").astype(np.float64)


def spearman(predicted: np.ndarray, true: np.ndarray) -> float:
    """Mean over rows (tokens) of the Spearman rank correlation between predicted and true scores."""
    a, b = ranks(predicted), ranks(true)
    a -= a.mean(axis=-1, keepdims=True)
    b -= b.mean(axis=-1, keepdims=True)
    denom = np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    return float(np.mean(np.where(denom > 0, (a * b).sum(-1) / np.where(denom > 0, denom, 1), 0.0)))


def top_k_recall(predicted: np.ndarray, true: np.ndarray, fraction: float) -> float:
    """Mean fraction of the true top-k groups (k = fraction of the groups) found in the predicted top-k."""
    n = true.shape[-1]
    k = max(1, int(round(fraction * n)))
    top_true = np.argsort(-true, axis=-1, kind="stable")[:, :k]
    top_pred = np.argsort(-predicted, axis=-1, kind="stable")[:, :k]
    hits = [len(np.intersect1d(t, p, assume_unique=True)) for t, p in zip(top_true, top_pred)]
    return float(np.mean(hits) / k)


def ndcg(predicted: np.ndarray, true: np.ndarray) -> float:
    """Mean normalized discounted cumulative gain of the predicted order, true norms as relevance."""
    from sklearn.metrics import ndcg_score

    return float(ndcg_score(np.asarray(true, dtype=np.float64), np.asarray(predicted, dtype=np.float64)))


def ranking_report(predicted: np.ndarray, true: np.ndarray) -> dict:
    return {"spearman": spearman(predicted, true), "recall@25%": top_k_recall(predicted, true, 0.25),
            "recall@50%": top_k_recall(predicted, true, 0.50), "ndcg": ndcg(predicted, true)}
