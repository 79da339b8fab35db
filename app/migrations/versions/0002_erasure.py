"""erasure: data-set positions, retired versions, erased-row hashes, the shred queue, the erasure manifest

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-03 09:30:00
"""

from alembic import op
import sqlalchemy as sa

import app.db

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('datasets') as batch:
        batch.add_column(sa.Column('n_positions', sa.Integer(), nullable=True))
    with op.batch_alter_table('model_versions') as batch:
        batch.add_column(sa.Column('retired_at', app.db.UTCDateTime(), nullable=True))
        batch.add_column(sa.Column('retired_by', sa.String(length=36), nullable=True))
    with op.batch_alter_table('deletion_requests') as batch:
        batch.add_column(sa.Column('erasure', app.db.JSONType, nullable=True))
    op.create_table(
        'erased_rows',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('dataset_id', sa.String(length=36), nullable=False),
        sa.Column('id_hash', sa.String(length=64), nullable=False),
        sa.Column('request_id', sa.String(length=36), nullable=False),
        sa.Column('erased_at', app.db.UTCDateTime(), nullable=False),
        sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('dataset_id', 'id_hash', name='uq_erased_rows_dataset_hash'),
    )
    op.create_table(
        'shred_queue',
        sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
        sa.Column('digest', sa.String(length=64), nullable=False),
        sa.Column('reason', sa.String(length=200), nullable=False),
        sa.Column('not_before', app.db.UTCDateTime(), nullable=False),
        sa.Column('created_at', app.db.UTCDateTime(), nullable=False),
        sa.Column('done_at', app.db.UTCDateTime(), nullable=True),
        sa.Column('outcome', sa.String(length=32), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_shred_queue_due', 'shred_queue', ['done_at', 'not_before'])


def downgrade() -> None:
    op.drop_index('ix_shred_queue_due', table_name='shred_queue')
    op.drop_table('shred_queue')
    op.drop_table('erased_rows')
    with op.batch_alter_table('deletion_requests') as batch:
        batch.drop_column('erasure')
    with op.batch_alter_table('model_versions') as batch:
        batch.drop_column('retired_by')
        batch.drop_column('retired_at')
    with op.batch_alter_table('datasets') as batch:
        batch.drop_column('n_positions')
