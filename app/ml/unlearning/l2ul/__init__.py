"""L2UL (Learning-to-UnLearn, Zhang et al. 2026) for tabular models; see method.py for the algorithm map.

Registered by reference ("module:Class") so that reading the method registry (the API does, to validate requests)
never imports torch; the names below load their modules on first use (PEP 562).
"""

import importlib

from app.ml.unlearning.base import register_method

register_method(
    "l2ul",
    "app.ml.unlearning.l2ul.method:L2ULConfig",
    "app.ml.unlearning.l2ul.method:L2UL",
    model_kinds={"tabular"},
    scopes={"samples"},
    needs_preparation=True,
    auto_priority=20,  # ``auto`` may choose it once preparation measured it within the quality bar
)

register_method(
    "l2ul_n",  # issue 10 item 3c: a learned, gated correction of the Newton step (newton_corrected.py)
    "app.ml.unlearning.l2ul.newton_corrected:L2ULNConfig",
    "app.ml.unlearning.l2ul.newton_corrected:L2ULN",
    model_kinds={"tabular"},
    scopes={"samples"},
    needs_preparation=True,
    auto_priority=15,
)

_EXPORTS = {
    "ARTIFACT_NAMES": "method",
    "L2UL": "method",
    "L2ULConfig": "method",
    "L2ULState": "method",
    "L2ULN": "newton_corrected",
    "L2ULNConfig": "newton_corrected",
    "IsolationKernel": "kernel",
    "KernelState": "kernel",
    "MetaSet": "meta",
    "generate_meta_set": "meta",
    "Unlearner": "unlearner",
    "UnlearnerConfig": "unlearner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
