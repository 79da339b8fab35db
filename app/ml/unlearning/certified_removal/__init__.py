"""``certified_removal``: Guo et al.'s (2020) (ε, δ)-certified removal for L2 logistic regression as a method the
service runs (issue 20, item 3). The mathematics is app/ml/unlearning/certified.py; method.py is its state and steps.

Registered by reference so the API reads the registry without importing torch. Opt-in by name only (never ``auto``).
"""

from app.ml.unlearning.base import register_method

register_method(
    "certified_removal",
    "app.ml.unlearning.certified:CertifiedRemovalConfig",
    "app.ml.unlearning.certified_removal.method:CertifiedRemoval",
    model_kinds={"tabular"},
    scopes={"samples"},
    needs_preparation=True,
)
