from __future__ import annotations

from dataclasses import dataclass

import pytest

from app.ml.unlearning.base import (
    InvalidMethodSettingsError,
    UnknownMethodError,
    available_methods,
    get_method,
    register_method,
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
    # the same class again (e.g. a package registering by reference, the module eagerly) is fine; another is not
    register_method(
        "test-method",
        _Config,
        f"{_Method.__module__}:{_Method.__qualname__}",
        model_kinds={"tabular"},
        scopes={"samples"},
    )
    with pytest.raises(ValueError, match="already registered"):
        register_method("test-method", _Config, _Config, model_kinds={"tabular"}, scopes={"samples"})


def test_lazy_references_resolve():
    spec = get_method("l2ul")
    assert spec.method_cls.__name__ == "L2UL" and spec.make_config({"m": 10}).m == 10
