from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

from app.registry.settings import (
    ClipShadowSettingsJSON,
    FederatedMethodSettings,
    FedSettingsJSON,
    LoraSettingsJSON,
    TabularMethodSettings,
    TabularRecipeIn,
    VerdictPolicySettings,
    check_clip_arch,
)
from app.validation import NoNulModel

MODEL_KINDS = ("tabular", "clip_federated")
SCOPES_BY_KIND = {"tabular": ("samples", "class"), "clip_federated": ("client", "class", "samples")}
MODEL_STATUSES = ("registering", "ready", "failed")


def _registered_methods(schema: dict[str, Any]) -> None:
    """The method names as an enum in the OpenAPI document: those registered when it is built (a method is
    registered in code, app/ml/unlearning, so a new one joins the enum without touching this file)."""
    from app.ml.unlearning.base import available_methods

    schema["enum"] = sorted(spec.name for spec in available_methods())


def _methods_and_auto(schema: dict[str, Any]) -> None:
    from app.ml.unlearning.base import AUTO

    _registered_methods(schema)
    schema["enum"] = [AUTO, *schema["enum"]]


RegisteredMethod = Annotated[str, Field(json_schema_extra=_registered_methods)]
"""A registered method's name: validated by the services (``unknown-method``), documented as an enum."""
MethodName = Annotated[str, Field(json_schema_extra=_methods_and_auto)]
"""A method a deletion may name: a registered one, or ``auto`` (the service chooses)."""


ColumnName = Annotated[str, Field(min_length=1, max_length=200)]


class DatasetRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = Field(
        None, max_length=4096, description="A CSV/Parquet file the service can read (under an allowed root)."
    )
    format: Literal["csv", "parquet"] | None = None
    row_id_column: str = Field(..., min_length=1, max_length=200)
    label_column: str = Field(..., min_length=1, max_length=200)
    subject_column: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="The column naming the data subject each row is about (per-person erasure across models). It "
        "is indexed only as keyed hashes and is never a feature.",
    )
    exclude_columns: list[ColumnName] = Field(
        default_factory=list,
        max_length=200,
        description="Columns of the table that are no feature (an identifier, free text): kept in the stored table, "
        "never encoded.",
    )
    allow_identifier_columns: list[ColumnName] = Field(
        default_factory=list,
        max_length=200,
        description="Feature columns that look like identifiers (e-mail addresses, UUIDs, a distinct value on "
        "nearly every row, a row counter) but are meant as features: registration refuses such a column unless it "
        "is listed here (`identifier-column`).",
    )


class VerificationIn(NoNulModel):
    """How deletions on this model are verified (app/ml/verification): LiRA shadows trained at registration on
    random halves of the data with the model's own recipe, and the verdict policy's settings."""

    model_config = ConfigDict(extra="forbid")
    shadows: int = Field(64, ge=4, le=512, description="Shadow models (global variance below 64, per-example above).")
    policy: VerdictPolicySettings = Field(
        default_factory=dict,
        description="VerdictPolicy settings: attack_fpr, confidence, margin, max_utility_loss_points, "
        "max_proven_distance, fail_when_uninformative.",
    )


class BatchIn(NoNulModel):
    """Batched versions: a worker taking one deletion request also takes the requests already waiting on the model
    (same method and settings, rows by id) and makes ONE version for all of them, each request judged on its own
    rows and certified on its own. No waiting for more (group commit, not a timer)."""

    model_config = ConfigDict(extra="forbid")
    max_requests: int = Field(2000, ge=1, le=10_000, description="Most requests one version serves (1: no batching).")
    max_rows: int = Field(20_000, ge=1, le=1_000_000, description="Most rows one batched version deletes.")


Tag = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._:-]{0,63}$")]
"""A model tag: lower-case letters, digits and ``._:-`` (``team:fraud``, ``prod``), at most 64 characters."""
Tags = Annotated[list[Tag], Field(max_length=16, description="Labels to filter models by (GET /v1/models?tag=).")]


class ModelCreate(NoNulModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(..., min_length=1, max_length=200)
    kind: Literal["tabular"] = "tabular"
    family: Literal["logistic_regression", "mlp"] = "logistic_regression"
    dataset: DatasetRef
    recipe: TabularRecipeIn = Field(default_factory=TabularRecipeIn)
    unlearning: list[RegisteredMethod] = Field(
        default_factory=list, max_length=16, description="Methods to prepare at registration (e.g. l2ul)."
    )
    method_settings: TabularMethodSettings = Field(default_factory=dict, description="Per method: bounded settings.")
    holdout_fraction: float = Field(0.2, ge=0.0, lt=0.9, description="Rows kept out of training, for test accuracy.")
    verification: VerificationIn = Field(default_factory=VerificationIn)
    batch: BatchIn = Field(default_factory=BatchIn)
    requires_approval: bool = Field(False, description="Every deletion request waits for an admin's approval.")
    tags: Tags = Field(default_factory=list)


class ModelPatch(NoNulModel):
    """What an admin may change on a registered model (each field optional; at least one)."""

    model_config = ConfigDict(extra="forbid")
    requires_approval: bool | None = None
    tags: Tags | None = Field(None, description="The model's new tags (replaces the old ones).")
    batch: BatchIn | None = Field(None, description="The model's batch bounds (a tabular model's next batches).")


class VersionQuality(BaseModel):
    """A tabular version's accuracy, as the worker that made it measured it (the summary of ``metrics``): on the
    held-out rows (never trained on: the registration's ``holdout_fraction``, less rows erased since), on the rows
    it was trained on (version 1) or kept (a deletion's retained rows), and on the rows a deletion erased."""

    holdout_accuracy: float | None = Field(None, description="Accuracy on the held-out rows (none held out: null).")
    holdout_rows: int = 0
    trained_accuracy: float | None = Field(None, description="Accuracy on the rows the version learnt from.")
    trained_rows: int = 0
    forget_accuracy: float | None = Field(None, description="A deletion's version: accuracy on the erased rows.")
    forget_rows: int | None = None


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
    quality: VersionQuality | None = Field(None, description="Tabular versions: accuracy per row set (a summary).")


class ModelOut(BaseModel):
    id: str
    name: str
    kind: Literal[MODEL_KINDS]  # type: ignore[valid-type]
    status: Literal[MODEL_STATUSES]  # type: ignore[valid-type]
    family: str | None
    dataset_id: str | None
    current_version: VersionOut | None
    unlearning: dict[str, Any]
    error: str | None
    created_at: datetime
    links: dict[str, str]
    federation: dict[str, Any] | None = None
    requires_approval: bool = False
    subject_column: str | None = None
    batch: dict[str, int] | None = None  # the batch bounds (tabular models; None: registered before batches)
    tags: list[str] = Field(default_factory=list)
    inputs: dict[str, Literal["number", "text"]] | None = Field(
        None,
        description="A trained tabular model's feature columns in order, each a number or text (what "
        "`POST /v1/models/{id}/predict` takes in a row).",
    )


class ModelPage(BaseModel):
    """A page of ``GET /v1/models``, newest first; pass ``next_cursor`` back as ``cursor`` for the next one."""

    items: list[ModelOut]
    next_cursor: str | None


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


ClientId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class CaptionFilesFederationIn(BaseModel):
    """A real federation from files under an allowed data root (LETHE_DATA_ROOTS): a Karpathy-layout caption file
    (``dataset_flickr30k.json``/``dataset_coco.json``: ``{"images": [{"filename", "split", "sentences": [{"raw"}],
    "imgid"?, "filepath"?}]}``), the folder its image paths are relative to, and an image → client assignment (CSV
    with the header ``image,client``, or a JSON object; ``image`` is an entry's ``imgid`` or ``filename``). Each
    client holds the pairs (one per caption) of its training images; the test split is the shared held-out set.
    Training images no client holds are left out. Checked at registration (every file, every image, every
    assignment row), decoded by the version-1 job with the backbone's own image transform."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["karpathy"]
    captions_path: str = Field(..., min_length=1, max_length=4096)
    image_root: str = Field(..., min_length=1, max_length=4096)
    assignment_path: str = Field(..., min_length=1, max_length=4096)
    clients: list[ClientId] | None = Field(
        None,
        min_length=2,
        max_length=1000,
        description="The federation's client ids, if declared: every assigned client must be one of them, and each "
        "must hold at least one training image.",
    )
    train_split: str = Field("train", min_length=1, max_length=32)
    test_split: str = Field("test", min_length=1, max_length=32)
    captions_per_image: int | None = Field(None, ge=1, le=100)
    max_test_images: int | None = Field(None, ge=1, le=100_000)


def _federation_by_kind(value: Any) -> Any:
    """Validate ``data`` against the model its ``kind`` names (``"synthetic"`` when absent), so that an error's
    location is the field's own (``data.seed``), not a union member's."""
    if isinstance(value, dict):
        schema = CaptionFilesFederationIn if value.get("kind") == "karpathy" else SyntheticFederationIn
        return schema.model_validate(value)
    return value


class ClipVerificationIn(NoNulModel):
    """How deletions on a federated CLIP model are verified: offline LiRA over a caption gallery with shadow LoRA runs
    (app/ml/verification/clip_shadows.py), trained at registration, and the verdict policy's settings."""

    model_config = ConfigDict(extra="forbid")
    shadows: ClipShadowSettingsJSON = Field(default_factory=dict, description="ClipShadowSettings fields, bounded.")
    policy: VerdictPolicySettings = Field(
        default_factory=dict,
        description="VerdictPolicy settings: attack_fpr, confidence, margin, fail_when_uninformative, "
        "max_retain_r1_drop_points (the utility check of a federated model: its retain R@1 drop below min(the "
        "original's, the exact deletion's reference runs' mean); default 5), "
        "retain_against_reference (an approximate federated deletion's retain R@1 also held to the reference runs' "
        "spread; default on).",
    )


class ClipModelCreate(NoNulModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = Field(..., min_length=1, max_length=200)
    kind: Literal["clip_federated"]
    clip: ClipSpecIn = Field(default_factory=ClipSpecIn)
    data: Annotated[SyntheticFederationIn | CaptionFilesFederationIn, BeforeValidator(_federation_by_kind)] = Field(
        default_factory=SyntheticFederationIn,
        description='The clients\' data: the generator (kind "synthetic", the default) or caption files '
        '(kind "karpathy").',
    )
    fed_settings: FedSettingsJSON = Field(
        default_factory=dict, description="app.ml.federation.FedSettings fields, bounded."
    )
    verification: ClipVerificationIn = Field(default_factory=ClipVerificationIn)
    unlearning: list[RegisteredMethod] = Field(default_factory=lambda: ["ease"], max_length=16)
    method_settings: FederatedMethodSettings = Field(default_factory=dict, description="Per method: bounded settings.")
    requires_approval: bool = Field(False, description="Every deletion request waits for an admin's approval.")
    tags: Tags = Field(default_factory=list)


class RoundAccepted(BaseModel):
    """A federated round queued for aggregation: poll the job (or the model at ``Location``)."""

    job_id: str
    model_id: str
    status: Literal["queued"]


class LivePairsOut(BaseModel):
    """A federated model's pairs that may still be trained on, by client."""

    model_id: str
    n_pairs: int
    clients: dict[str, list[str]] = Field(..., description="Client id -> the ids of its pairs still live.")


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


MAX_PREDICT_ROWS = 1000
"""Most rows one predict call takes (and fewer for a large model: rows x parameters is bounded too)."""
PREDICT_MAX_WORK = 50_000_000
"""Most rows x parameters (multiply-adds of the forward pass) one predict call may cost the API process."""

CellValue = str | int | float | bool | None


class PredictIn(NoNulModel):
    """Rows to predict, each a JSON object naming every feature column of the model (``inputs`` of
    ``GET /v1/models/{id}``): a number or null for a numeric column, text or null for a categorical one; null is a
    missing value (the encoder's rule: the training mean, or an all-zero one-hot block), as is a category the model
    never saw."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    rows: list[dict[str, CellValue]] = Field(
        ..., min_length=1, description=f"At most {MAX_PREDICT_ROWS} rows (fewer for a large model: `too-many-rows`)."
    )
    version: int | None = Field(None, ge=1, description="The version number to use; the current one when absent.")


class PredictedVersion(BaseModel):
    id: str
    number: int
    digest: str


class PredictOut(BaseModel):
    """Each row's predicted label and its class probabilities (in ``classes`` order)."""

    model_id: str
    version: PredictedVersion
    classes: list[str]
    labels: list[str]
    probabilities: list[list[float]]
