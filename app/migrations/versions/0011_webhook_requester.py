"""webhook deliveries name the key that asked for them: each requester's events are signed with its own secret

Revision ID: 0011_webhook_requester
Revises: 0010
Create Date: 2026-12-05 05:20:00
"""

import sqlalchemy as sa
from alembic import op

revision = '0011_webhook_requester'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('webhook_deliveries') as batch:
        batch.add_column(sa.Column('requester_key_id', sa.String(length=36), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('webhook_deliveries') as batch:
        batch.drop_column('requester_key_id')
