from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MODEL_KINDS = ("tabular", "clip_federated")
SCOPES_BY_KIND = {"tabular": ("samples", "class"), "clip_federated": ("client", "class", "samples")}


class TabularRecipeIn(BaseModel):
    """The training recipe (validated again by app.ml.tabular.TabularRecipe in the job)."""

    model_config = ConfigDict(extra="forbid")
    hidden_units: int = Field(10, ge=1, le=4096)
    l2: float = Field(1e-4, ge=0)
    max_iter: int = Field(500, ge=1, le=100_000)
    tol: float = Field(1e-9, gt=0)
    seed: int = 0
    solver: Literal["auto", "newton", "lbfgs"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"


class DatasetRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(None, description="A CSV/Parquet file the service can read (under an allowed root).")
    format: Literal["csv", "parquet"] | None = None
    row_id_column: str = Field(..., min_length=1, max_length=200)
    label_column: str = Field(..., min_length=1, max_length=200)


class ModelCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=200)
    kind: Literal["tabular"] = "tabular"
    family: Literal["logistic_regression", "mlp"] = "logistic_regression"
    dataset: DatasetRef
    recipe: TabularRecipeIn = Field(default_factory=TabularRecipeIn)
    unlearning: list[str] = Field(default_factory=list, description="Methods to prepare at registration (e.g. l2ul).")
    method_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)
    holdout_fraction: float = Field(0.2, ge=0.0, lt=0.9, description="Rows kept out of training, for test accuracy.")


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
    """A frozen open_clip backbone: the tiny test architecture, or a real one (ViT-B-32...) from a local checkpoint."""

    model_config = ConfigDict(extra="forbid")
    arch: str = Field("lethe-tiny-clip", min_length=1, max_length=100)
    checkpoint_path: str | None = Field(
        None,
        description="Local checkpoint (under LETHE_DATA_ROOTS); none = the "
        "tiny model pretrained on the synthetic base concepts (cached).",
    )
    lora: dict[str, Any] = Field(default_factory=dict, description="app.ml.clip.LoraSettings fields.")


class SyntheticFederationIn(BaseModel):
    """The clients' data: the seeded compositional image–caption generator (app.ml.data.captions)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["synthetic"] = "synthetic"
    seed: int = 0
    n_clients: int = Field(5, ge=3, le=64)
    pairs_per_client: int = Field(200, ge=10, le=20_000)
    n_test: int = Field(300, ge=10, le=20_000)
    regime: Literal["concepts", "membership"] = Field(
        "concepts",
        description="concepts: planted novel concepts (client/class/samples deletions); membership: one distribution "
        "with a per-pair nuisance word and a matched held-out split (EASE's non-member target for samples deletions).",
    )


class ClipModelCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=200)
    kind: Literal["clip_federated"]
    clip: ClipSpecIn = Field(default_factory=ClipSpecIn)
    data: SyntheticFederationIn = Field(default_factory=SyntheticFederationIn)
    fed_settings: dict[str, Any] = Field(default_factory=dict, description="app.ml.federation.FedSettings fields.")
    unlearning: list[str] = Field(default_factory=lambda: ["ease"])
    method_settings: dict[str, dict[str, Any]] = Field(default_factory=dict)


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
