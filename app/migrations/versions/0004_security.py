"""security: bound and expiring API keys, the audit log's canonical text, audit checkpoints

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-09 10:00:00

- api_keys: ``expires_at`` (refused from then on), ``model_id`` + ``client_id`` (a federated client's key, bound to
  one model). Existing keys keep NULL: no expiry, not bound.
- audit_events: ``canonical``, the exact text each new row's hash covers (JSONB rewrites numbers, so the hash is no
  longer recomputed from ``payload``). Existing rows keep NULL and are verified as before.
- audit_checkpoints: a keyed (HMAC) anchor of the chain's head every N events; append-only like the log (UPDATE,
  DELETE and, on PostgreSQL, TRUNCATE refused by triggers).

No data is rewritten. API-key hashes, subject hashes and request fingerprints written before this revision were keyed
with the master secret itself; from now on each purpose has its own HKDF-derived key, so keys created before the
upgrade must be created again (see README, "Security and erasure").
"""

import sqlalchemy as sa
from alembic import op

import app.db

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


CHECKPOINTS_APPEND_ONLY_POSTGRES = """
CREATE OR REPLACE FUNCTION audit_checkpoints_append_only() RETURNS trigger AS $$
BEGIN
    RAISE EXCEPTION 'audit_checkpoints is append-only: % refused', TG_OP USING ERRCODE = 'insufficient_privilege';
END
$$ LANGUAGE plpgsql;
"""


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("expires_at", app.db.UTCDateTime(timezone=True), nullable=True))
    op.add_column("api_keys", sa.Column("model_id", sa.String(length=36), nullable=True))
    op.add_column("api_keys", sa.Column("client_id", sa.String(length=200), nullable=True))
    op.create_index(op.f("ix_api_keys_model_id"), "api_keys", ["model_id"], unique=False)

    op.add_column("audit_events", sa.Column("canonical", sa.Text(), nullable=True))

    op.create_table(
        "audit_checkpoints",
        sa.Column("seq", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=False, nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.Column("at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("mac", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("seq", name=op.f("pk_audit_checkpoints")),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.execute(CHECKPOINTS_APPEND_ONLY_POSTGRES)
        op.execute(
            "CREATE TRIGGER audit_checkpoints_no_update_delete BEFORE UPDATE OR DELETE ON audit_checkpoints "
            "FOR EACH ROW EXECUTE FUNCTION audit_checkpoints_append_only()"
        )
        op.execute(
            "CREATE TRIGGER audit_checkpoints_no_truncate BEFORE TRUNCATE ON audit_checkpoints "
            "FOR EACH STATEMENT EXECUTE FUNCTION audit_checkpoints_append_only()"
        )
    else:
        for operation in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER audit_checkpoints_no_{operation.lower()} BEFORE {operation} ON audit_checkpoints "
                f"BEGIN SELECT RAISE(ABORT, 'audit_checkpoints is append-only: {operation} refused'); END"
            )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS audit_checkpoints_no_update_delete ON audit_checkpoints")
        op.execute("DROP TRIGGER IF EXISTS audit_checkpoints_no_truncate ON audit_checkpoints")
        op.execute("DROP FUNCTION IF EXISTS audit_checkpoints_append_only()")
    op.drop_table("audit_checkpoints")
    with op.batch_alter_table("audit_events", recreate="never") as batch_op:
        batch_op.drop_column("canonical")
    op.drop_index(op.f("ix_api_keys_model_id"), table_name="api_keys")
    with op.batch_alter_table("api_keys") as batch_op:
        batch_op.drop_column("client_id")
        batch_op.drop_column("model_id")
        batch_op.drop_column("expires_at")
