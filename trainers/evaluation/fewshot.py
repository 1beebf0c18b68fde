"""Few-shot linear probe, as big_vision's fewshot_lsr: frozen features, standardised with the
few-shot set's own mean and std, a constant bias feature, targets 2*onehot-1, closed-form ridge
regression (lambda 2**10), accuracy of the argmax. Shots per class, several seeds, mean and spread.
"""
from __future__ import annotations

import numpy as np

from infra.errors import UserError


def ridge_fit_predict(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, num_classes: int,
                      lam: float = 2.0 ** 10) -> np.ndarray:
    """Closed-form ridge on standardised features plus a bias column -> predicted classes of test_x."""
    mean, std = train_x.mean(0), train_x.std(0) + 1e-8
    def prep(x):
        z = (x - mean) / std
        return np.concatenate([z, np.ones((len(z), 1))], axis=1).astype(np.float64)
    xtr, xte = prep(train_x), prep(test_x)
    targets = 2.0 * np.eye(num_classes)[train_y] - 1.0
    # (X^T X + lam I) W = X^T Y, solved in the cheaper of the two equivalent forms
    n, d = xtr.shape
    if n < d:
        w = xtr.T @ np.linalg.solve(xtr @ xtr.T + lam * np.eye(n), targets)
    else:
        w = np.linalg.solve(xtr.T @ xtr + lam * np.eye(d), xtr.T @ targets)
    return (xte @ w).argmax(1)


def few_shot_split(labels: np.ndarray, shots: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`shots` examples per class for training (by seed), the rest for testing."""
    rng = np.random.default_rng(seed)
    train = []
    for c in np.unique(labels):
        idx = np.where(labels == c)[0]
        if len(idx) <= shots:
            raise UserError(f"class {c} has {len(idx)} examples; {shots}-shot needs more than {shots} "
                            "(some must remain for testing)")
        train += list(rng.choice(idx, size=shots, replace=False))
    train = np.array(sorted(train))
    test = np.setdiff1d(np.arange(len(labels)), train)
    return train, test


def probe(features: np.ndarray, labels: np.ndarray, shots=(1, 5, 10, 25), seeds=(0, 1, 2),
          lam: float = 2.0 ** 10) -> dict:
    """-> {shots: {"mean": acc, "std": acc, "runs": [...]}} for each shot count."""
    classes = {c: i for i, c in enumerate(sorted(set(labels.tolist())))}
    y = np.array([classes[c] for c in labels.tolist()])
    out = {}
    for k in shots:
        accs = []
        for s in seeds:
            tr, te = few_shot_split(y, k, s)
            pred = ridge_fit_predict(features[tr], y[tr], features[te], len(classes), lam)
            accs.append(float((pred == y[te]).mean()))
        out[k] = {"mean": float(np.mean(accs)), "std": float(np.std(accs)), "runs": accs}
    return out
