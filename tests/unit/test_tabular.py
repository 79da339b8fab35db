"""Table loading/encoding and the tabular models (LR binary/multi-class, MLP)."""

from __future__ import annotations

import io
import json

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import make_classification
from sklearn.linear_model import LogisticRegression

from app.ml import tabular as T
from app.ml.data.tabular import TableEncoder, load_table

CSV = "age, colour, income, label\n30, red, 1000, yes\n40, blue, ?, no\n50, ?, 3000, yes\n60, green, 4000, no\n\n"


def test_load_csv_and_parquet(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(CSV)
    df = load_table(path)
    assert list(df.columns) == ["age", "colour", "income", "label"]
    assert len(df) == 4  # the blank last line is not a row
    assert df["colour"].isna().sum() == 1 and df["income"].isna().sum() == 1
    assert pd.api.types.is_numeric_dtype(df["income"])
    # bytes and file-likes, format sniffed
    assert load_table(path.read_bytes()).equals(df)
    pq = tmp_path / "t.parquet"
    df.to_parquet(pq)
    for src in (pq, pq.read_bytes(), io.BytesIO(pq.read_bytes())):
        assert load_table(src).equals(df)
    with pytest.raises(ValueError):
        load_table(path, fmt="xlsx")


def test_encoder(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(CSV)
    df = load_table(path)
    enc = TableEncoder.fit(df, "label")
    assert enc.classes == ["no", "yes"] and enc.n_classes == 2
    assert enc.categories["colour"] == ["blue", "green", "red"]
    assert enc.n_features == 2 + 3
    X = enc.transform(df)
    assert X.dtype == np.float32 and X.shape == (4, 5)
    assert np.allclose(X[:, 0].mean(), 0, atol=1e-6) and np.allclose(X[:, 0].std(), 1, atol=1e-5)
    assert X[1, 4] == 0.0  # missing numeric -> the mean -> 0
    assert X[2, 1:4].tolist() == [0, 0, 0]  # missing category -> all-zero block
    assert X[0, 1:4].tolist() == [0, 0, 1]  # red
    assert enc.encode_labels(df["label"]).tolist() == [1, 0, 1, 0]
    # unknown category at transform time -> zeros; unknown label -> error
    new = pd.DataFrame({"age": [45], "colour": ["purple"], "income": [2000], "label": ["no"]})
    assert enc.transform(new)[0, 1:4].tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        enc.encode_labels(["maybe"])
    # JSON round trip gives the same encoding
    enc2 = TableEncoder.from_dict(json.loads(json.dumps(enc.to_dict())))
    assert np.array_equal(enc2.transform(df), X)
    with pytest.raises(ValueError):
        TableEncoder.from_dict({**enc.to_dict(), "bogus": 1})
    # integer labels and float labels of the same values are the same classes
    enc3 = TableEncoder.fit(pd.DataFrame({"a": [1.0, 2.0, 3.0], "S": [1, 2, 1]}), "S")
    assert enc3.classes == ["1", "2"] and enc3.encode_labels([1.0, 2.0]).tolist() == [0, 1]


def test_recipe_validation():
    r = T.TabularRecipe.from_dict({"family": "mlp", "hidden_units": 7})
    assert T.TabularRecipe.from_dict(r.to_dict()) == r
    with pytest.raises(ValueError):
        T.TabularRecipe.from_dict({"family": "svm"})
    with pytest.raises(ValueError):
        T.TabularRecipe.from_dict({"hidden": 3})


@pytest.fixture(scope="module")
def binary():
    X, y = make_classification(n_samples=1500, n_features=8, n_informative=5, random_state=0)
    return X.astype(np.float32), y


@pytest.fixture(scope="module")
def multiclass():
    X, y = make_classification(n_samples=1500, n_features=8, n_informative=6, n_classes=3, random_state=1)
    return X.astype(np.float32), y


def test_lr_binary_matches_sklearn(binary):
    X, y = binary
    r = T.TabularRecipe(l2=1e-3)
    theta, info = T.fit(r, X, y, 2)
    assert info["status"] == "converged" and info["grad_max"] < 1e-8
    assert theta.shape == (9,) and theta.dtype == torch.float32
    assert torch.equal(theta, T.train(r, X, y, 2))  # deterministic
    sk = LogisticRegression(C=T.sklearn_C(r, len(X)), tol=1e-12, max_iter=10_000).fit(X, y)
    w = np.concatenate([sk.coef_[0], sk.intercept_])
    assert np.abs(w - theta.numpy()).max() < 1e-3
    acc = T.accuracy(r, theta, X, y, 2)
    assert acc > 0.8 and abs(acc - sk.score(X, y)) < 0.005
    # the L-BFGS path reaches the same optimum
    theta_lbfgs = T.train(T.TabularRecipe(l2=1e-3, solver="lbfgs", max_iter=2000), X, y, 2)
    assert (theta_lbfgs - theta).abs().max() < 1e-3


def test_lr_multiclass_matches_sklearn(multiclass):
    X, y = multiclass
    r = T.TabularRecipe(l2=1e-3)
    theta, info = T.fit(r, X, y, 3)
    assert info["status"] == "converged"
    assert theta.numel() == T.param_count(r, 8, 3) == 27
    sk = LogisticRegression(C=T.sklearn_C(r, len(X)), tol=1e-12, max_iter=10_000).fit(X, y)
    proba = T.predict_proba(r, theta, X, 3)
    assert np.allclose(proba.sum(1), 1)
    assert np.abs(proba - sk.predict_proba(X)).max() < 1e-3
    assert T.accuracy(r, theta, X, y, 3) > 0.6


def test_analytic_gradient_and_hessian_match_autograd(multiclass):
    X, y = multiclass
    for recipe, C in (
        (T.TabularRecipe(family="mlp", hidden_units=4), 3),
        (T.TabularRecipe(), 3),
        (T.TabularRecipe(), 2),
    ):
        yy = y if C == 3 else (y > 0).astype(int)
        obj = T._Objective(recipe, X[:200], yy[:200], C, torch.device("cpu"))
        theta = torch.randn(obj.size, dtype=torch.float64) * 0.3
        _, g = obj.value_grad(theta)

        def f(t, recipe=recipe, yy=yy, C=C, mask=obj.reg_mask):
            Xt = torch.as_tensor(X[:200], dtype=torch.float64)
            logits = T._single_logits(recipe, t, Xt, C)
            loss = torch.nn.functional.cross_entropy(logits, torch.as_tensor(yy[:200]))
            return loss + 0.5 * recipe.l2 * (t * mask * t).sum()

        g_auto = torch.autograd.functional.jacobian(f, theta)
        assert torch.allclose(g, g_auto, atol=1e-10)
        if recipe.family == "logistic_regression":
            assert torch.allclose(obj.hessian(theta), torch.autograd.functional.hessian(f, theta), rtol=1e-5, atol=1e-7)


def test_mlp_deterministic_and_learns(binary):
    X, y = binary
    X, y = X[:600], y[:600]
    r = T.TabularRecipe(family="mlp", max_iter=80)
    a, info = T.fit(r, X, y, 2)
    b = T.train(r, X, y, 2)
    assert torch.equal(a, b)
    assert a.numel() == T.param_count(r, 8, 2) == 10 * 8 + 10 + 2 * 10 + 2
    assert T.accuracy(r, a, X, y, 2) > 0.85
    c = T.train(T.TabularRecipe(family="mlp", max_iter=80, seed=1), X, y, 2)
    assert not torch.equal(a, c)  # the seed drives the initialisation
    names = list(T.unflatten(r, a, 8, 2))
    assert names == ["hidden.weight", "hidden.bias", "output.weight", "output.bias"]
    assert torch.equal(T.flatten(T.unflatten(r, a, 8, 2)), a)
    assert T.infer_n_features(r, a.numel(), 2) == 8


def test_ensemble_predict_averages_members(binary):
    X, y = binary
    r = T.TabularRecipe()
    t1 = T.train(r, X[:700], y[:700], 2)
    t2 = T.train(r, X[700:], y[700:], 2)
    ens = torch.cat([t1, t2])
    expected = (T.predict_proba(r, t1, X, 2) + T.predict_proba(r, t2, X, 2)) / 2
    assert np.allclose(T.predict_proba(r, ens, X, 2), expected)
    with pytest.raises(ValueError):
        T.predict_proba(r, torch.zeros(5), X, 2)


def test_sparse_hessian_path_matches_autograd():
    rng = np.random.default_rng(0)
    cats = rng.integers(0, 12, size=(300, 2))
    X = np.zeros((300, 24), np.float32)  # two one-hot blocks: density 1/12, so the sparse Hessian path is taken
    X[np.arange(300), cats[:, 0]] = 1
    X[np.arange(300), 12 + cats[:, 1]] = 1
    y = rng.integers(0, 3, 300)
    for C in (2, 3):
        yy = y % C
        r = T.TabularRecipe()
        obj = T._Objective(r, X, yy, C, torch.device("cpu"))
        theta = torch.randn(obj.size, dtype=torch.float64) * 0.3

        def f(t, C=C, yy=yy, r=r, mask=obj.reg_mask):
            logits = T._single_logits(r, t, torch.as_tensor(X, dtype=torch.float64), C)
            return torch.nn.functional.cross_entropy(logits, torch.as_tensor(yy)) + 0.5 * r.l2 * (t * mask * t).sum()

        H = obj.hessian(theta)
        assert obj._Xa_sparse is not None
        value, g = obj.value_grad(theta)
        assert np.isclose(value, float(f(theta)), rtol=1e-12)
        assert torch.allclose(g, torch.autograd.functional.jacobian(f, theta), atol=1e-12)
        assert torch.allclose(H, torch.autograd.functional.hessian(f, theta), rtol=1e-5, atol=1e-7)  # float32 gram
        assert T.fit(r, X, yy, C)[1]["status"] == "converged"


def test_categories_are_encoded_by_distinct_value_as_value_by_value():
    """TableEncoder.transform maps a text column's distinct values once (issue 21: a worker re-encoding one 8,192-row
    Adult chunk spent 0.09 s in a Python call per value on the deletion's path): the codes must be those of reading
    each value as str(x).strip() — surrounding spaces, missing values, unseen categories, pandas' string dtype — and
    a column that is not all text (1 and 1.0 are equal but print differently) keeps the value-by-value reading."""
    from app.ml.data.tabular import _category_codes

    def one_by_one(s, cats):
        return pd.Index(cats).get_indexer([str(x).strip() if pd.notna(x) else None for x in s.tolist()])

    cats = ["1", "1.0", "True", "a", "b", "c"]
    columns = [
        pd.Series([" a", "b", None, "a ", np.nan, "c", "unseen", "b"], dtype=object),
        pd.Series(["a", pd.NA, " c"], dtype="string"),
        pd.Series([1, 1.0, True, "1", None], dtype=object),
        pd.Series([None, None], dtype=object),
        pd.Series([], dtype=object),
    ]
    for s in columns:
        assert np.array_equal(_category_codes(s, cats), one_by_one(s, cats)), s.tolist()
    frame = pd.DataFrame({"c": [" a", "b", None, "zz"], "x": [1.0, 2.0, 3.0, 4.0], "y": ["p", "q", "p", "q"]})
    encoder = TableEncoder.fit(frame.iloc[:2], "y")  # "zz" unseen, None missing: all-zero blocks
    X = encoder.transform(frame)
    assert X[:, :2].tolist() == [[1, 0], [0, 1], [0, 0], [0, 0]] and encoder.categories["c"] == ["a", "b"]
