"""dataset chunks: a chunked table's blobs (an erasure rewrites only the chunks that held the rows); dataset rows
indexed by position (erasure's look-up) and a partial index of tombstoned rows (read per deletion)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 23:40:00
"""

from alembic import op
import sqlalchemy as sa

import app.db

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('datasets') as batch:
        batch.add_column(sa.Column('chunks', app.db.JSONType, nullable=True))
    op.create_index('ix_dataset_rows_dataset_position', 'dataset_rows', ['dataset_id', 'position'])
    where = sa.text('deleted_by IS NOT NULL')
    op.create_index(
        'ix_dataset_rows_tombstoned', 'dataset_rows', ['dataset_id'], sqlite_where=where, postgresql_where=where
    )


def downgrade() -> None:
    op.drop_index('ix_dataset_rows_tombstoned', table_name='dataset_rows')
    op.drop_index('ix_dataset_rows_dataset_position', table_name='dataset_rows')
    with op.batch_alter_table('datasets') as batch:
        batch.drop_column('chunks')
