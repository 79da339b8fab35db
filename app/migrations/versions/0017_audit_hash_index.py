"""audit log: no unique index on the event hash (PostgreSQL; issue 21)

Revision ID: 0017_audit_hash_index
Revises: 0016_audit_lock_head
Create Date: 2026-12-06 03:00:00

Nothing looks an event up by its hash: the chain is read by position (``seq``, the primary key) and checked by
recomputing every hash (``verify_chain``); two events with one hash would need two positions, which the primary key
already refuses. The index was a B-tree of random 64-character keys written on the intake's critical path, inside the
audit log's lock: one more random page per event, and after each checkpoint a whole page in the WAL. PostgreSQL only:
SQLite cannot drop a table's unique constraint without rebuilding the table, which would drop the log's append-only
triggers with it; there the index stays (unused, harmless).
"""

from alembic import op

revision = '0017_audit_hash_index'
down_revision = '0016_audit_lock_head'
branch_labels = None
depends_on = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint('uq_audit_events_hash', 'audit_events', type_='unique')


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.create_unique_constraint('uq_audit_events_hash', 'audit_events', ['hash'])
