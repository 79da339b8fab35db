"""operators' notes on a request live on its row (erasable), the audit log keeps only their keyed digests

Revision ID: 0012_request_notes
Revises: 0011_webhook_requester
Create Date: 2026-12-05 05:30:00
"""

import sqlalchemy as sa
from alembic import op

import app.db

revision = '0012_request_notes'
down_revision = '0011_webhook_requester'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('deletion_requests') as batch:
        batch.add_column(sa.Column('notes', app.db.JSONType, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('deletion_requests') as batch:
        batch.drop_column('notes')
