from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from app.registry.settings import (
    ClipShadowSettingsJSON,
    FederatedMethodSettings,
    FedSettingsJSON,
    LoraSettingsJSON,
    TabularMethodSettings,
    TabularRecipeIn,
    check_clip_arch,
)
from app.validation import NoNulModel

MODEL_KINDS = ("tabular", "clip_federated")
SCOPES_BY_KIND = {"tabular": ("samples", "class"), "clip_federated": ("client", "class", "samples")}


class DatasetRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(
        None, max_length=4096, description="A CSV/Parquet file the service can read (under an allowed root)."
    )
    format: Literal["csv", "parquet"] | None = None
    row_id_column: str = Field(..., min_length=1, max_length=200)
    label_column: str = Field(..., min_length=1, max_length=200)


class VerificationIn(NoNulModel):
    """How deletions on this model are verified (app/ml/verification): LiRA shadows trained at registration on
    random halves of the data with the model's own recipe, and the verdict policy's settings."""

    model_config = ConfigDict(extra="forbid")
    shadows: int = Field(64, ge=4, le=512, description="Shadow models (global variance below 64, per-example above).")
    policy: dict[str, Any] = Field(
        default_factory=dict,
        description="VerdictPolicy settings: attack_fpr, confidence, margin, max_utility_loss_points, "
        "max_proven_distance, fail_when_uninformative.",
    )


class ModelCreate(NoNulModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(..., min_length=1, max_length=200)
    kind: Literal["tabular"] = "tabular"
    family: Literal["logistic_regression", "mlp"] = "logistic_regression"
    dataset: DatasetRef
    recipe: TabularRecipeIn = Field(default_factory=TabularRecipeIn)
    unlearning: list[str] = Field(
        default_factory=list, max_length=16, description="Methods to prepare at registration (e.g. l2ul)."
    )
    method_settings: TabularMethodSettings = Field(default_factory=dict, description="Per method: bounded settings.")
    holdout_fraction: float = Field(0.2, ge=0.0, lt=0.9, description="Rows kept out of training, for test accuracy.")
    verification: VerificationIn = Field(default_factory=VerificationIn)


class VersionOut(BaseModel):
    id: str
    number: int
    parent_id: str | None
    digest: str
    method: str
    request_id: str | None
    metrics: dict[str, Any]
    created_at: datetime
    retired_at: datetime | None = None  # trained on rows since erased: weights answer 410, blob shredded
    retired_by: str | None = None


class ModelOut(BaseModel):
    id: str
    name: str
    kind: str
    status: str
    family: str | None
    dataset_id: str | None
    current_version: VersionOut | None
    unlearning: dict[str, Any]
    error: str | None
    created_at: datetime
    links: dict[str, str]
    federation: dict[str, Any] | None = None


class ClipSpecIn(BaseModel):
    """A frozen open_clip backbone: the tiny test architecture, or a real one (ViT-B-32...) from a local checkpoint.

    ``arch`` is an allowlist: the tiny config, the repository's configs and open_clip's named architectures; no
    ``hf-hub:``/``local-dir:`` names (they would download or load arbitrary weights and code)."""

    model_config = ConfigDict(extra="forbid")
    arch: Annotated[str, AfterValidator(check_clip_arch)] = Field("lethe-tiny-clip", min_length=1, max_length=100)
    checkpoint_path: str | None = Field(
        None,
        max_length=4096,
        description="Local checkpoint (under LETHE_DATA_ROOTS); none = the "
        "tiny model pretrained on the synthetic base concepts (cached).",
    )
    lora: LoraSettingsJSON = Field(default_factory=dict, description="app.ml.clip.LoraSettings fields, bounded.")


class SyntheticFederationIn(BaseModel):
    """The clients' data: the seeded compositional image–caption generator (app.ml.data.captions)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["synthetic"] = "synthetic"
    seed: int = Field(0, ge=0, le=2**32 - 1)
    n_clients: int = Field(5, ge=3, le=64)
    pairs_per_client: int = Field(200, ge=10, le=20_000)
    n_test: int = Field(300, ge=10, le=20_000)
    regime: Literal["concepts", "membership"] = Field(
        "concepts",
        description="concepts: planted novel concepts (client/class/samples deletions); membership: one distribution "
        "with a per-pair nuisance word and a matched held-out split (EASE's non-member target for samples deletions).",
    )


class ClipVerificationIn(NoNulModel):
    """How deletions on a federated CLIP model are verified: offline LiRA over a caption gallery with shadow LoRA runs
    (app/ml/verification/clip_shadows.py), trained at registration, and the verdict policy's settings."""

    model_config = ConfigDict(extra="forbid")
    shadows: ClipShadowSettingsJSON = Field(default_factory=dict, description="ClipShadowSettings fields, bounded.")
    policy: dict[str, Any] = Field(
        default_factory=dict,
        description="VerdictPolicy settings: attack_fpr, confidence, margin, fail_when_uninformative (the utility "
        "check of a federated model is its retain R@1 drop).",
    )


class ClipModelCreate(NoNulModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(..., min_length=1, max_length=200)
    kind: Literal["clip_federated"]
    clip: ClipSpecIn = Field(default_factory=ClipSpecIn)
    data: SyntheticFederationIn = Field(default_factory=SyntheticFederationIn)
    fed_settings: FedSettingsJSON = Field(
        default_factory=dict, description="app.ml.federation.FedSettings fields, bounded."
    )
    verification: ClipVerificationIn = Field(default_factory=ClipVerificationIn)
    unlearning: list[str] = Field(default_factory=lambda: ["ease"], max_length=16)
    method_settings: FederatedMethodSettings = Field(default_factory=dict, description="Per method: bounded settings.")


class ForgetLockOut(BaseModel):
    """What federated clients need to keep forgotten knowledge out of later rounds (EASE's Projection with Forget
    Lock): add ``alpha * ||U_mu^T (theta - theta_unl)||^2`` to the local loss; the server projects aggregated updates
    off U_mu before applying them. The tensors are at ``links.tensors`` (safetensors: basis [p, k], theta_unl [p])."""

    model_id: str
    request_id: str
    version_id: str
    alpha: float
    rank: int
    n_params: int
    digest: str
    links: dict[str, str]
