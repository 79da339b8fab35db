"""Imports every domain's tables so that ``Base.metadata`` is complete (for Alembic and tests)."""

from app.audit.tables import AuditCheckpoint, AuditEvent
from app.auth.tables import ApiKey
from app.db import Base
from app.jobs.tables import Job
from app.registry.tables import Dataset, DatasetRow, Model, ModelVersion
from app.requests.tables import DeletionRequest

__all__ = [
    "ApiKey",
    "AuditCheckpoint",
    "AuditEvent",
    "Base",
    "Dataset",
    "DatasetRow",
    "DeletionRequest",
    "Job",
    "Model",
    "ModelVersion",
]
