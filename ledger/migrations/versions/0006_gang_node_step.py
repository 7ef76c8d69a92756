"""gang node step

Revision ID: 0006_gang_node_step
Revises: 0005_change_markers
Create Date: 2026-12-02 16:40:00.000000
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0006_gang_node_step'
down_revision = '0005_change_markers'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # node 0's last finished step, which the gang's dispatcher reports as the job's progress
    with op.batch_alter_table('gang_nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('step', sa.Integer(), nullable=False, server_default='0'))


def downgrade() -> None:
    with op.batch_alter_table('gang_nodes', schema=None) as batch_op:
        batch_op.drop_column('step')
