"""The hall: what a worker does with a job (ARCHITECTURE.md, "worker"). Read a deletion top to bottom in
:func:`run_deletion`; each model kind's own steps live in its wing (tabular.py, federated.py).

Every step is idempotent. Weights are content-addressed (a re-run writes the same blob), a version is unique per job,
and the publishing transaction checks that this worker still holds the lease, so a worker that lost it writes nothing.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from functools import partial

import structlog

from app.config import get_settings
from app.db import new_id, session_scope
from app.jobs import blobs, faults, federated, lease, tabular
from app.jobs.lease import JobContext
from app.jobs.outbox import LeaseLostError, PermanentJobError, infrastructure_error, max_runtime
from app.jobs.publish import publish, reject, split_off
from app.jobs.tables import Job
from app.jobs.work import (
    Attempt,
    DeletionWing,
    DeletionWork,
    Member,
    Unlearned,
    batchable,
    escalation_for,
    exact_from_the_start,
    method_for,
)
from app.registry import versions as registry
from app.requests import service as requests

log = logging.getLogger("lethe.pipeline")

Handler = Callable[[Job, JobContext], None]


def execute_job(job_id: str, owner: str) -> str:
    """Entry point for Celery tasks and the in-process executor. Returns the job's final status. Every log line
    written meanwhile (in this thread) carries the job's id and, for a deletion, the deletion request's id."""
    with structlog.contextvars.bound_contextvars(job_id=job_id):
        return _execute_job(job_id, owner)


def _execute_job(job_id: str, owner: str) -> str:
    job = lease.claim(job_id, owner)
    if job is None:
        log.debug("job %s not claimable (done, taken, waiting on its model, or out of attempts)", job_id)
        return "skipped"
    ids = {"job_kind": job.kind, "model_id": job.model_id}
    if job.request_id:
        ids["deletion_request_id"] = job.request_id
    with structlog.contextvars.bound_contextvars(**ids):
        return _run_claimed(job, job_id, owner)


def _run_claimed(job: Job, job_id: str, owner: str) -> str:
    """Run the handler, every blob it writes first named as this attempt's intent; whatever the outcome, the blobs
    it wrote that nothing references afterwards (it failed, was rejected, lost its lease) are shredded."""
    try:
        with blobs.recording(job_id, owner):
            return _run_handler(job, job_id, owner)
    finally:
        try:
            blobs.settle(owner)
        except Exception:  # the reconciler settles an attempt's intents its worker could not
            log.exception("job %s: shredding the blobs of its attempt failed; the reconciler retries", job_id)


def _run_handler(job: Job, job_id: str, owner: str) -> str:
    ctx = JobContext(job_id, owner, max_seconds=max_runtime(job.kind), request_id=job.request_id)
    try:
        with session_scope() as session:
            model_kind = registry.model_kind(session, job.model_id)
        handler = HANDLERS.get((job.kind, model_kind))
        if handler is None:
            raise PermanentJobError(f"no handler for a {job.kind!r} job on a {model_kind!r} model", "unprocessable")
        with ctx:
            handler(job, ctx)
        return "succeeded"
    except LeaseLostError:
        log.warning("job %s: lease lost to another worker; stopping without writing", job_id)
        return "lease-lost"
    except PermanentJobError as exc:
        if len(ctx.members) > 1:  # a batch never rejects a request for what may be another's fault: each runs alone
            lease.release(ctx.members, owner, f"a batch could not be done as a whole ({exc}); retried alone")
            return "split"
        lease.fail(job_id, owner, str(exc), permanent=True, request_status="rejected", problem_type=exc.problem_type)
        return "rejected"
    except Exception as exc:
        infrastructure = infrastructure_error(exc)  # a full disk, the database away: waits, spends no attempt
        log.log(logging.WARNING if infrastructure else logging.ERROR, "job %s failed", job_id, exc_info=True)
        error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"
        for member in ctx.members:
            lease.fail(member, owner, error, permanent=False, infrastructure=infrastructure)
        return "waiting" if infrastructure else "failed"


def run_deletion(job: Job, ctx: JobContext, wing: DeletionWing) -> None:
    """claim (execute_job) → join the requests waiting on the model (a batch) → load → unlearn → store → verify each
    request on its own rows → (a request failed: ``auto`` escalates the batch once to the exact method; a named
    method's failing requests are split off to run alone and the rest is served again without them) → erase →
    publish, each request with its own certificate →
    upkeep (capacity the erasure used up, restored after the certificates; it yields to a waiting deletion once the
    pool meets its minimum)."""
    if already_certified(job):  # the worker died after the certificates: only the upkeep was left
        return upkeep(job.model_id, ctx, wing, {"resumed": "upkeep"})
    work = load(job, ctx, wing)
    attempts: list[Attempt] = []
    while work.members:
        faults.point("unlearn")
        unlearned = wing.unlearn(work, ctx)
        draft = store_version(work, unlearned)
        faults.point("verify")
        verifications = verify(work, unlearned, ctx, attempt=len(attempts) + 1, wing=wing)
        attempts.append(Attempt(work.method_name, unlearned, verifications, len(work.members)))
        failing = attempts[-1].failing(work.members)
        if not failing:
            faults.point("erase")
            erasure = wing.erase(work, unlearned, ctx)
            faults.point("publish")
            result = publish(work, attempts, draft, erasure, ctx)
            return upkeep(work.model.id, ctx, wing, result)
        blobs.settle(ctx.owner)  # the failed attempt's weights (or lock) will never be published
        escalation = escalation_for(work)  # auto: one failing request escalates its whole batch (exact for all)
        if escalation is not None:
            work.method_name, work.spec, work.method = escalation
        elif len(work.members) == 1:
            return reject(work, attempts, ctx)
        else:
            split_off(work, failing, attempts, ctx)
            work.inputs = wing.load(work, ctx)
        work.version_id = new_id()


def load(job: Job, ctx: JobContext, wing: DeletionWing) -> DeletionWork:
    """The request, the model and the version it deletes from, the method to run, the requests that join it; then
    the wing's own inputs. A member the wing refuses ends rejected alone."""
    with session_scope() as session:
        request = requests.get_request_or_404(session, job.request_id)
        session.expunge(request)
        model, dataset, parent = registry.load_model(session, job.model_id)
    name, spec, method = method_for(request, model)
    members = [Member(job, request), *join(job, request, model, ctx, wing)]
    batch = f" for {len(members)} requests" if len(members) > 1 else ""
    ctx.progress(0.05, f"loading data and version {parent.number}{batch}")
    work = DeletionWork(members, model, dataset, parent, name, spec, method, new_id())
    if (exact := exact_from_the_start(work, wing)) is not None:  # auto, where an approximate pass cannot pay
        work.method_name, work.spec, work.method = exact
    work.inputs = wing.load(work, ctx)
    if any(m.refusal for m in work.members):
        refuse(work, ctx)
        work.inputs = wing.load(work, ctx) if work.members else None
    return work


def join(job: Job, request, model, ctx: JobContext, wing: DeletionWing) -> list[Member]:
    """Group commit: the deletion requests already waiting on this model that can share the version (same method and
    settings, rows by id), within the model's batch bounds. Never waits for more; never joins a request that a batch
    gave back to run alone."""
    if not wing.batches or (job.payload or {}).get("solo"):
        return []
    max_requests, max_rows = batch_bounds(model)
    joined = lease.claim_waiting(
        job, ctx.owner, partial(batchable, request), max_requests, max_rows, requests.rows_named(request)
    )
    ctx.join([j for j, _ in joined])
    return [Member(j, r) for j, r in joined]


def refuse(work: DeletionWork, ctx: JobContext) -> None:
    """Members the wing cannot serve (their rows were erased meanwhile, say): rejected each on its own, as a request
    alone would be; a request served alone raises (the job is rejected)."""
    refused = [m for m in work.members if m.refusal]
    if len(work.members) == 1:
        raise refused[0].refusal
    with ctx.finishing():  # the heartbeat waits: it must not renew a job that is no longer ours
        for member in refused:
            ctx.leave(member.job.id)
            work.members.remove(member)
            exc = member.refusal
            lease.fail(member.job.id, ctx.owner, str(exc), permanent=True, request_status="rejected",
                       problem_type=exc.problem_type)  # fmt: skip


def store_version(work: DeletionWork, unlearned: Unlearned) -> registry.VersionDraft:
    """Write the new parameters to the artifact store; the version row is written when it is published."""
    return registry.child_draft(
        work.parent,
        id=work.version_id,
        digest=registry.put_weights(unlearned.theta),
        method=unlearned.method,
        job_id=work.job.id,
        request_id=work.request.id,
        metrics={**unlearned.metrics, "requests": [m.request.id for m in work.members]},  # a batch: all it serves
    )


def verify(work: DeletionWork, unlearned: Unlearned, ctx: JobContext, attempt: int, wing: DeletionWing):
    """The wing audits the new parameters on each request's own forget rows (not erased yet); nothing is published."""
    with session_scope() as session:
        requests.mark_verifying(session, [m.request.id for m in work.members], unlearned.method, attempt)
    ctx.progress(0.9, f"verifying {unlearned.method} (attempt {attempt})")
    return wing.verify(work, unlearned, ctx)


def batch_bounds(model) -> tuple[int, int]:
    """A batch's most requests and rows: the model's registration (``batch``) within the service's defaults."""
    settings, own = get_settings(), (model.spec or {}).get("batch") or {}
    return (
        min(int(own.get("max_requests", settings.batch_max_requests)), settings.batch_max_requests),
        min(int(own.get("max_rows", settings.batch_max_rows)), settings.batch_max_rows),
    )


def already_certified(job: Job) -> bool:
    with session_scope() as session:
        return requests.get_request_or_404(session, job.request_id).status == "certified"


def upkeep(model_id: str, ctx: JobContext, wing: DeletionWing, result: dict) -> None:
    """After the certificates: the wing restores what the erasure used up (verification shadows that were copies of
    the rows), off the requests' path, while this job still holds the model (nothing is erased meanwhile): fully
    when the model is idle, only up to the pool's minimum when a deletion waits (the next batch's upkeep goes on
    with it); then the job is finished and due blobs are shredded."""
    counts = wing.upkeep(model_id, ctx)
    lease.finish(ctx.members[0], ctx.owner, {**result, "upkeep": counts})
    faults.point("shred")
    shred()


def shred() -> None:
    """Delete the queued blobs whose grace period has passed (the dispatcher's tick does the same for later ones)."""
    with session_scope() as session:
        registry.shred_due(session)


HANDLERS: dict[tuple[str, str], Handler] = {
    # (job kind, model kind) → handler; a new model kind adds its wing and its lines here
    ("train_model", "tabular"): tabular.train,
    ("deletion", "tabular"): partial(run_deletion, wing=tabular.Deletion()),
    ("train_model", "clip_federated"): federated.train,
    ("aggregate_round", "clip_federated"): federated.aggregate_round,
    ("deletion", "clip_federated"): partial(run_deletion, wing=federated.Deletion()),
}
