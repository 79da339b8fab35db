"""Helpers shared by the benchmarks: the real tabular data sets, loaded, split and encoded the same way everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from app.ml.data.tabular import TableEncoder, load_table

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = REPO.parent / "shared" / "datasets"
"""../shared/datasets relative to the repository root (see its README.md)."""
LABELS = {"adult": "Salary", "skin": "S"}


def load_real_dataset(
    name: str, data_dir: Path = DATA_DIR, max_rows: int | None = None, seed: int = 0
) -> dict[str, Any]:
    """Adult or Skin: an optional random subsample of ``max_rows``, an 80/20 train/test split, and a TableEncoder fitted
    on the training part (one-hot categories, standardised numbers). Returns X_tr, y_tr, X_te, y_te, n_classes,
    source."""
    rng = np.random.default_rng(seed)
    label = LABELS[name]
    path = Path(data_dir) / f"{name}.csv"
    df = load_table(path)
    if max_rows:
        df = df.iloc[rng.permutation(len(df))[:max_rows]].reset_index(drop=True)
    perm = rng.permutation(len(df))
    n_tr = int(0.8 * len(df))
    train_df, test_df = df.iloc[perm[:n_tr]], df.iloc[perm[n_tr:]]
    enc = TableEncoder.fit(train_df, label)
    return {
        "X_tr": enc.transform(train_df),
        "y_tr": enc.encode_labels(train_df[label]),
        "X_te": enc.transform(test_df),
        "y_te": enc.encode_labels(test_df[label]),
        "n_classes": enc.n_classes,
        "source": str(path),
    }
