"""Imports every domain's tables so that ``Base.metadata`` is complete (for Alembic and tests)."""

from app.audit.tables import AuditCheckpoint, AuditEvent
from app.auth.tables import ApiKey, DashboardSession
from app.certificates.tables import Certificate
from app.db import Base
from app.jobs.tables import BlobIntent, Job, WorkerHeartbeat
from app.registry.tables import Dataset, DatasetRow, ErasedRow, Model, ModelVersion, ShredItem
from app.reports.tables import Report
from app.requests.tables import DeletionRequest, InflightRow
from app.subjects.tables import SubjectErasure, SubjectErasureChild, SubjectRow
from app.webhooks.tables import WebhookDelivery

__all__ = [
    "Certificate",
    "Report",
    "WebhookDelivery",
    "ApiKey",
    "BlobIntent",
    "AuditCheckpoint",
    "AuditEvent",
    "Base",
    "Dataset",
    "DashboardSession",
    "DatasetRow",
    "DeletionRequest",
    "ErasedRow",
    "InflightRow",
    "Job",
    "Model",
    "ModelVersion",
    "ShredItem",
    "SubjectErasure",
    "SubjectErasureChild",
    "SubjectRow",
    "WorkerHeartbeat",
]
