"""Few-shot linear probe, as big_vision's fewshot_lsr: frozen features, standardised with the
few-shot set's own mean and std, a constant bias feature, targets 2*onehot-1, closed-form ridge
regression (lambda 2**10), accuracy of the argmax. Shots per class, several seeds, mean and spread.

Shots are drawn from a set's official train split and scored on its test split, as big_vision
does; a set without one holds out a fixed share of each class (`holdout_split`, the same for every
seed and shot count), never among the images the shots are drawn from.
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


HOLDOUT_SEED = 12345


def holdout_split(labels: np.ndarray, share: float) -> tuple[np.ndarray, np.ndarray]:
    """-> (pool, test) indices: `share` of each class (at least one image) held out for testing, by a
    fixed seed; the shots of every seed are drawn from the pool."""
    rng = np.random.default_rng(HOLDOUT_SEED)
    test = []
    for c in np.unique(labels):
        idx = np.where(labels == c)[0]
        # at least one image on each side when the class has two (one alone can only be tested)
        size = max(1, min(len(idx) - 1, int(round(share * len(idx))))) if len(idx) > 1 else 1
        test += list(rng.choice(idx, size=size, replace=False))
    test = np.array(sorted(test), dtype=np.int64)
    return np.setdiff1d(np.arange(len(labels)), test), test


def fewest_in(labels: np.ndarray, pool: np.ndarray) -> int:
    """The fewest images of any class in `pool` (the train split, or what the holdout leaves): the
    most shots (plus validation) a set can serve. A class absent from the pool counts 0."""
    return min(int((labels[pool] == c).sum()) for c in np.unique(labels))


def few_shot_split(labels: np.ndarray, shots: int, seed: int, pool: np.ndarray | None = None,
                   extra: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`shots` examples per class drawn (by seed) from `pool` (default: every index) -> (train, rest
    of the pool). extra: examples per class that must remain in the rest (validation)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(len(labels)) if pool is None else pool
    train = []
    for c in np.unique(labels):
        idx = pool[labels[pool] == c]
        if len(idx) < shots + extra or not len(idx):
            raise UserError(f"class {c} has {len(idx)} examples to draw from; {shots}-shot needs at least "
                            f"{shots + extra}")
        train += list(rng.choice(idx, size=shots, replace=False))
    train = np.array(sorted(train))
    return train, np.setdiff1d(pool, train)


def probe(features: np.ndarray, labels: np.ndarray, shots=(1, 5, 10, 25), seeds=(0, 1, 2),
          lam: float = 2.0 ** 10, holdout: float = 0.5, pool: np.ndarray | None = None,
          test: np.ndarray | None = None) -> dict:
    """-> {shots: {"mean": acc, "std": acc, "runs": [...]}} for each shot count, on the test split:
    `pool` and `test` (an official split's train and test indices) or the held-out split."""
    classes = {c: i for i, c in enumerate(sorted(set(labels.tolist())))}
    y = np.array([classes[c] for c in labels.tolist()])
    if pool is None or test is None:
        pool, test = holdout_split(y, holdout)
    out = {}
    for k in shots:
        accs = []
        for s in seeds:
            tr, _ = few_shot_split(y, k, s, pool)
            pred = ridge_fit_predict(features[tr], y[tr], features[test], len(classes), lam)
            accs.append(float((pred == y[test]).mean()))
        out[k] = {"mean": float(np.mean(accs)), "std": float(np.std(accs)), "runs": accs}
    return out
