"""worker heartbeats: each Celery worker's last sign of life and its queues (readiness without a broadcast)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 23:50:00
"""

import sqlalchemy as sa
from alembic import op

import app.db

revision = '0010'
down_revision = '0009'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'worker_heartbeats',
        sa.Column('name', sa.String(length=200), primary_key=True),
        sa.Column('queues', app.db.JSONType, nullable=False),
        sa.Column('started_at', app.db.UTCDateTime(), nullable=False),
        sa.Column('seen_at', app.db.UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table('worker_heartbeats')
