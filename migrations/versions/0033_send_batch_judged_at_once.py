"""This release's function files: broker.send_batch judges its batch in one statement and moves its senders on in
the statement that numbers and queues the messages.  No table changes, and no function's arguments or answers
change: it applies while nodes of the previous release serve, and their code keeps working.

Revision ID: 0033
Revises: 0032
"""
revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """The function files are applied after the revisions (broker.schema.apply_functions)."""


def downgrade() -> None:
    pass
