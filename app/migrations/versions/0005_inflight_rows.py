"""in-flight rows: a sample id (keyed hash) held by at most one unfinished deletion request per model

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 09:15:00
"""

from alembic import op
import sqlalchemy as sa

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'inflight_rows',
        sa.Column('model_id', sa.String(length=36), nullable=False),
        sa.Column('id_hash', sa.String(length=64), nullable=False),
        sa.Column('request_id', sa.String(length=36), nullable=False),
        sa.PrimaryKeyConstraint('model_id', 'id_hash'),
    )
    op.create_index('ix_inflight_rows_request', 'inflight_rows', ['request_id'])


def downgrade() -> None:
    op.drop_index('ix_inflight_rows_request', table_name='inflight_rows')
    op.drop_table('inflight_rows')
