from __future__ import annotations

from dataclasses import dataclass

import pytest

from app.ml.unlearning import base
from app.ml.unlearning.base import (
    InvalidMethodSettingsError,
    MethodNotSupportedError,
    UnknownMethodError,
    available_methods,
    choose_method,
    explain_choice,
    get_method,
    register_method,
    supporting_method,
)


@dataclass
class _Config:
    steps: int = 3


class _Method:
    def __init__(self, config: _Config):
        self.config = config


def test_builtin_methods_declare_kinds_and_scopes():
    by_name = {m.name: m for m in available_methods()}
    assert by_name["retrain"].model_kinds == {"tabular"} and by_name["retrain"].scopes == {"samples", "class"}
    assert by_name["l2ul"].needs_preparation and not by_name["retrain"].needs_preparation
    assert by_name["ease"].model_kinds == {"clip_federated"}
    assert {m.name for m in available_methods(model_kind="clip_federated", scope="client")} >= {"ease", "federaser"}
    with pytest.raises(UnknownMethodError):
        get_method("no-such-method")


@pytest.fixture
def own_method():
    """The test's method leaves the registry as it found it (a second run in one process registers it afresh)."""
    yield
    base._REGISTRY.pop("test-method", None)


def test_settings_are_validated_and_typos_refused(own_method):
    spec = register_method("test-method", _Config, _Method, model_kinds={"tabular"}, scopes={"samples"})
    assert spec.build({"steps": 5}).config.steps == 5
    with pytest.raises(InvalidMethodSettingsError, match="stpes"):
        spec.build({"stpes": 5})
    # a name is registered once: a second registration is a bug, even of the same class (no "last one wins")
    for method in (f"{_Method.__module__}:{_Method.__qualname__}", _Config):
        with pytest.raises(ValueError, match="already registered"):
            register_method("test-method", _Config, method, model_kinds={"tabular"}, scopes={"samples"})


def _validated(ratio: float, seconds: float, do_nothing: bool = False) -> dict:
    """What a preparation stores (app/jobs/tabular.py prepare_methods): the measured quality, nothing else."""
    return {
        "validation": {
            "param_ratio_median": ratio,
            "method_seconds_median": seconds,
            "equals_do_nothing": do_nothing,
        }
    }


def test_auto_is_chosen_by_the_registry():
    # tabular: exact retraining unless a prepared fast method was measured within the quality bar
    assert choose_method("auto", "tabular", "samples", prepared=set()) == "retrain"
    assert choose_method("auto", "tabular", "samples", prepared={"l2ul"}) == "retrain"  # prepared, never measured
    assert choose_method("auto", "clip_federated", "client") == "ease"
    assert choose_method("sisa", "tabular", "samples") == "sisa"  # a named method is taken as asked
    with pytest.raises(MethodNotSupportedError):
        choose_method("auto", "no-such-kind", "samples")
    with pytest.raises(MethodNotSupportedError, match="cannot take a 'class' scope"):
        supporting_method("l2ul", "tabular", "class")
    assert supporting_method("retrain", "tabular", "class").name == "retrain"


def test_auto_takes_the_fastest_method_within_the_measured_quality_bar():
    both = {"newton": _validated(0.004, 2e-4), "influence": _validated(0.03, 1e-5)}
    assert choose_method("auto", "tabular", "samples", both) == "influence"  # both within 0.1: the faster
    assert choose_method("auto", "tabular", "samples", both, max_param_ratio=0.01) == "newton"
    assert choose_method("auto", "tabular", "samples", both, max_param_ratio=0.001) == "retrain"
    worse = {"newton": _validated(0.004, 2e-4), "influence": _validated(0.2, 1e-5)}
    assert choose_method("auto", "tabular", "samples", worse) == "newton"
    explained = explain_choice("auto", "tabular", "samples", worse)
    assert explained["method"] == "newton" and "0.004" in explained["reason"]
    assert "0.2 > 0.1" in explained["considered"]["influence"]
    assert explain_choice("newton", "tabular", "samples", worse)["reason"] == "named by the request"


def test_auto_never_takes_a_method_equal_to_doing_nothing():
    # L2UL calibrated to an output scale of 0 returns theta unchanged: fastest of all, and never offered
    prepared = {"l2ul": _validated(0.0, 1e-6, do_nothing=True), "newton": _validated(0.3, 2e-4)}
    explained = explain_choice("auto", "tabular", "samples", prepared)
    assert explained["method"] == "retrain" and "doing nothing" in explained["considered"]["l2ul"]
    fine = {"l2ul": _validated(0.05, 1e-6), "newton": _validated(0.004, 2e-4)}
    assert choose_method("auto", "tabular", "samples", fine) == "l2ul"  # measured good enough, and faster
    assert choose_method("auto", "tabular", "class", fine) == "newton"  # L2UL takes no class scope


def test_lazy_references_resolve():
    spec = get_method("l2ul")
    assert spec.method_cls.__name__ == "L2UL" and spec.make_config({"m": 20}).m == 20
