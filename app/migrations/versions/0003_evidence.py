"""evidence: verification reports, deletion certificates, the webhook outbox, a request's failure reason

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03 08:45:00
"""

from alembic import op
import sqlalchemy as sa

import app.db

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('deletion_requests') as batch:
        batch.add_column(sa.Column('certificate_id', sa.String(length=36), nullable=True))
    op.create_table(
        'reports',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('request_id', sa.String(length=36), nullable=False),
        sa.Column('model_id', sa.String(length=36), nullable=False),
        sa.Column('verdict', sa.String(length=16), nullable=False),
        sa.Column('body', app.db.JSONType, nullable=False),
        sa.Column('plots', app.db.JSONType, nullable=False),
        sa.Column('etag', sa.String(length=64), nullable=False),
        sa.Column('created_at', app.db.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_reports_request_id', 'reports', ['request_id'])
    op.create_table(
        'certificates',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('request_id', sa.String(length=36), nullable=False),
        sa.Column('model_id', sa.String(length=36), nullable=False),
        sa.Column('version_id', sa.String(length=36), nullable=False),
        sa.Column('subject_digest', sa.String(length=64), nullable=False),
        sa.Column('key_id', sa.String(length=64), nullable=False),
        sa.Column('digest', sa.String(length=64), nullable=False),
        sa.Column('envelope', app.db.JSONType, nullable=False),
        sa.Column('created_at', app.db.UTCDateTime(), nullable=False),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('request_id', name='uq_certificates_request'),
    )
    op.create_table(
        'webhook_deliveries',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('request_id', sa.String(length=36), nullable=False),
        sa.Column('event', sa.String(length=64), nullable=False),
        sa.Column('url', sa.String(length=2000), nullable=False),
        sa.Column('message_id', sa.String(length=64), nullable=False),
        sa.Column('payload', app.db.JSONType, nullable=False),
        sa.Column('status', sa.String(length=16), nullable=False),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', app.db.UTCDateTime(), nullable=False),
        sa.Column('give_up_at', app.db.UTCDateTime(), nullable=False),
        sa.Column('last_status_code', sa.Integer(), nullable=True),
        sa.Column('last_error', sa.String(length=500), nullable=True),
        sa.Column('created_at', app.db.UTCDateTime(), nullable=False),
        sa.Column('delivered_at', app.db.UTCDateTime(), nullable=True),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_webhook_deliveries_due', 'webhook_deliveries', ['status', 'next_attempt_at'])
    op.create_index('ix_webhook_deliveries_request', 'webhook_deliveries', ['request_id'])


def downgrade() -> None:
    op.drop_index('ix_webhook_deliveries_request', table_name='webhook_deliveries')
    op.drop_index('ix_webhook_deliveries_due', table_name='webhook_deliveries')
    op.drop_table('webhook_deliveries')
    op.drop_table('certificates')
    op.drop_index('ix_reports_request_id', table_name='reports')
    op.drop_table('reports')
    with op.batch_alter_table('deletion_requests') as batch:
        batch.drop_column('certificate_id')
