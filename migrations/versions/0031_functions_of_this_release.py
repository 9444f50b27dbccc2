"""This release's function files: the relay's answer held to the numbers the batch carried rather than to a copy
of the batch, a service's contracts altered, the ingests' lag, route hosts checked against metadata addresses, the
rollback count's arguments checked, a lost lock refused alike whoever asks.  No table changes: it applies while
nodes of the previous release serve, and their code keeps working (broker.apply_transport_results(jsonb) stays
for them).

Revision ID: 0031
Revises: 0030
"""
revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """The function files are applied after the revisions (broker.schema.apply_functions)."""


def downgrade() -> None:
    pass
