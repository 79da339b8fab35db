"""per-person erasure and approval: subject index (keyed hashes), subject erasures and their children;
models.requires_approval

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 12:30:00
"""

from alembic import op
import sqlalchemy as sa

import app.db

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None

BIGINT = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('models') as batch:
        batch.add_column(sa.Column('requires_approval', sa.Boolean(), nullable=False, server_default=sa.false()))
    op.create_table(
        'subject_rows',
        sa.Column('id', BIGINT, autoincrement=True, nullable=False),
        sa.Column('subject_hash', sa.String(length=64), nullable=False),
        sa.Column('dataset_id', sa.String(length=36), nullable=False),
        sa.Column('row_pk', BIGINT, nullable=False),
        sa.ForeignKeyConstraint(['dataset_id'], ['datasets.id'], ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['row_pk'], ['dataset_rows.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_subject_rows_subject_hash', 'subject_rows', ['subject_hash'])
    op.create_index('ix_subject_rows_dataset_id', 'subject_rows', ['dataset_id'])
    op.create_index('ix_subject_rows_row_pk', 'subject_rows', ['row_pk'])
    op.create_table(
        'subject_erasures',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('subject_hash', sa.String(length=64), nullable=False),
        sa.Column('method', sa.String(length=64), nullable=False),
        sa.Column('api_key_id', sa.String(length=36), nullable=True),
        sa.Column('created_at', app.db.UTCDateTime(), nullable=False),
        sa.Column('completed_at', app.db.UTCDateTime(), nullable=True),
        sa.Column('certificate_digest', sa.String(length=64), nullable=True),
        sa.Column('certificate', app.db.JSONType, nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_subject_erasures_subject_hash', 'subject_erasures', ['subject_hash'])
    op.create_table(
        'subject_erasure_children',
        sa.Column('request_id', sa.String(length=36), nullable=False),
        sa.Column('erasure_id', sa.String(length=36), nullable=False),
        sa.Column('model_id', sa.String(length=36), nullable=False),
        sa.ForeignKeyConstraint(['erasure_id'], ['subject_erasures.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('request_id'),
    )
    op.create_index('ix_subject_erasure_children_erasure_id', 'subject_erasure_children', ['erasure_id'])


def downgrade() -> None:
    op.drop_index('ix_subject_erasure_children_erasure_id', table_name='subject_erasure_children')
    op.drop_table('subject_erasure_children')
    op.drop_index('ix_subject_erasures_subject_hash', table_name='subject_erasures')
    op.drop_table('subject_erasures')
    op.drop_index('ix_subject_rows_row_pk', table_name='subject_rows')
    op.drop_index('ix_subject_rows_dataset_id', table_name='subject_rows')
    op.drop_index('ix_subject_rows_subject_hash', table_name='subject_rows')
    op.drop_table('subject_rows')
    with op.batch_alter_table('models') as batch:
        batch.drop_column('requires_approval')
