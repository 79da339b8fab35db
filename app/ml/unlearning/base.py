"""The unlearning-method contract and registry.

A method is registered once with ``register_method(name, config_cls, method_cls, model_kinds=..., scopes=...)``
(the pattern of peft's tuner registry); the worker looks it up by name and never needs editing when a method is
added. Everything here is pure: arrays and tensors in, arrays and tensors out, method state as opaque bytes that the
worker stores in the artifact store. ``choose_method`` answers "which method runs this request" (``auto`` included), so
the worker never names a method.

``config_cls`` and ``method_cls`` may be given as ``"module:attribute"`` strings, resolved on first use, so that a
method package's ``__init__`` registers without importing torch: the API validates method names, model kinds and
scopes against this registry without loading any ML code.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # the API process reads the registry and must not load torch (it hands work to jobs)
    import numpy as np
    import torch

ProgressFn = Callable[[float, str], None]
"""progress(fraction in [0, 1], message) — the worker writes it to the job row."""


def no_progress(fraction: float, message: str) -> None:  # noqa: ARG001 - the default sink
    """Progress sink for callers that do not report progress."""


@dataclass
class TabularProblem:
    """One tabular deletion (or, with an all-False ``forget_mask``, one preparation run).

    ``X``/``y`` hold every row of the registered data set in registry order; the masks say which rows the new
    version may learn from (``retain_mask``: neither tombstoned earlier nor deleted now) and which rows this request
    deletes (``forget_mask``). ``tombstone_mask`` marks rows deleted by earlier requests.
    """

    recipe: Any  # app.ml.tabular.TabularRecipe
    X: np.ndarray
    y: np.ndarray
    n_classes: int
    theta: torch.Tensor
    retain_mask: np.ndarray
    forget_mask: np.ndarray
    tombstone_mask: np.ndarray
    artifacts: Mapping[str, bytes] = field(default_factory=dict)
    progress: ProgressFn = no_progress


@dataclass
class UnlearningResult:
    """The unlearned parameters, JSON-serialisable facts for the report/certificate, and updated method state."""

    theta: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, bytes] = field(default_factory=dict)


@runtime_checkable
class UnlearningMethod(Protocol):
    """What every method implements; a method with a one-off cost (L2UL meta-training) also has ``prepare``."""

    def unlearn(self, problem: Any) -> UnlearningResult: ...


def _ref_name(ref: type | str) -> str:
    """``"module:Qualname"`` of a class or of a string reference."""
    return ref if isinstance(ref, str) else f"{ref.__module__}:{ref.__qualname__}"


def _resolve(ref: type | str) -> type:
    if not isinstance(ref, str):
        return ref
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_ref: type | str
    method_ref: type | str
    model_kinds: frozenset[str]
    scopes: frozenset[str]
    needs_preparation: bool = False
    auto_priority: int | None = None
    exact: bool = False
    """Retraining without the rows: the reference, and where ``auto`` escalates when a verdict fails."""

    @property
    def config_cls(self) -> type:
        return _resolve(self.config_ref)

    @property
    def method_cls(self) -> type:
        return _resolve(self.method_ref)

    def make_config(self, settings: Mapping[str, Any] | None = None) -> Any:
        return make_config(self.config_cls, settings or {})

    def build(self, settings: Mapping[str, Any] | None = None) -> UnlearningMethod:
        """Validate ``settings`` against the config dataclass and instantiate the method."""
        return self.method_cls(self.make_config(settings))


class UnknownMethodError(KeyError):
    pass


class InvalidMethodSettingsError(ValueError):
    pass


class MethodNotSupportedError(ValueError):
    """The method exists but cannot take this model kind or scope (or is not prepared for the model)."""


_REGISTRY: dict[str, MethodSpec] = {}


def register_method(
    name: str,
    config_cls: type | str,
    method_cls: type | str,
    *,
    model_kinds: set[str] | frozenset[str],
    scopes: set[str] | frozenset[str],
    needs_preparation: bool = False,
    auto_priority: int | None = None,
    exact: bool = False,
) -> MethodSpec:
    """Register a method under ``name``, once: a second registration of the name is a bug, not "last one wins".

    ``auto_priority``: the method may be chosen by ``method: "auto"``; among those that fit, the highest wins
    (see :func:`choose_method`). None: only when asked for by name (baselines, experiments).
    """
    if name in _REGISTRY:
        raise ValueError(f"method {name!r} is already registered by {_ref_name(_REGISTRY[name].method_ref)!r}")
    spec = MethodSpec(
        name,
        config_cls,
        method_cls,
        frozenset(model_kinds),
        frozenset(scopes),
        needs_preparation,
        auto_priority,
        exact,
    )
    _REGISTRY[name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    _load_builtin_methods()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownMethodError(name) from None


def available_methods(model_kind: str | None = None, scope: str | None = None) -> list[MethodSpec]:
    _load_builtin_methods()
    return [
        spec
        for spec in _REGISTRY.values()
        if (model_kind is None or model_kind in spec.model_kinds) and (scope is None or scope in spec.scopes)
    ]


def make_config(config_cls: type, settings: Mapping[str, Any]) -> Any:
    """Build a config dataclass from a JSON mapping, refusing unknown keys (a typo must not silently fall back)."""
    if not dataclasses.is_dataclass(config_cls):
        return config_cls(**settings)
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise InvalidMethodSettingsError(f"unknown settings {unknown}; known: {sorted(known)}")
    try:
        return config_cls(**settings)
    except (TypeError, ValueError) as exc:
        raise InvalidMethodSettingsError(str(exc)) from exc


def supporting_method(name: str, model_kind: str, scope: str) -> MethodSpec:
    """The registered method ``name``, checked to take ``scope`` deletions on ``model_kind`` models."""
    spec = get_method(name)
    if model_kind not in spec.model_kinds or scope not in spec.scopes:
        raise MethodNotSupportedError(f"method {name!r} cannot take a {scope!r} scope on a {model_kind} model")
    return spec


AUTO_MAX_PARAM_RATIO = 0.1
"""``auto`` takes a fast method only if its validated median param_ratio ||theta' - theta_r|| / ||theta - theta_r||
is at most this (issue 10, item 4): within a tenth of the way from the original to the retrained model."""


def choose_method(
    requested: str,
    model_kind: str,
    scope: str,
    prepared: Iterable[str] | Mapping[str, Mapping[str, Any]] = (),
    *,
    max_param_ratio: float = AUTO_MAX_PARAM_RATIO,
) -> str:
    """The method a request runs: the one it names, or for ``auto`` the one :func:`explain_choice` picks.

    Plain values in, a name out: the worker asks this and holds no method names of its own."""
    return explain_choice(requested, model_kind, scope, prepared, max_param_ratio=max_param_ratio)["method"]


def explain_choice(
    requested: str,
    model_kind: str,
    scope: str,
    prepared: Iterable[str] | Mapping[str, Mapping[str, Any]] = (),
    *,
    max_param_ratio: float = AUTO_MAX_PARAM_RATIO,
) -> dict[str, Any]:
    """The method a request runs and why: ``{"method", "requested", "reason", "considered"}``.

    ``prepared``: the methods prepared for the model, with their preparation facts (a name → info mapping; a plain
    set of names carries none). For ``auto``, among the methods that take this kind and scope and have an
    ``auto_priority``:
    1. a method that needs a one-off preparation (a fast one: Newton, influence, L2UL) is a candidate only when it is
       prepared AND its preparation measured it on real deletions of the full model (``info["validation"]``,
       app/ml/unlearning/validation.py) with a median param_ratio <= ``max_param_ratio`` and it did not equal doing
       nothing; the fastest candidate by measured median method time wins (``auto_priority`` breaks ties);
    2. otherwise the highest ``auto_priority`` among those that need no preparation (exact retraining for tables).
    A method whose quality was never measured is never chosen: its speed says nothing about what it returns.
    """
    if requested != AUTO:
        return {"method": requested, "requested": requested, "reason": "named by the request"}
    facts: Mapping[str, Mapping[str, Any]] = (
        prepared if isinstance(prepared, Mapping) else {name: {} for name in prepared}
    )
    specs = [s for s in available_methods(model_kind, scope) if s.auto_priority is not None]
    considered: dict[str, str] = {}
    fast: list[tuple[float, int, str, float]] = []
    for spec in specs:
        if not spec.needs_preparation:
            continue
        if spec.name not in facts:
            considered[spec.name] = "not prepared for this model"
            continue
        validation = (facts[spec.name] or {}).get("validation")
        if not validation:
            considered[spec.name] = "prepared without a measured quality (no validation)"
            continue
        ratio, seconds = validation.get("param_ratio_median"), validation.get("method_seconds_median")
        if validation.get("equals_do_nothing"):
            considered[spec.name] = "validated equal to doing nothing (theta' = theta)"
        elif ratio is None or seconds is None:
            considered[spec.name] = "validation measured nothing"
        elif ratio > max_param_ratio:
            considered[spec.name] = f"validated param_ratio {ratio:.3g} > {max_param_ratio:g}"
        else:
            considered[spec.name] = f"validated param_ratio {ratio:.3g} <= {max_param_ratio:g}, {seconds:.3g} s"
            fast.append((float(seconds), -spec.auto_priority, spec.name, float(ratio)))
    if fast:
        seconds, _, name, ratio = min(fast)
        reason = (
            f"fastest prepared method whose validated median param_ratio ({ratio:.3g}) is at most "
            f"{max_param_ratio:g}: {seconds:.3g} s per deletion measured at preparation"
        )
        return {"method": name, "requested": AUTO, "reason": reason, "considered": considered}
    fallback = [s for s in specs if not s.needs_preparation]
    if not fallback:
        raise MethodNotSupportedError(f"no method can take a {scope!r} scope on a {model_kind} model automatically")
    chosen = max(fallback, key=lambda spec: spec.auto_priority)
    reason = (
        f"no prepared fast method has a validated param_ratio within {max_param_ratio:g}: {chosen.name}"
        if considered
        else f"no fast method takes this model kind and scope: {chosen.name}"
    )
    return {"method": chosen.name, "requested": AUTO, "reason": reason, "considered": considered}


def exact_method(model_kind: str, scope: str) -> str:
    """The exact method (retraining without the rows) for this kind and scope: where ``auto`` escalates when the
    verdict on an approximate method fails."""
    exact = [spec for spec in available_methods(model_kind, scope) if spec.exact and not spec.needs_preparation]
    if not exact:
        raise MethodNotSupportedError(f"no exact method takes a {scope!r} scope on a {model_kind} model")
    return exact[0].name


AUTO = "auto"
"""The method name that lets the service choose (:func:`choose_method`)."""

_BUILTIN_MODULES = (
    "app.ml.unlearning.retrain",
    "app.ml.unlearning.newton",
    "app.ml.unlearning.l2ul",
    "app.ml.unlearning.baselines",
    "app.ml.unlearning.ease",
    "app.ml.unlearning.certified_removal",
)


_loaded = False


def _load_builtin_methods() -> None:
    """Import the built-in method modules once so that their ``register_method`` calls run (missing ones skipped)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise
