"""audit lock and head in one call: the intake batch's rows, the audit log's lock and the chain's head in one statement
(issue 21)

Revision ID: 0016_audit_lock_head
Revises: 0015_dashboard_sessions
Create Date: 2026-12-05 23:30:00

PostgreSQL only. ``lethe_audit_lock_head(lock_id, inserted)`` takes the audit log's advisory lock, then reads the
chain's head and the newest checkpoint's position. It is VOLATILE PL/pgSQL, so under READ COMMITTED its query takes
its snapshot after the lock is held and sees the previous holder's commit (a head read by the calling statement's own
snapshot, taken before the lock, could be stale). ``inserted`` is not used: a caller passes the count of rows its
statement inserts (data-modifying CTEs), which makes PostgreSQL finish those inserts before it calls the function, so
a batch never waits for a row another transaction holds while it holds the lock.
"""

from alembic import op

revision = '0016_audit_lock_head'
down_revision = '0015_dashboard_sessions'
branch_labels = None
depends_on = None

FUNCTION = """
CREATE OR REPLACE FUNCTION lethe_audit_lock_head(lock_id bigint, inserted bigint)
RETURNS TABLE (head_seq bigint, head_hash varchar, checkpoint_seq bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(lock_id);
    RETURN QUERY
        SELECT h.seq, h.hash, (SELECT max(c.seq) FROM audit_checkpoints AS c)
        FROM (SELECT 1) AS one
        LEFT JOIN (SELECT e.seq, e.hash FROM audit_events AS e ORDER BY e.seq DESC LIMIT 1) AS h ON true;
END
$$
"""


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(FUNCTION)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS lethe_audit_lock_head(bigint, bigint)")
