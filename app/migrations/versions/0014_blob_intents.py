"""blob intents: the blobs a worker's attempt is about to write, shredded if it never publishes (issue 22)

Revision ID: 0014_blob_intents
Revises: 0013_audit_anchor
Create Date: 2026-12-05 05:20:00
"""

import sqlalchemy as sa
from alembic import op

import app.db

revision = '0014_blob_intents'
down_revision = '0013_audit_anchor'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'blob_intents',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('owner', sa.String(length=200), nullable=False),
        sa.Column('job_id', sa.String(length=36), nullable=False),
        sa.Column('digest', sa.String(length=64), nullable=False),
        sa.Column('created_at', app.db.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_blob_intents')),
    )
    op.create_index(op.f('ix_blob_intents_owner'), 'blob_intents', ['owner'], unique=False)
    op.create_index(op.f('ix_blob_intents_digest'), 'blob_intents', ['digest'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_blob_intents_digest'), table_name='blob_intents')
    op.drop_index(op.f('ix_blob_intents_owner'), table_name='blob_intents')
    op.drop_table('blob_intents')
