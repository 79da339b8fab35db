"""deadlines and operator controls: received_at, due_at, extensions, overdue_at on deletion requests

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 09:40:00
"""

from alembic import op
import sqlalchemy as sa

import app.db

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('deletion_requests') as batch:
        batch.add_column(sa.Column('received_at', app.db.UTCDateTime(), nullable=True))
        batch.add_column(sa.Column('due_at', app.db.UTCDateTime(), nullable=True))
        batch.add_column(sa.Column('extensions', app.db.JSONType, nullable=True))
        batch.add_column(sa.Column('overdue_at', app.db.UTCDateTime(), nullable=True))
    op.create_index('ix_deletion_requests_due', 'deletion_requests', ['status', 'due_at'])


def downgrade() -> None:
    op.drop_index('ix_deletion_requests_due', table_name='deletion_requests')
    with op.batch_alter_table('deletion_requests') as batch:
        batch.drop_column('overdue_at')
        batch.drop_column('extensions')
        batch.drop_column('due_at')
        batch.drop_column('received_at')
