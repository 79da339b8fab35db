"""Bounds for everything a registration may tune: method settings, the tabular recipe, federated training settings,
LoRA, the CLIP architecture. Checked at the API (422 naming the field) so that a bad value never first fails in a
worker, and so that no caller can size a process pool or a training run without limit.

The fields mirror the config dataclasses in app/ml (which the API may not import: they pull in torch); a unit test
(tests/unit/test_security_settings.py) fails when the two drift apart. A method without an entry here takes no
settings at registration. These tables belong with each method's ``register_method`` call; they live here until
app/ml/unlearning/base.py grows a ``settings_schema`` argument.
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

Seed = Annotated[int, Field(ge=0, le=2**32 - 1)]
Rate = Annotated[float, Field(gt=0, le=10)]
Decay = Annotated[float, Field(ge=0, le=10)]
Fraction = Annotated[float, Field(gt=0, le=1)]
Width = Annotated[int, Field(ge=1, le=4096)]


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


# ------------------------------------------------------------------ methods (app/ml/unlearning/*: the config classes)


class RetrainSettings(_Settings):
    """app.ml.unlearning.retrain.RetrainConfig: none (the recipe says how to train)."""


class L2ULSettings(_Settings):
    """app.ml.unlearning.l2ul.method.L2ULConfig."""

    psi: int = Field(4, ge=2, le=1024)
    t: int = Field(100, ge=1, le=10_000)
    m: int = Field(1000, ge=2, le=100_000)
    units: int = Field(8, ge=1, le=1024, description="Disjoint row blocks, each with its own kernel, tasks and N_U.")
    subset_size: int | None = Field(None, ge=2, le=10_000_000)
    min_forget: int = Field(1, ge=1, le=1_000_000)
    max_forget_fraction: float = Field(0.05, gt=0, lt=1)
    label_aware: bool = True
    scale_by_forget_fraction: bool = True
    hidden: tuple[Width, Width] = (64, 64)
    activation: Literal["gelu", "relu", "tanh", "silu"] = "gelu"
    linear_skip: bool = True
    epochs: int = Field(400, ge=1, le=100_000)
    lr: Rate = 1e-3
    weight_decay: Decay = 1e-4
    validation_fraction: float = Field(0.1, ge=0, lt=1)
    calibration_tasks: int = Field(8, ge=0, le=1000)
    workers: int = Field(0, ge=0, le=64, description="Process pool size; 0 = one per CPU core.")
    seed: Seed = 0


class NewtonSettings(_Settings):
    """app.ml.unlearning.newton.method.NewtonConfig (``newton`` and ``influence``; on the main branch)."""

    exact_steps: int = Field(0, ge=0, le=100)
    purge: Literal["deferred", "recompute", "downdate"] = Field(
        "deferred",
        description="deferred: the erased rows' terms removed on the request's path, the Hessian recomputed at the "
        "new model in the upkeep after the certificate; recompute: recomputed on the path; downdate: never "
        "recomputed (the stored Hessian stays at an earlier model that trained on the erased rows).",
    )
    exact_hessian_max_params: int = Field(2048, ge=0, le=8192, description="A dense p x p float64 Hessian.")
    gauss_newton_damping: float = Field(1e-2, ge=0, le=1e6)
    certify: bool = Field(
        False,
        description="Also compute the proven bound inside the step. The verify step computes it at the published "
        "parameters anyway (its proven_distance evidence), so on by request only (it doubled the cost).",
    )


class L2ULNSettings(_Settings):
    """app.ml.unlearning.l2ul.newton_corrected.L2ULNConfig (L2UL-N: a gated correction of the Newton step)."""

    m: int = Field(400, ge=2, le=100_000)
    units: int = Field(8, ge=1, le=1024)
    subset_size: int | None = Field(None, ge=2, le=10_000_000)
    min_forget: int = Field(1, ge=1, le=1_000_000)
    max_forget_fraction: float = Field(0.05, gt=0, lt=1)
    hidden: tuple[Width, Width] = (64, 64)
    epochs: int = Field(200, ge=1, le=100_000)
    lr: Rate = 1e-3
    weight_decay: Decay = 1e-4
    calibration_tasks: int = Field(6, ge=0, le=1000)
    newton: NewtonSettings = Field(
        default_factory=lambda: NewtonSettings(purge="recompute"),
        description="The Newton step's settings; purge recompute (default) or downdate, never deferred.",
    )
    workers: int = Field(0, ge=0, le=64, description="Process pool size; 0 = one per CPU core.")
    seed: Seed = 0

    @model_validator(mode="after")
    def _no_deferred_purge(self) -> L2ULNSettings:
        if self.newton.purge == "deferred" and "purge" in self.newton.model_fields_set:
            raise ValueError("newton.purge 'deferred' is not for l2ul_n (nothing completes it): recompute or downdate")
        return self


class SISASettings(_Settings):
    """app.ml.unlearning.baselines.sisa.SISAConfig."""

    shards: int = Field(5, ge=1, le=1000)
    slices: int = Field(4, ge=1, le=1000)
    seed: Seed = 0


class CertifiedRemovalSettings(_Settings):
    """app.ml.unlearning.certified.CertifiedRemovalConfig: the (ε, δ) of Guo et al.'s Theorem 3 and the residual
    budget ε′ (sum-form gradient norm) each version may spend before an exact retrain with fresh noise."""

    epsilon: float = Field(1.0, gt=0, le=100)
    delta: float = Field(1e-4, gt=0, lt=1)
    residual_budget: float = Field(2.28, gt=0, le=1e12)


class FedRetrainSettings(_Settings):
    """app.ml.unlearning.baselines.fed_retrain.FedRetrainConfig."""

    rounds: int | None = Field(None, ge=1, le=10_000)


class FedOSDSettings(_Settings):
    """app.ml.unlearning.baselines.fedosd.FedOSDConfig."""

    rounds: int = Field(5, ge=1, le=10_000)
    lr: Rate = 0.5
    post_rounds: int = Field(1, ge=0, le=10_000)
    batch_size: int = Field(64, ge=1, le=65_536)


class GradientAscentSettings(_Settings):
    """app.ml.unlearning.baselines.gradient_ascent.GradientAscentConfig."""

    steps: int = Field(20, ge=1, le=100_000)
    lr: Rate = 2e-3
    batch_size: int = Field(64, ge=1, le=65_536)
    radius_fraction: Fraction = 1 / 3
    post_rounds: int = Field(2, ge=0, le=10_000)
    seed: Seed = 0


class FedEraserSettings(_Settings):
    """app.ml.unlearning.baselines.federaser.FedEraserConfig."""

    interval: int = Field(2, ge=1, le=10_000)
    calibration_ratio: Fraction = 0.5


class EaseSettings(_Settings):
    """app.ml.unlearning.ease.method.EaseConfig."""

    tau: Fraction = 0.95
    tau_retain: Fraction = 0.99
    delta_deg: float = Field(65.0, ge=0, le=90)
    max_rank: int | None = Field(None, ge=1, le=100_000)
    history_rounds: int | None = Field(None, ge=1, le=10_000)
    replay_points: int = Field(2, ge=1, le=1000)
    replay_max_pairs: int | None = Field(64, ge=1, le=1_000_000)
    gsd: Literal["exclusive", "whole", "none"] = "exclusive"
    gsd_blocks: Literal["tensor", "flat"] = "flat"
    gsd_space: Literal["gradient", "mixed"] = "mixed"
    theta_ref: Literal["forget_contribution", "init", "zero"] = "init"
    excision_steps: int = Field(6, ge=0, le=100_000)
    excision_lr: Rate = 1e-2
    excision_batch: int = Field(64, ge=1, le=65_536)
    excision_objective: Literal["uce", "hinge", "reference"] = "reference"
    excision_optimizer: Literal["sgd", "adam"] = "sgd"
    excision_margin: float = Field(-0.75, ge=-100, le=100)
    excision_reference: Literal["version_1", "concept_masked"] = "version_1"
    excision_towers: list[Literal["image", "text"]] = Field(default_factory=lambda: ["image", "text"], min_length=1)
    excision_subspace: Literal["none", "exclusive", "off_retain"] = "none"
    anchor_weight: float = Field(1.0, ge=0, le=1e6)
    retain_negatives: bool = True
    strength: Literal["adaptive", "fixed"] = "adaptive"
    excision_scale: float = Field(1.0, gt=0, le=1e3)
    excision_norm: float | None = Field(None, gt=0, le=1e9)
    target: Literal["auto", "reference", "nonmember"] = "auto"
    target_band: float = Field(3.0, gt=0, le=100)
    max_probes: int = Field(5, ge=1, le=32)
    scale_max: float = Field(16.0, gt=0, le=1e3)
    lock_alpha: float = Field(0.0, ge=0, le=1e9)
    repair_rounds: int = Field(1, ge=0, le=1000)
    repair_at_scale: bool = False
    rescale_probes: int = Field(2, ge=1, le=32)
    repair_epochs: float | None = Field(None, gt=0, le=1000)
    lock_excision: bool = True
    lock_gsd: bool = True
    replay_gsd: Literal["exclusive", "whole", "none"] = "whole"
    memorisation_excision_steps: int = Field(20, ge=0, le=100_000)
    memorisation_excision_lr: Rate = 0.03
    memorisation_repair_rounds: int = Field(3, ge=0, le=1000)
    class_repair_rounds: int | None = Field(None, ge=0, le=1000)
    client_excision: Literal["stored_updates", "bke"] = "stored_updates"
    holder_excision: Literal["auto", "bke", "stored_updates", "replayed_share"] = "auto"
    share_points: int | None = Field(None, ge=1, le=10_000)
    leaving_client: Literal["online", "offline"] = "online"
    offline_scale: float = Field(0.5, ge=0, le=1e3)
    offline_repair_rounds: int = Field(2, ge=0, le=1000)
    holder_repair_rounds: int | None = Field(3, ge=0, le=1000)
    seed: Seed = 0


NOT_ON_THE_API: dict[str, frozenset[str]] = {"ease": frozenset({"target_r1"})}
"""Config fields a model registration may not set. EASE's ``target_r1`` (an explicit level for the strength search)
is the benchmark's oracle: pinned for every deletion of a model it predicts nothing, and set high it lets the
search stop near scale 0 — an excision that does almost nothing, reported as done."""

METHOD_SETTINGS: dict[str, type[_Settings]] = {
    "retrain": RetrainSettings,
    "l2ul": L2ULSettings,
    "l2ul_n": L2ULNSettings,
    "newton": NewtonSettings,
    "influence": NewtonSettings,
    "sisa": SISASettings,
    "certified_removal": CertifiedRemovalSettings,
    "fed_retrain": FedRetrainSettings,
    "fedosd": FedOSDSettings,
    "fed_gradient_ascent": GradientAscentSettings,
    "federaser": FedEraserSettings,
    "ease": EaseSettings,
}
"""Method name → the bounds of its settings."""


class TabularMethodSettingsIn(_Settings):
    """Per-method settings of a tabular model (methods for other kinds, or unknown ones, are refused)."""

    retrain: RetrainSettings | None = None
    l2ul: L2ULSettings | None = None
    l2ul_n: L2ULNSettings | None = None
    newton: NewtonSettings | None = None
    influence: NewtonSettings | None = None
    sisa: SISASettings | None = None
    certified_removal: CertifiedRemovalSettings | None = None


class FederatedMethodSettingsIn(_Settings):
    """Per-method settings of a federated CLIP model."""

    ease: EaseSettings | None = None
    fed_retrain: FedRetrainSettings | None = None
    fedosd: FedOSDSettings | None = None
    fed_gradient_ascent: GradientAscentSettings | None = None
    federaser: FedEraserSettings | None = None


def _checked(model: type[BaseModel]):
    """Validate a JSON object against ``model``; keep what was given (the dataclass defaults stay the source of
    truth), normalised to JSON types. Errors carry the field's location."""

    def check(value: Any) -> Any:
        if value is None:
            return {}
        return model.model_validate(value).model_dump(mode="json", exclude_unset=True)

    return BeforeValidator(check)


class VerdictPolicyIn(_Settings):
    """app.ml.verification.policy.VerdictPolicy: checked at registration, so a bad policy is a 422 at the door
    rather than a failed job at the first verdict."""

    attack_fpr: float = Field(0.01, gt=0, lt=1)
    confidence: float = Field(0.95, ge=0.5, lt=1)
    margin: Literal["rank", "binomial"] = "rank"
    max_utility_loss_points: float | None = Field(1.0, ge=0, le=100)
    max_proven_distance: float | None = Field(None, ge=0, le=1e9)
    unchanged_atol: float = Field(1e-12, ge=0, le=1)
    fail_when_uninformative: bool = False
    max_retain_r1_drop_points: float = Field(
        5.0,
        ge=0,
        le=100,
        description="Federated models: the most retain R@1 (points) an approximate deletion may lose below min(the "
        "original's, the exact deletion's: its reference runs' mean).",
    )
    max_residual_ratio: float = Field(
        0.1, gt=0, lt=1, description="An approximate method may keep at most this share of doing nothing's distance."
    )
    require_informative_evidence: bool = Field(
        True, description="No certificate without informative evidence that passed (README, 'What certified means')."
    )
    retain_against_reference: bool = Field(
        True,
        description="Federated models: an approximate deletion's retain R@1 must also lie within retraining's own "
        "spread of the deletion's reference runs (README, 'Federated CLIP verification').",
    )


VerdictPolicySettings = Annotated[dict[str, Any], _checked(VerdictPolicyIn)]
TabularMethodSettings = Annotated[dict[str, dict[str, Any]], _checked(TabularMethodSettingsIn)]
FederatedMethodSettings = Annotated[dict[str, dict[str, Any]], _checked(FederatedMethodSettingsIn)]


# ---------------------------------------------------- federated training and LoRA (app/ml/federation.py, clip.py)


class FedSettingsIn(_Settings):
    """app.ml.federation.FedSettings."""

    rounds: int = Field(20, ge=1, le=10_000)
    local_epochs: float = Field(1.0, gt=0, le=1000)
    batch_size: int = Field(50, ge=1, le=65_536)
    lr: Rate = 3e-3
    weight_decay: Decay = 0.0
    seed: Seed = 0


ModuleName = Annotated[str, Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.]+$")]


class LoraSettingsIn(_Settings):
    """app.ml.clip.LoraSettings."""

    rank: int = Field(4, ge=1, le=512)
    alpha: float = Field(8.0, gt=0, le=1e6)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[ModuleName, ...] = Field(("attn", "c_fc", "c_proj"), min_length=1, max_length=32)
    init_seed: Seed = 0


FedSettingsJSON = Annotated[dict[str, Any], _checked(FedSettingsIn)]
LoraSettingsJSON = Annotated[dict[str, Any], _checked(LoraSettingsIn)]


class ClipShadowSettingsIn(_Settings):
    """app.ml.verification.clip_shadows.ClipShadowSettings: the runs of a federated deletion's audit reference (each a
    full federated training run on what remains, trained for every deletion; none at registration since stop 48)."""

    n_shadows: int = Field(
        4, ge=4, le=64, description="Shadow runs; 4 leaves every pair two OUT shadows at keep_fraction 0.5."
    )
    keep_fraction: float = Field(0.5, ge=0.05, le=0.5, description="Share of the pairs each shadow trains on.")
    seed: Seed = 0
    rounds: int | None = Field(
        None, ge=1, le=10_000, description="FedAvg rounds per run; none = as many as the model has trained."
    )


ClipShadowSettingsJSON = Annotated[dict[str, Any], _checked(ClipShadowSettingsIn)]


# ------------------------------------------------------------------ CLIP architectures

TINY_ARCH = "lethe-tiny-clip"
_ARCH_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$")


@lru_cache
def allowed_clip_archs() -> frozenset[str]:
    """The built-in tiny config, the repository's configs (app/ml/clip_configs) and open_clip's named architectures
    (its model_configs folder, found without importing open_clip: the API never loads torch). No ``hf-hub:`` or
    ``local-dir:`` names: those download or read arbitrary code and weights."""
    names = {TINY_ARCH}
    names |= {p.stem for p in (Path(__file__).resolve().parents[1] / "ml" / "clip_configs").glob("*.json")}
    spec = importlib.util.find_spec("open_clip")
    for location in (spec.submodule_search_locations or []) if spec else []:
        names |= {p.stem for p in (Path(location) / "model_configs").glob("*.json")}
    return frozenset(n for n in names if _ARCH_NAME.match(n))


def check_clip_arch(value: Any) -> Any:
    if isinstance(value, str) and (not _ARCH_NAME.match(value) or value not in allowed_clip_archs()):
        if ":" in value or "/" in value:
            raise ValueError("hub and local-directory architectures (hf-hub:, local-dir:) are not allowed")
        raise ValueError(
            f"unknown architecture {value!r}; use {TINY_ARCH!r} or an open_clip architecture name (ViT-B-32, ...)"
        )
    return value


# ---------------------------------------------------- the tabular recipe (app/ml/tabular.py TabularRecipe)


class TabularRecipeIn(_Settings):
    """The training recipe (validated again by app.ml.tabular.TabularRecipe in the job)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    hidden_units: int = Field(10, ge=1, le=4096)
    l2: float | None = Field(
        None,
        ge=0,
        le=1e6,
        description="L2 weight; none = the family's default (1e-4 for logistic regression, 1e-2 for the MLP, whose "
        "retraining is chaotic below that: see app.ml.tabular.DEFAULT_L2).",
    )
    max_iter: int = Field(500, ge=1, le=100_000)
    tol: float = Field(1e-9, gt=0, le=1)
    seed: Seed = 0
    solver: Literal["auto", "newton", "lbfgs"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
