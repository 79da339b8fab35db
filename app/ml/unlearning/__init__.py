"""Unlearning methods behind one registry (see base.py)."""

from app.ml.unlearning.base import (
    MethodSpec,
    TabularProblem,
    UnlearningResult,
    available_methods,
    get_method,
    register_method,
)

__all__ = ["MethodSpec", "TabularProblem", "UnlearningResult", "available_methods", "get_method", "register_method"]
