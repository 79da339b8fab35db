"""EASE: federated multimodal unlearning by excision, subspace decomposition and a forget lock (arXiv 2605.00733).

Registers ``"ease"`` for ``clip_federated`` models in the client, class and samples scopes — by reference, so that
reading the registry does not import torch; ``Ease``, ``EaseConfig`` and ``ForgetLock`` load on first access.
"""

from __future__ import annotations

from typing import Any

from app.ml.unlearning.base import register_method

register_method(
    "ease",
    f"{__name__}.method:EaseConfig",
    f"{__name__}.method:Ease",
    model_kinds={"clip_federated"},
    scopes={"client", "class", "samples"},
    auto_priority=10,  # the federated method ``auto`` runs
)

__all__ = ["Ease", "EaseConfig", "ForgetLock"]


def __getattr__(name: str) -> Any:
    if name in ("Ease", "EaseConfig"):
        from app.ml.unlearning.ease import method

        return getattr(method, name)
    if name == "ForgetLock":
        from app.ml.federation.lock import ForgetLock

        return ForgetLock
    raise AttributeError(name)
