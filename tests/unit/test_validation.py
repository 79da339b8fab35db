"""Preparation's measured quality (app/ml/unlearning/validation.py) and the worker's warm table: what ``auto`` reads
must be what the methods do on real deletions, and a warm worker must see the table a reload would give."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np

from app.ml import tabular as T
from app.ml.unlearning.base import TabularProblem
from app.ml.unlearning.baselines.sisa import DoNothing
from app.ml.unlearning.newton.method import NewtonUnlearning
from app.ml.unlearning.validation import reference_deletions, validate
from tests.unit.test_newton import linear_data

N = 3000


def _setup():
    X, y = linear_data(N, 6, 2, seed=4)
    recipe = T.TabularRecipe(l2=1e-3)
    holdout = np.zeros(N, bool)
    holdout[: N // 5] = True
    theta = T.train(recipe, X[~holdout], y[~holdout], 2)
    none = np.zeros(N, bool)
    return recipe, X, y, holdout, TabularProblem(recipe, X, y, 2, theta, ~holdout, none, none)


def test_references_are_exact_retrains_of_training_rows():
    recipe, X, y, holdout, _ = _setup()
    refs = reference_deletions(recipe, X, y, 2, ~holdout, sizes=(1, 1, 100, 1000), seed=3)
    assert [len(r.rows) for r in refs] == [1, 1, 24, 24]  # capped at 1 % of the 2,400 training rows
    for ref in refs:
        assert not holdout[ref.rows].any() and len(set(ref.rows)) == len(ref.rows)
        keep = ~holdout
        keep[ref.rows] = False
        assert np.array_equal(ref.theta_r.numpy(), T.train(recipe, X[keep], y[keep], 2).numpy())
        assert ref.solver["status"] == "converged"


def test_validation_tells_a_newton_step_from_doing_nothing():
    recipe, X, y, holdout, base = _setup()
    refs = reference_deletions(recipe, X, y, 2, ~holdout, sizes=(1, 1, 10, 24), seed=0)
    newton = NewtonUnlearning()
    prepared = newton.prepare(base)
    good = validate(newton, replace(base, artifacts=prepared.artifacts), refs, holdout)
    none = validate(DoNothing(), base, refs, holdout)
    assert good["deletions"] == none["deletions"] == 4 and good["sizes"] == [1, 1, 10, 24]
    assert good["param_ratio_median"] < 0.05 and not good["equals_do_nothing"]
    assert none["param_ratios"] == [1.0, 1.0, 1.0, 1.0] and none["equals_do_nothing"]
    assert good["method_seconds_median"] > 0 and good["eval_rows"] == N // 5
    assert abs(good["acc_gap_pts_median"]) < 1.0


def test_a_warm_worker_sees_the_table_a_reload_would_give(tmp_path):
    """After an erasure the worker keeps the encoded table for the rewritten blob's digest (no reload for the next
    request): it must equal what loading that blob gives, scrubbed encoder included."""
    from app.jobs import tabular as wing
    from app.storage import get_store
    from tests.helpers import configure, write_table

    configure(tmp_path / "home")
    frame = write_table(tmp_path / "t.csv", n=200, seed=1)
    frame.loc[7, "colour"] = "violet"  # a category only an erased row carries: the encoder is scrubbed
    frame.to_csv(tmp_path / "t.csv", index=False)
    digest = get_store().put_bytes((tmp_path / "t.csv").read_bytes())
    dataset = SimpleNamespace(
        id="d1", digest=digest, label_column="label", row_id_column="row_id", n_positions=200, format="csv"
    )
    model = SimpleNamespace(state={})
    data = wing.load_tabular(dataset, model)
    data_X_before = data.X.copy()
    model.state["encoder"] = data.encoder.to_dict()
    erased = np.array([3, 7, 150])
    table = wing.rewrite_table(dataset, erased, wing.id_columns(dataset, model))
    encoder = wing.scrub_encoder(data.encoder, data, erased)
    assert encoder is not None
    wing.remember_erased(dataset, data, erased, table, encoder)
    after = SimpleNamespace(**{**vars(dataset), "digest": table.digest, "chunks": table.chunks})
    warm = wing.load_tabular(after, SimpleNamespace(state={"encoder": encoder}))
    # emptied in place (no copy of the table per deletion): the old digest's entry went with it, so a retry after a
    # failed publish reads the old table, erased rows and all, from the store
    old = wing.load_tabular(dataset, SimpleNamespace(state={}))  # as first loaded
    assert old is not data and old.present[erased].all() and np.array_equal(old.X[erased], data_X_before[erased])
    wing.ENCODED.clear()
    wing.FRAMES.clear()
    wing.ENCODED_CHUNKS.clear()
    cold = wing.load_tabular(after, SimpleNamespace(state={"encoder": encoder}))
    assert warm is not cold
    for name in ("X", "y", "row_ids", "present"):
        assert np.array_equal(getattr(warm, name), getattr(cold, name)), name
    assert warm.encoder.to_dict() == cold.encoder.to_dict() and not warm.present[erased].any()


def test_the_encoder_scrub_reading_only_the_erased_rows_categories_equals_a_full_scan(tmp_path):
    """scrub_encoder reads only the categories the erased rows carry (a one-row erasure scanned every categorical
    column of the table): over a sequence of erasures it must scrub exactly the categories a full scan of the
    remaining rows finds unused — one shared with a remaining row stays, one whose last row goes is scrubbed."""
    from app.jobs import tabular as wing
    from app.storage import get_store
    from tests.helpers import configure, write_table

    configure(tmp_path / "home")
    frame = write_table(tmp_path / "t.csv", n=120, seed=3)
    frame.loc[[5, 6], "colour"] = "violet"  # two rows share a rare category: scrubbed only once both are erased
    frame.loc[9, "colour"] = "amber"
    frame.to_csv(tmp_path / "t.csv", index=False)
    digest = get_store().put_bytes((tmp_path / "t.csv").read_bytes())
    dataset = SimpleNamespace(
        id="d2", digest=digest, label_column="label", row_id_column="row_id", n_positions=120, format="csv"
    )
    data = wing.load_tabular(dataset, SimpleNamespace(state={}))

    def full_scan(encoder, present):
        names, j = {}, 0
        for col in encoder.feature_columns:
            if col not in encoder.categories:
                j += 1
                continue
            cats = encoder.categories[col]
            used = data.X[present, j : j + len(cats)].any(axis=0)
            names[col] = [c if used[k] or c.startswith(wing.ERASED_CATEGORY) else f"{wing.ERASED_CATEGORY}{j + k}>"
                          for k, c in enumerate(cats)]  # fmt: skip
            j += len(cats)
        return names

    encoder, present, scrubbed = data.encoder, data.present.copy(), []
    for erased in ([5, 40], [9], [6, 7, 8], [11]):
        erased = np.asarray(erased)
        got = wing.scrub_encoder(encoder, SimpleNamespace(X=data.X, present=present), erased)
        present[erased] = False
        want = full_scan(encoder, present)
        now = got["categories"] if got else encoder.categories
        assert {c: list(now[c]) for c in want} == want
        if got:
            scrubbed.append(int(erased[0]))
            encoder = type(encoder).from_dict(got)
    assert scrubbed == [9, 6]  # amber with its only row; violet with the second of its two
