"""What the hall (pipeline.py) and the wings (tabular.py, federated.py) hand each other for one deletion.

The hall loads a :class:`DeletionWork` (request, model, parent version, the method to run, built with its settings),
asks the model kind's wing to add its inputs and to unlearn, and receives an :class:`Unlearned` value — never a
callback. Everything a wing needs from the registry comes through app/registry/versions.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from app.jobs.lease import JobContext
from app.jobs.outbox import PermanentJobError
from app.jobs.tables import Job
from app.ml.unlearning.base import (
    AUTO,
    InvalidMethodSettingsError,
    MethodNotSupportedError,
    MethodSpec,
    UnlearningMethod,
    choose_method,
    exact_method,
    supporting_method,
)
from app.ml.verification.policy import VerdictPolicy, chance_failure_rate
from app.registry import versions as registry
from app.registry.tables import Dataset, Model, ModelVersion
from app.requests.service import rows_named
from app.requests.tables import DeletionRequest


@dataclass
class Member:
    """One request a deletion serves, with its job (held by this worker) and the rows it names (the wing's load
    fills ``positions``). A batch has several; ``refusal`` is set when the wing cannot do this request at all."""

    job: Job
    request: DeletionRequest
    positions: list[int] = field(default_factory=list)
    refusal: PermanentJobError | None = None


@dataclass
class DeletionWork:
    """One deletion, loaded: detached rows (safe outside a session) and the method that will run.

    ``members``: the requests served, the claimed job's own first (a batch: the requests that were waiting on the
    same model, app/jobs/batch.py); ``job`` and ``request`` are the first's. ``version_id`` is the id the new
    version will get, so a wing can refer to it in the model state it returns. ``inputs`` is the wing's own: what
    its ``load`` step gathered (data, masks, federation history).
    """

    members: list[Member]
    model: Model
    dataset: Dataset | None
    parent: ModelVersion
    method_name: str
    spec: MethodSpec
    method: UnlearningMethod
    version_id: str
    inputs: Any = None
    choice_note: str | None = None
    """Why the method running is not the one ``auto`` explains (a batch sent to the exact method from the start)."""

    @property
    def job(self) -> Job:
        return self.members[0].job

    @property
    def request(self) -> DeletionRequest:
        return self.members[0].request


@dataclass
class Unlearned:
    """A wing's unlearn step, as a value: the new parameters and everything publishing needs to record.

    ``positions``: the data-set rows this request deletes (they become tombstones); ``state_update``: model-state
    keys to set with the new version (e.g. the forget lock); ``method_artifacts``: the method's new prepared state
    (e.g. a learned unlearner after its purge), stored under its name.
    """

    theta: torch.Tensor
    method: str
    metrics: dict[str, Any]
    positions: list[int]
    state_update: dict[str, Any] = field(default_factory=dict)
    method_artifacts: dict[str, bytes] = field(default_factory=dict)
    parent_saw_rows: bool = True
    """False when every deleted row was held out of training: earlier versions carry no trace of them."""


@dataclass
class ErasurePlan:
    """A wing's erase step, as a value: what replaces each stored copy of the erased rows. Publishing swaps these in
    and queues every superseded blob for shredding.

    ``dataset_digest``: the stored table rewritten without the rows (None: the wing keeps no table);
    ``state_update``: model-state keys rewritten (an encoder, round files); ``purged``: each prepared method's state
    after purging the rows; ``invalidated``: methods whose state is dropped (they cannot purge), with the reason;
    ``notes``: further manifest entries (what could not be separated, say); ``dataset_chunks``: the blobs a chunked
    table's manifest lists; ``superseded``: the blobs the rewrite replaced besides the table's old digest (the
    chunks that held the rows).
    """

    dataset_digest: str | None = None
    dataset_chunks: list[str] | None = None
    superseded: list[str] = field(default_factory=list)
    state_update: dict[str, Any] = field(default_factory=dict)
    purged: dict[str, dict[str, bytes]] = field(default_factory=dict)
    invalidated: dict[str, str] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verification:
    """A wing's verify step, as a value: the report (every figure, its settings and sample sizes), the verdict with
    its checks, the plots' data (drawn on demand by the reports domain), and the figures a certificate carries."""

    report: dict[str, Any]
    verdict: dict[str, Any]
    plots: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict["verdict"] == "pass"

    def figures(self) -> dict[str, Any]:
        """What the certificate states: the verdict's checks (figure, threshold, outcome), the evidence class (the
        informative evidence that passed) with each piece's figures and power, and the membership attack's TPRs on
        the original model next to the unlearned one."""
        models = self.report.get("models") or {}
        attack = self.report.get("attack") or {}
        return {
            "checks": [
                {k: c.get(k) for k in ("name", "figure", "threshold", "passed")} for c in self.verdict["checks"]
            ],
            "evidence_class": self.verdict.get("evidence") or [],
            "evidence": [
                {k: c.get(k) for k in ("name", "figure", "threshold", "power", "informative", "passed")}
                for c in self.verdict["checks"]
                if c.get("evidence")
            ],
            "informative": self.report.get("informative"),
            "n_forget": self.report.get("n_forget"),
            "n_nonmembers": self.report.get("n_nonmembers"),
            "attack": {k: attack.get(k) for k in ("name", "mode", "n_shadows")} if attack else None,
            "lira_tpr_at_fpr": {n: m["lira"]["tpr_at_fpr"] for n, m in models.items() if "lira" in m} or None,
            "certified_removal": self.report.get("certified_removal"),
        }


class DeletionWing(Protocol):
    """A model kind's deletion steps. ``batches``: whether one version may serve several requests."""

    batches: bool

    def load(self, work: DeletionWork, ctx: JobContext) -> Any:
        """Gather the inputs (data, masks, history) for every member; PermanentJobError when the deletion cannot be
        done, or a member's ``refusal`` when one request of a batch cannot."""

    def unlearn(self, work: DeletionWork, ctx: JobContext) -> Unlearned: ...

    def verify(self, work: DeletionWork, unlearned: Unlearned, ctx: JobContext) -> dict[str, Verification]:
        """Audit the new parameters against the parent on each member's own forget rows (before they are erased):
        one verification per request id."""

    def erase(self, work: DeletionWork, unlearned: Unlearned, ctx: JobContext) -> ErasurePlan: ...

    def upkeep(self, model_id: str, ctx: JobContext) -> dict[str, Any]:
        """After the certificates, while the job still holds the model: restore capacity (never erase)."""

    def exact_in_verification(self, work: DeletionWork) -> str | None:
        """Why the verification of this deletion will train the exact deletion itself (so ``auto`` runs the exact
        method from the start: an approximate one could only add its cost and publish a weaker model), or None."""


def method_for(request: DeletionRequest, model: Model) -> tuple[str, MethodSpec, UnlearningMethod]:
    """The method this request runs (``auto`` resolved by the method registry), built with the model's registered
    settings for it, then the request's own."""
    scope = request.scope["kind"]
    try:
        name = choose_method(request.method, model.kind, scope, registry.prepared_methods(model))
        spec = supporting_method(name, model.kind, scope)
    except MethodNotSupportedError as exc:
        raise PermanentJobError(str(exc), "method-not-supported") from exc
    return name, spec, build(spec, {**model.spec.get("method_settings", {}).get(name, {}), **request.method_settings})


def exact_from_the_start(work: DeletionWork, wing: DeletionWing) -> tuple[str, MethodSpec, UnlearningMethod] | None:
    """``auto``: the exact method from the start (its reason in ``choice_note``) where the approximate pass could not
    pay — the wing's verification trains the exact deletion anyway (``exact_in_verification``: a federated model's
    audit reference, stop 48), or, for a batch, chance alone is expected to fail at least one member's attack check
    (each request is judged on its own rows, ~attack_fpr per one-row request), so the approximate pass would escalate
    the whole batch anyway (the hall's rule)."""
    escalation = escalation_for(work)
    if escalation is None:
        return None
    if (reason := wing.exact_in_verification(work)) is not None:
        work.choice_note = reason
        return escalation
    if len(work.members) < 2:
        return None
    policy = VerdictPolicy.from_dict(((work.model.spec or {}).get("verification") or {}).get("policy"))
    expected = sum(chance_failure_rate(rows_named(m.request), policy) for m in work.members)
    if expected < 1.0:
        return None
    work.choice_note = (
        f"a batch of {len(work.members)} requests, each judged on its own rows: {expected:.2g} attack-check failures "
        f"expected by chance alone (FPR {policy.attack_fpr:g}), so {escalation[0]} from the start"
    )
    return escalation


def escalation_for(work: DeletionWork) -> tuple[str, MethodSpec, UnlearningMethod] | None:
    """``auto`` only: when the verdict on an approximate method fails, the same request escalates to the exact
    method (retraining without the rows). None when the request named its method or already ran the exact one."""
    if work.request.method != AUTO or work.spec.exact:
        return None
    name = exact_method(work.model.kind, work.request.scope["kind"])
    spec = supporting_method(name, work.model.kind, work.request.scope["kind"])
    return name, spec, build(spec, work.model.spec.get("method_settings", {}).get(name, {}))


def build(spec: MethodSpec, settings: Mapping[str, Any]) -> UnlearningMethod:
    try:
        return spec.build(settings)
    except InvalidMethodSettingsError as exc:
        raise PermanentJobError(f"{spec.name}: {exc}", "invalid-method-settings") from exc


def weights(digest: str) -> torch.Tensor:
    """A stored version's parameters as a float32 CPU tensor."""
    return torch.from_numpy(registry.load_weights(digest).copy())


@dataclass
class Attempt:
    """One unlearning attempt and each request's verification of it (``auto`` may make two: the approximate method,
    then exact; a batch one more when it splits off a failing request)."""

    method: str
    unlearned: Unlearned
    verifications: dict[str, Verification]
    requests: int = 1
    """How many requests the attempt served (its batch's size then)."""
    stored_plots: dict[int, dict[str, str]] = field(default_factory=dict, repr=False)
    """Plot data already stored (by the verification's plots object): a batch's requests share one audit's plots."""

    def failing(self, members: list[Member]) -> list[Member]:
        return [m for m in members if not self.verifications[m.request.id].passed]


def batchable(leader: DeletionRequest, other: DeletionRequest) -> bool:
    """Whether two requests may share a version: rows named by id (a class deletion runs alone), the same method
    asked for with the same settings."""
    return (
        leader.scope.get("kind") == other.scope.get("kind") == "samples"
        and leader.method == other.method
        and (leader.method_settings or {}) == (other.method_settings or {})
    )
