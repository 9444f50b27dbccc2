"""Internal activation: the procedure a node calls while a queue has messages (broker.set_queue_activation), and
what the nodes report of its calls.  Only a new table and a new view: it applies while nodes of the previous
release serve, which neither read nor need them.

Revision ID: 0032
Revises: 0031
"""
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("""
        CREATE TABLE broker.queue_activation (
            queue_id           integer PRIMARY KEY REFERENCES broker.queues ON DELETE CASCADE,
            procedure_name     text NOT NULL,
            max_queue_readers  integer NOT NULL CHECK (max_queue_readers BETWEEN 1 AND 100),
            is_enabled         boolean NOT NULL,
            execute_as         text NOT NULL,
            activations        bigint NOT NULL DEFAULT 0,
            failures           bigint NOT NULL DEFAULT 0,
            last_failure       text,
            last_failure_at    timestamptz
        )""")
    op.execute("""
        CREATE VIEW broker.activation_status AS
        SELECT q.name AS queue_name, a.procedure_name, CASE WHEN a.is_enabled THEN 'on' ELSE 'off' END AS status,
               a.max_queue_readers, a.execute_as,
               (SELECT count(*) FROM pg_locks l
                WHERE l.locktype = 'advisory' AND l.classid = 1633907817 AND l.objsubid = 2 AND l.granted
                  AND l.objid::bigint / 100 = q.queue_id) AS readers,
               a.activations, a.failures, a.last_failure, a.last_failure_at
        FROM broker.queue_activation a
        JOIN broker.queues q USING (queue_id)""")
    op.execute("GRANT SELECT ON broker.activation_status TO broker_application")


def downgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("DROP VIEW broker.activation_status")
    op.execute("DROP TABLE broker.queue_activation")
