"""model tags: what GET /v1/models?tag= filters on

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 14:20:00
"""

from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'model_tags',
        sa.Column('model_id', sa.String(length=36), sa.ForeignKey('models.id', ondelete='CASCADE'), nullable=False),
        sa.Column('tag', sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint('model_id', 'tag'),
    )
    op.create_index('ix_model_tags_tag', 'model_tags', ['tag'])


def downgrade() -> None:
    op.drop_index('ix_model_tags_tag', table_name='model_tags')
    op.drop_table('model_tags')
