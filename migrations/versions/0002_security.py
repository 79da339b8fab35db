"""security: bound and expiring API keys

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-09 10:00:00

- api_keys: ``expires_at`` (refused from then on), ``model_id`` + ``client_id`` (a federated client's key, bound to
  one model). Existing keys keep NULL: no expiry, not bound.

No data is rewritten. API-key hashes, subject hashes and request fingerprints written before this revision were keyed
with the master secret itself; from now on each purpose has its own HKDF-derived key, so keys created before the
upgrade must be created again (see README, "Security and erasure").
"""

import sqlalchemy as sa
from alembic import op

import app.db

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None



def upgrade() -> None:
    op.add_column("api_keys", sa.Column("expires_at", app.db.UTCDateTime(timezone=True), nullable=True))
    op.add_column("api_keys", sa.Column("model_id", sa.String(length=36), nullable=True))
    op.add_column("api_keys", sa.Column("client_id", sa.String(length=200), nullable=True))
    op.create_index(op.f("ix_api_keys_model_id"), "api_keys", ["model_id"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_api_keys_model_id"), table_name="api_keys")
    with op.batch_alter_table("api_keys") as batch_op:
        batch_op.drop_column("client_id")
        batch_op.drop_column("model_id")
        batch_op.drop_column("expires_at")
