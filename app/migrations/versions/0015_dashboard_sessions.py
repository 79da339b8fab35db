"""dashboard sessions: server-side dashboard logins, revocable at logout (issue 22)

Revision ID: 0015_dashboard_sessions
Revises: 0014_blob_intents
Create Date: 2026-12-05 05:15:00

The dashboard cookie used to carry the API key itself (signed, not encrypted). From now on it carries a random
session token; this table keeps the token's keyed hash and the id of the key it logged in with. Cookies issued
before the upgrade no longer open a session: operators log in again.
"""

import sqlalchemy as sa
from alembic import op

import app.db

revision = '0015_dashboard_sessions'
down_revision = '0014_blob_intents'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'dashboard_sessions',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('token_hash', sa.String(length=64), nullable=False),
        sa.Column('key_id', sa.String(length=36), nullable=False),
        sa.Column('created_at', app.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column('last_seen_at', app.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column('expires_at', app.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ['key_id'], ['api_keys.id'], name=op.f('fk_dashboard_sessions_key_id_api_keys'), ondelete='CASCADE'
        ),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_dashboard_sessions')),
        sa.UniqueConstraint('token_hash', name=op.f('uq_dashboard_sessions_token_hash')),
    )
    op.create_index(op.f('ix_dashboard_sessions_key_id'), 'dashboard_sessions', ['key_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_dashboard_sessions_key_id'), table_name='dashboard_sessions')
    op.drop_table('dashboard_sessions')
