"""Isolation Kernel feature map (Voronoi / aNNE form) and the kernel mean embeddings L2UL feeds to N_U.

Notes §1.2: t partitionings; partitioning i draws psi seeds from the data rows WITHOUT replacement and sends a point
to the one-hot of its nearest seed (Euclidean), so Phi(x) in {0,1}^(t*psi) has exactly t ones. The KME of a set is
the mean of Phi over it (Eq. 1): t concatenated histograms over psi cells. L2UL leaves the mechanism open; aNNE is
the consistent reading of its text ([INFERENCE] in the notes) and matches the reference code (IKspace.m, IKFeature).

Storage: Phi is kept per row as the nearest-seed index of each partitioning (``cells``: uint8 [n, t]), so mu_f is a
gather-and-count over stored rows (Algorithm 2 step 1 without recomputing distances), and mu_D is kept as integer
cell counts so deleting rows updates it exactly (mu_new = (n mu - sum_f Phi) / (n - |f|), bit-for-bit the recompute).

Labels [INFERENCE, config ``label_aware`` in L2ULConfig]: Phi(x) alone cannot tell N_U whether a deleted row was a
positive or a negative example, which flips the sign of its influence on theta. With ``n_classes`` given, the
embeddings below are the KME of the joint (x, y) distribution under the product kernel kappa_I(x, x') * 1[y = y']:
feature map Phi(x) (x) e_y, i.e. one t*psi block per class, each block scaled by the class's share of the set.

Seed purge (notes §1.4 flag, not in the paper): a seed is a data row, so a deleted row that is a seed still shapes
Phi. ``purge_seeds`` re-draws such seeds from the retained rows and recomputes only the affected partitionings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK_ROWS = 65_536


def _cell_dtype(psi: int) -> np.dtype:
    return np.dtype(np.uint8) if psi <= 256 else np.dtype(np.int16)


@dataclass
class IsolationKernel:
    """Seeds of t Voronoi partitionings, as row indices into the data set's X (int64 [t, psi])."""

    seeds: np.ndarray

    @property
    def t(self) -> int:
        return int(self.seeds.shape[0])

    @property
    def psi(self) -> int:
        return int(self.seeds.shape[1])

    @property
    def dim(self) -> int:
        return self.t * self.psi

    @classmethod
    def fit(cls, eligible_rows: np.ndarray, psi: int = 4, t: int = 100, rng: np.random.Generator | None = None):
        """Draw, per partitioning, psi distinct seed rows among ``eligible_rows`` (Alg. 1 line 1: seeds from D)."""
        eligible_rows = np.asarray(eligible_rows, dtype=np.int64)
        if psi < 2 or t < 1:
            raise ValueError("psi must be >= 2 and t >= 1")
        if len(eligible_rows) < psi:
            raise ValueError(f"need at least psi={psi} rows to draw seeds, got {len(eligible_rows)}")
        rng = rng or np.random.default_rng(0)
        seeds = np.stack([rng.choice(eligible_rows, psi, replace=False) for _ in range(t)])
        return cls(seeds=seeds.astype(np.int64))

    # ------------------------------------------------------------------ feature map
    def cells(self, X: np.ndarray, rows: np.ndarray | None = None, partitions: np.ndarray | None = None) -> np.ndarray:
        """Nearest-seed index per (row, partitioning): [len(rows), len(partitions)] of uint8 (int16 if psi > 256).

        ``X`` is the full data matrix the seed indices refer to; ``rows`` selects which rows to map (default all).
        argmin_z ||x - z||^2 = argmin_z (||z||^2 - 2 x.z), computed in float64 chunks of rows.
        """
        parts = np.arange(self.t) if partitions is None else np.asarray(partitions)
        centres = np.asarray(X[self.seeds[parts].reshape(-1)], dtype=np.float64)  # [len(parts)*psi, d]
        c2 = (centres**2).sum(1)
        n_rows = X.shape[0] if rows is None else len(rows)
        out = np.empty((n_rows, len(parts)), dtype=_cell_dtype(self.psi))
        for start in range(0, n_rows, CHUNK_ROWS):
            stop = min(start + CHUNK_ROWS, n_rows)
            block = X[start:stop] if rows is None else X[rows[start:stop]]
            dist = c2[None, :] - 2.0 * (np.asarray(block, dtype=np.float64) @ centres.T)
            out[start:stop] = dist.reshape(stop - start, len(parts), self.psi).argmin(2)
        return out

    def phi(self, cells: np.ndarray) -> np.ndarray:
        """Dense Phi in {0,1}^(t*psi) from stored cells (for tests and small sets; embeddings never build it)."""
        n = cells.shape[0]
        out = np.zeros((n, self.dim), dtype=np.float32)
        out[np.arange(n)[:, None], np.arange(self.t)[None, :] * self.psi + cells] = 1.0
        return out

    # ------------------------------------------------------------------ embeddings
    def counts(self, cells: np.ndarray, labels: np.ndarray | None = None, n_classes: int | None = None) -> np.ndarray:
        """Integer cell counts, [t*psi] or, with labels, [n_classes * t*psi] (class-major): the un-normalised KME."""
        flat = (np.arange(self.t, dtype=np.int64)[None, :] * self.psi + cells).reshape(-1)
        if labels is None:
            return np.bincount(flat, minlength=self.dim).astype(np.int64)
        if n_classes is None:
            raise ValueError("n_classes is required with labels")
        flat = flat + np.repeat(np.asarray(labels, dtype=np.int64), self.t) * self.dim
        return np.bincount(flat, minlength=self.dim * n_classes).astype(np.int64)

    def embed(self, cells: np.ndarray, labels: np.ndarray | None = None, n_classes: int | None = None) -> np.ndarray:
        """KME mu = mean of Phi over the rows of ``cells`` (Eq. 1), joint with the label when ``labels`` is given."""
        if cells.shape[0] == 0:
            raise ValueError("cannot embed an empty set")
        return self.counts(cells, labels, n_classes) / float(cells.shape[0])

    def embed_many(
        self,
        cells: np.ndarray,
        groups: list[np.ndarray] | np.ndarray,
        labels: np.ndarray | None = None,
        n_classes: int | None = None,
    ) -> np.ndarray:
        """KMEs of many row sets at once (meta-tasks): [len(groups), dim] float32; groups index rows of ``cells``."""
        width = self.dim * (n_classes if labels is not None else 1)
        out = np.empty((len(groups), width), dtype=np.float32)
        for i, g in enumerate(groups):
            g = np.asarray(g)
            out[i] = self.embed(cells[g], None if labels is None else labels[g], n_classes)
        return out

    # ------------------------------------------------------------------ seed purge
    def purge_seeds(self, deleted_rows: np.ndarray, eligible_rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Replace every seed that is a deleted row by a fresh draw from ``eligible_rows`` (retained, not already a
        seed of that partitioning). Returns the indices of the partitionings that changed (their cells must be
        recomputed for every row)."""
        deleted = np.isin(self.seeds, np.asarray(deleted_rows))
        changed = np.nonzero(deleted.any(1))[0]
        eligible_rows = np.asarray(eligible_rows, dtype=np.int64)
        for i in changed:
            keep = self.seeds[i][~deleted[i]]
            pool = np.setdiff1d(eligible_rows, keep, assume_unique=False)
            need = int(deleted[i].sum())
            if len(pool) < need:
                raise ValueError("not enough retained rows to re-draw Isolation Kernel seeds")
            self.seeds[i, deleted[i]] = rng.choice(pool, need, replace=False)
        return changed


@dataclass
class KernelState:
    """The kernel plus the stored Phi of every row and the running mu_D of the rows still in the training set."""

    kernel: IsolationKernel
    cells: np.ndarray  # [n, t] nearest-seed index of every row of X
    counted: np.ndarray  # bool [n]: rows currently inside mu_D (training rows not yet deleted)
    counts: np.ndarray  # int64 [dim * C or dim]: sum of (label-joint) Phi over counted rows
    n_classes: int | None  # None -> embeddings ignore labels

    @classmethod
    def build(
        cls,
        X: np.ndarray,
        y: np.ndarray,
        train_rows: np.ndarray,
        psi: int,
        t: int,
        rng: np.random.Generator,
        n_classes: int | None,
    ) -> KernelState:
        train_rows = np.asarray(train_rows, dtype=np.int64)
        kernel = IsolationKernel.fit(train_rows, psi, t, rng)
        cells = kernel.cells(X)
        counted = np.zeros(X.shape[0], dtype=bool)
        counted[train_rows] = True
        labels = y[train_rows] if n_classes else None
        counts = kernel.counts(cells[train_rows], labels, n_classes)
        return cls(kernel, cells, counted, counts, n_classes)

    @classmethod
    def from_kernel(
        cls, kernel: IsolationKernel, X: np.ndarray, y: np.ndarray, train_rows: np.ndarray, n_classes: int | None
    ) -> KernelState:
        """Phi of every row under given seeds (e.g. each unit's drawn from its own block, method.py) and mu_D's
        counts over ``train_rows``; rows outside them keep no Phi (zeroed cells)."""
        train_rows = np.asarray(train_rows, dtype=np.int64)
        cells = kernel.cells(X)
        counted = np.zeros(X.shape[0], dtype=bool)
        counted[train_rows] = True
        cells[~counted] = 0
        counts = kernel.counts(cells[train_rows], y[train_rows] if n_classes else None, n_classes)
        return cls(kernel, cells, counted, counts, n_classes)

    def keep_partitions(self, partitions: np.ndarray) -> KernelState:
        """A new state with only these partitionings (their seeds, cells and counts); the others leave no trace."""
        parts = np.asarray(partitions, dtype=np.int64)
        psi, t = self.kernel.psi, self.kernel.t
        blocks = self.counts.reshape(-1, t, psi)[:, parts, :].reshape(-1)
        return KernelState(
            IsolationKernel(self.kernel.seeds[parts].copy()),
            np.ascontiguousarray(self.cells[:, parts]),
            self.counted.copy(),
            blocks.copy(),
            self.n_classes,
        )

    def partitions_view(self, embedding: np.ndarray, partitions: np.ndarray) -> np.ndarray:
        """The coordinates of embeddings ([..., dim * C or dim], class-major) that belong to these partitionings."""
        lead = embedding.shape[:-1]
        psi, t = self.kernel.psi, self.kernel.t
        view = embedding.reshape(*lead, -1, t, psi)[..., np.asarray(partitions), :]
        return view.reshape(*lead, -1)

    @property
    def n(self) -> int:
        """Rows inside mu_D (every class block of ``counts`` sums to it per partitioning, so no O(n) scan)."""
        return (
            int(self.counts[: self.kernel.psi].sum())
            if not self.n_classes
            else int(self.counts.reshape(self.n_classes, self.kernel.t, self.kernel.psi)[:, 0, :].sum())
        )

    def mu_D(self) -> np.ndarray:
        return self.counts / float(self.n)

    def mu(self, rows: np.ndarray, y: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows)
        return self.kernel.embed(self.cells[rows], y[rows] if self.n_classes else None, self.n_classes)

    def remove(self, rows: np.ndarray, y: np.ndarray) -> None:
        """Exact running update of mu_D after deleting ``rows`` (rows already gone are ignored)."""
        rows = np.asarray(rows, dtype=np.int64)
        rows = rows[self.counted[rows]]
        if len(rows) == 0:
            return
        self.counts = self.counts - self.kernel.counts(
            self.cells[rows], y[rows] if self.n_classes else None, self.n_classes
        )
        self.counted[rows] = False

    def purge_seeds(self, deleted_rows: np.ndarray, X: np.ndarray, y: np.ndarray, rng: np.random.Generator) -> int:
        """Re-draw seeds that are deleted rows; recompute those partitionings' cells and mu_D. Returns #seeds."""
        n_deleted_seeds = int(np.isin(self.kernel.seeds, deleted_rows).sum())
        if n_deleted_seeds == 0:
            return 0
        eligible = np.nonzero(self.counted)[0]
        changed = self.kernel.purge_seeds(deleted_rows, eligible, rng)
        self.cells[:, changed] = self.kernel.cells(X, partitions=changed)
        labels = y[eligible] if self.n_classes else None
        self.counts = self.kernel.counts(self.cells[eligible], labels, self.n_classes)
        return n_deleted_seeds
