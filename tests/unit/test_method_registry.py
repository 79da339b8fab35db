from __future__ import annotations

from dataclasses import dataclass

import pytest

from app.ml.unlearning.base import (
    InvalidMethodSettingsError,
    MethodNotSupportedError,
    UnknownMethodError,
    available_methods,
    choose_method,
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


def test_settings_are_validated_and_typos_refused():
    spec = register_method("test-method", _Config, _Method, model_kinds={"tabular"}, scopes={"samples"})
    assert spec.build({"steps": 5}).config.steps == 5
    with pytest.raises(InvalidMethodSettingsError, match="stpes"):
        spec.build({"stpes": 5})
    # a name is registered once: a second registration is a bug, even of the same class (no "last one wins")
    for method in (f"{_Method.__module__}:{_Method.__qualname__}", _Config):
        with pytest.raises(ValueError, match="already registered"):
            register_method("test-method", _Config, method, model_kinds={"tabular"}, scopes={"samples"})


def test_auto_is_chosen_by_the_registry():
    # tabular: L2UL once prepared (and only for the scopes it takes), else exact retraining
    assert choose_method("auto", "tabular", "samples", prepared=set()) == "retrain"
    assert choose_method("auto", "tabular", "samples", prepared={"l2ul"}) == "l2ul"
    assert choose_method("auto", "tabular", "class", prepared={"l2ul"}) == "retrain"
    assert choose_method("auto", "clip_federated", "client") == "ease"
    assert choose_method("sisa", "tabular", "samples") == "sisa"  # a named method is taken as asked
    with pytest.raises(MethodNotSupportedError):
        choose_method("auto", "no-such-kind", "samples")
    with pytest.raises(MethodNotSupportedError, match="cannot take a 'class' scope"):
        supporting_method("l2ul", "tabular", "class")
    assert supporting_method("retrain", "tabular", "class").name == "retrain"


def test_lazy_references_resolve():
    spec = get_method("l2ul")
    assert spec.method_cls.__name__ == "L2UL" and spec.make_config({"m": 10}).m == 10
