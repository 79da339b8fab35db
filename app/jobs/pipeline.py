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

from app.config import get_settings
from app.db import new_id, release_freed_pages, session_scope
from app.jobs import federated, lease, outbox, tabular
from app.jobs.lease import JobContext
from app.jobs.outbox import LeaseLostError, PermanentJobError
from app.jobs.tables import Job
from app.jobs.work import DeletionWing, DeletionWork, ErasurePlan, Unlearned, method_for
from app.registry import versions as registry
from app.requests import service as requests
from app.webhooks.service import deliver_webhook

log = logging.getLogger("lethe.pipeline")

Handler = Callable[[Job, JobContext], None]


def execute_job(job_id: str, owner: str) -> str:
    """Entry point for Celery tasks and the in-process executor. Returns the job's final status."""
    job = lease.claim(job_id, owner)
    if job is None:
        log.info("job %s not claimable (done, taken, or out of attempts)", job_id)
        return "skipped"
    try:
        with session_scope() as session:
            model_kind = registry.model_kind(session, job.model_id)
        handler = HANDLERS.get((job.kind, model_kind))
        if handler is None:
            raise PermanentJobError(f"no handler for a {job.kind!r} job on a {model_kind!r} model", "unprocessable")
        with JobContext(job_id, owner) as ctx:
            handler(job, ctx)
        return "succeeded"
    except LeaseLostError:
        log.warning("job %s: lease lost to another worker; stopping without writing", job_id)
        return "lease-lost"
    except PermanentJobError as exc:
        lease.fail(job_id, owner, str(exc), permanent=True, request_status="rejected", problem_type=exc.problem_type)
        return "rejected"
    except Exception as exc:
        log.exception("job %s failed", job_id)
        lease.fail(job_id, owner, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}", permanent=False)
        return "failed"


def run_deletion(job: Job, ctx: JobContext, wing: DeletionWing) -> None:
    """claim (done by execute_job) → load → unlearn → store version → erase → publish → shred → notify."""
    work = load(job, ctx, wing)
    unlearned = wing.unlearn(work, ctx)
    draft = store_version(work, unlearned)
    erasure = wing.erase(work, unlearned, ctx)
    # verify → certify: the evidence steps go here, before publishing
    publish(work, unlearned, draft, erasure, ctx)
    shred()
    notify(job.request_id)


def load(job: Job, ctx: JobContext, wing: DeletionWing) -> DeletionWork:
    """The request, the model and the version it deletes from, the method to run; then the wing's own inputs."""
    with session_scope() as session:
        request = requests.get_request_or_404(session, job.request_id)
        session.expunge(request)
        model, dataset, parent = registry.load_model(session, job.model_id)
    name, spec, method = method_for(request, model)
    ctx.progress(0.05, f"loading data and version {parent.number}")
    work = DeletionWork(job, request, model, dataset, parent, name, spec, method, new_id())
    work.inputs = wing.load(work, ctx)
    return work


def store_version(work: DeletionWork, unlearned: Unlearned) -> registry.VersionDraft:
    """Write the new parameters to the artifact store; the version row is written when it is published."""
    return registry.child_draft(
        work.parent,
        id=work.version_id,
        digest=registry.put_weights(unlearned.theta),
        method=unlearned.method,
        job_id=work.job.id,
        request_id=work.request.id,
        metrics=unlearned.metrics,
    )


def publish(
    work: DeletionWork, unlearned: Unlearned, draft: registry.VersionDraft, erasure: ErasurePlan, ctx: JobContext
) -> None:
    """ONE transaction: the new current version; every stored copy of the rows swapped for its erased replacement,
    earlier versions retired; the request completed with its erasure manifest (and audit event); the job finished."""
    model_id, request_id = work.model.id, work.request.id
    grace = get_settings().retired_version_grace_seconds
    with session_scope() as session:
        job_row = ctx.assert_lease(session)
        version = registry.add_version(session, draft, state_update=unlearned.state_update)
        manifest = registry.erase_rows(
            session,
            work.model.dataset_id,
            unlearned.positions,
            request_id,
            new_digest=erasure.dataset_digest,
            state_update=erasure.state_update,
            model_id=model_id,
        )
        manifest["method_state"] = registry.update_method_state(session, model_id, erasure.purged, erasure.invalidated)
        manifest["versions_retired"] = (
            registry.retire_versions(session, model_id, version.id, request_id, grace)
            if unlearned.parent_saw_rows  # held-out rows: no earlier version was trained on them
            else []
        )
        manifest["retired_weights_shredded_after_s"] = grace
        manifest.update(erasure.notes)
        requests.mark_completed(session, request_id, work.job.id, version, model_id, len(unlearned.positions), manifest)
        outbox.finish(session, job_row, {"version_id": version.id, "digest": version.digest})
    release_freed_pages()


def shred() -> None:
    """Delete the queued blobs whose grace period has passed (the dispatcher's tick does the same for later ones)."""
    with session_scope() as session:
        registry.shred_due(session)


def notify(request_id: str) -> None:
    """Tell the compliance system the request ended (best effort after the commit: the status is durable)."""
    with session_scope() as session:
        url, body = requests.callback_of(session, request_id)
    if url:
        deliver_webhook(url, body)


HANDLERS: dict[tuple[str, str], Handler] = {
    # (job kind, model kind) → handler; a new model kind adds its wing and its lines here
    ("train_model", "tabular"): tabular.train,
    ("deletion", "tabular"): partial(run_deletion, wing=tabular.Deletion()),
    ("train_model", "clip_federated"): federated.train,
    ("aggregate_round", "clip_federated"): federated.aggregate_round,
    ("deletion", "clip_federated"): partial(run_deletion, wing=federated.Deletion()),
}
