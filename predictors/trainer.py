"""Trainer (needs the `train` extra: torch): one small MLP per layer, regressing normalized group norms.

The predictor for layer l+1 reads the hidden state entering layer l (available one layer ahead, so
prediction overlaps layer l's communication) and outputs one score per attention head and per MLP
group of layer l+1. Targets are each block's norms divided by their sum per token, so every token
weighs the same and only the shape of the distribution is learned (HALO: regress norms, not a
two-class sigmoid as in Deja Vu). Layer 0 has no predictor: the first layer always syncs reliably.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from halo.predictors.metrics import ranking_report
from halo.predictors.profiler import load_split


@dataclass
class TrainSettings:
    hidden: int = 64
    epochs: int = 40
    batch_size: int = 512
    learning_rate: float = 2e-3
    patience: int = 5  # epochs without validation improvement before stopping
    seed: int = 0


@dataclass
class LayerPredictor:
    layer: int  # the layer whose groups it ranks
    mean: np.ndarray  # input standardization
    std: np.ndarray
    w1: np.ndarray  # [h, D]
    b1: np.ndarray
    w2: np.ndarray  # [H + G, h]
    b2: np.ndarray
    n_heads: int
    n_mlp_groups: int
    metrics: dict = field(default_factory=dict)
    epochs_run: int = 0

    def scores(self, hidden: np.ndarray) -> np.ndarray:
        """numpy forward pass (the reference for the ONNX export): [N, D] -> [N, H + G]."""
        x = (hidden - self.mean) / self.std
        return np.maximum(x @ self.w1.T + self.b1, 0) @ self.w2.T + self.b2

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.mean, self.std, self.w1, self.b1, self.w2, self.b2))


def normalize_targets(norms: np.ndarray, n_heads: int) -> np.ndarray:
    heads, groups = norms[:, :n_heads], norms[:, n_heads:]
    eps = 1e-12
    return np.concatenate([heads / (heads.sum(1, keepdims=True) + eps), groups / (groups.sum(1, keepdims=True) + eps)],
                          axis=1).astype(np.float32)


def evaluate(predicted: np.ndarray, true: np.ndarray, n_heads: int) -> dict:
    return {"attention": ranking_report(predicted[:, :n_heads], true[:, :n_heads]),
            "mlp": ranking_report(predicted[:, n_heads:], true[:, n_heads:])}


def baselines(train_norms: np.ndarray, val_norms: np.ndarray, n_heads: int, seed: int) -> dict:
    """A static ranking (mean normalized norm over the training tokens) and a random one."""
    static = np.broadcast_to(normalize_targets(np.asarray(train_norms), n_heads).mean(0), val_norms.shape)
    rng = np.random.default_rng(seed)
    random = rng.random(val_norms.shape)
    return {"static": evaluate(static, val_norms, n_heads), "random": evaluate(random, val_norms, n_heads)}


def ridge_baseline(x_train: np.ndarray, y_train: np.ndarray, x_val: np.ndarray, true: np.ndarray, n_heads: int,
                   alpha: float = 1.0) -> dict:
    """A linear predictor (scikit-learn ridge regression on the same standardized inputs and targets): what the
    MLP's hidden layer has to beat to be worth its compute."""
    from sklearn.linear_model import Ridge

    model = Ridge(alpha=alpha).fit(x_train, y_train)
    return evaluate(model.predict(x_val), true, n_heads)


def train_layer(directory: Path, layer: int, n_heads: int, settings: TrainSettings, log=None) -> LayerPredictor:
    """Train the predictor of `layer` (>= 1) from layer-1's hidden states."""
    import torch

    torch.manual_seed(settings.seed + layer)
    torch.use_deterministic_algorithms(True)
    x_train, _ = load_split(directory, "train", layer - 1)
    _, n_train = load_split(directory, "train", layer)
    x_val, _ = load_split(directory, "val", layer - 1)
    _, n_val = load_split(directory, "val", layer)
    mean = np.asarray(x_train).mean(0).astype(np.float32)
    std = (np.asarray(x_train).std(0) + 1e-6).astype(np.float32)
    xt = torch.from_numpy((np.asarray(x_train) - mean) / std)
    yt = torch.from_numpy(normalize_targets(np.asarray(n_train), n_heads))
    xv = torch.from_numpy((np.asarray(x_val) - mean) / std)
    yv = torch.from_numpy(normalize_targets(np.asarray(n_val), n_heads))
    net = torch.nn.Sequential(torch.nn.Linear(xt.shape[1], settings.hidden), torch.nn.ReLU(),
                              torch.nn.Linear(settings.hidden, yt.shape[1]))
    optimizer = torch.optim.Adam(net.parameters(), lr=settings.learning_rate)
    generator = torch.Generator().manual_seed(settings.seed + layer)
    best, best_state, stale, epochs = float("inf"), None, 0, 0
    for epoch in range(settings.epochs):
        net.train()
        order = torch.randperm(len(xt), generator=generator)
        for start in range(0, len(xt), settings.batch_size):
            batch = order[start:start + settings.batch_size]
            loss = torch.nn.functional.mse_loss(net(xt[batch]), yt[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        net.eval()
        with torch.no_grad():
            val_loss = float(torch.nn.functional.mse_loss(net(xv), yv))
        epochs = epoch + 1
        if log:
            log(layer, epoch, val_loss)
        if val_loss < best - 1e-9:
            best, stale = val_loss, 0
            best_state = {k: v.clone() for k, v in net.state_dict().items()}
        else:
            stale += 1
            if stale >= settings.patience:
                break
    net.load_state_dict(best_state)
    params = {k: v.detach().numpy().astype(np.float32) for k, v in net.state_dict().items()}
    predictor = LayerPredictor(layer, mean, std, params["0.weight"], params["0.bias"], params["2.weight"],
                               params["2.bias"], n_heads, yt.shape[1] - n_heads, epochs_run=epochs)
    with torch.no_grad():
        predicted = net(xv).numpy()
    true = np.asarray(n_val)
    predictor.metrics = {"val_loss": best, "val_tokens": len(true), "train_tokens": len(xt),
                         "predictor": evaluate(predicted, true, n_heads),
                         "ridge": ridge_baseline(xt.numpy(), yt.numpy(), xv.numpy(), true, n_heads),
                         **baselines(n_train, true, n_heads, settings.seed + layer)}
    return predictor


def torch_scores(predictor: LayerPredictor, hidden: np.ndarray) -> np.ndarray:
    """The trained network evaluated by torch, for the export parity check."""
    import torch

    net = torch.nn.Sequential(torch.nn.Linear(predictor.w1.shape[1], predictor.w1.shape[0]), torch.nn.ReLU(),
                              torch.nn.Linear(predictor.w2.shape[1], predictor.w2.shape[0]))
    state = {"0.weight": predictor.w1, "0.bias": predictor.b1, "2.weight": predictor.w2, "2.bias": predictor.b2}
    net.load_state_dict({k: torch.tensor(np.array(v, dtype=np.float32)) for k, v in state.items()})
    with torch.no_grad():
        return net(torch.from_numpy(((hidden - predictor.mean) / predictor.std).astype(np.float32))).numpy()
