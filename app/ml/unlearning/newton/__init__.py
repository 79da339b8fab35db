"""Newton and influence-function removal for tabular models (the removal step of Guo et al. 2020, §3). Without the
objective perturbation of their Theorem 3 this step carries no (ε, δ) guarantee: it is NOT certified removal (that
is app/ml/unlearning/certified.py); a deletion by it is certified only by its evidence (verification/evidence.py).

Registered by reference ("module:Class") so that reading the method registry (the API does, to validate requests)
never imports torch; the names below load their modules on first use (PEP 562). See method.py for the algorithm,
its stored state and the purge; probe.py for the determinism probe; app/ml/verification/bounds.py for the proven
distance bound.
"""

import importlib

from app.ml.unlearning.base import register_method

# ``auto`` may choose either once its preparation measured it within the quality bar (base.explain_choice); the
# priorities only break a tie in measured speed.
for _name, _cls, _priority in (("newton", "NewtonUnlearning", 30), ("influence", "InfluenceUnlearning", 25)):
    register_method(
        _name,
        "app.ml.unlearning.newton.method:NewtonConfig",
        f"app.ml.unlearning.newton.method:{_cls}",
        model_kinds={"tabular"},
        scopes={"samples", "class"},
        needs_preparation=True,
        auto_priority=_priority,
    )

_EXPORTS = {
    "ARTIFACT_STATE": "method",
    "NewtonConfig": "method",
    "NewtonState": "method",
    "NewtonUnlearning": "method",
    "InfluenceUnlearning": "method",
    "determinism_probe": "probe",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
