"""audit anchor: signed checkpoints (issue 22): the interval, the previous checkpoint and an Ed25519 signature

Revision ID: 0013_audit_anchor
Revises: 0012_request_notes
Create Date: 2026-12-05 05:30:00

Columns only (ADD COLUMN, so SQLite keeps the table and its append-only triggers). Rows written before keep their
HMAC in ``mac`` and NULL here.
"""

import sqlalchemy as sa
from alembic import op

revision = '0013_audit_anchor'
down_revision = '0012_request_notes'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('audit_checkpoints', sa.Column('every', sa.Integer(), nullable=True))
    op.add_column(
        'audit_checkpoints', sa.Column('prev_seq', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True)
    )
    op.add_column('audit_checkpoints', sa.Column('signature', sa.String(length=128), nullable=True))


def downgrade() -> None:
    for column in ('signature', 'prev_seq', 'every'):  # plain DROP COLUMN: a batch copy would lose SQLite's triggers
        op.execute(f'ALTER TABLE audit_checkpoints DROP COLUMN {column}')
