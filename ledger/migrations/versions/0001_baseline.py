"""baseline: the ledger's tables as ``create_all`` made them before schema versioning

A ledger file made before Alembic has exactly these tables and no ``alembic_version``; the
ledger stamps such a file with this revision on open and upgrades it from here.

Revision ID: 0001_baseline
Revises:
Create Date: 2026-12-01
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_baseline"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=True),
        sa.Column("submitted_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("job_id"))
    op.create_table(
        "measurements",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("alloc_id", sa.String(), nullable=True),
        sa.Column("gpu_type", sa.String(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.Column("predicted", sa.JSON(), nullable=True),
        sa.Column("measured", sa.JSON(), nullable=True),
        sa.Column("predicted_device_used_gib", sa.Float(), nullable=True),
        sa.Column("measured_device_used_gib", sa.Float(), nullable=True),
        sa.Column("predicted_reserved_peak_gib", sa.Float(), nullable=True),
        sa.Column("measured_reserved_peak_gib", sa.Float(), nullable=True),
        sa.Column("predicted_step_time_s", sa.Float(), nullable=True),
        sa.Column("measured_step_time_s", sa.Float(), nullable=True),
        sa.Column("tokens_per_s", sa.Float(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id"))
    op.create_index("ix_measurements_gpu_type", "measurements", ["gpu_type"], unique=False)
    op.create_index("ix_measurements_job_id", "measurements", ["job_id"], unique=False)
    op.create_table(
        "pools",
        sa.Column("name", sa.String(), nullable=False),
        sa.Column("gpu_type", sa.String(), nullable=False),
        sa.Column("nodes", sa.Integer(), nullable=False),
        sa.Column("gpus_per_node", sa.Integer(), nullable=False),
        sa.Column("inter_node_gbps", sa.Float(), nullable=False),
        sa.Column("gpu_memory_gib", sa.Float(), nullable=False),
        sa.Column("intra_link", sa.String(), nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("name"))
    op.create_table(
        "allocations",
        sa.Column("id", sa.String(), nullable=False),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("pool", sa.String(), nullable=False),
        sa.Column("gpu_type", sa.String(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.Column("placement", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("lease_expires_at", sa.Float(), nullable=False),
        sa.Column("expected_end_at", sa.Float(), nullable=True),
        sa.Column("ended_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.job_id"]),
        sa.PrimaryKeyConstraint("id"))
    op.create_index("ix_allocations_job_id", "allocations", ["job_id"], unique=False)
    op.create_index("ix_allocations_status", "allocations", ["status"], unique=False)
    op.create_table(
        "nodes",
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("pool", sa.String(), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("address", sa.String(), nullable=True),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["pool"], ["pools.name"]),
        sa.PrimaryKeyConstraint("node_id"))
    op.create_index("ix_nodes_pool", "nodes", ["pool"], unique=False)
    op.create_table(
        "plans",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.String(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("gpu_type", sa.String(), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("device_used_gib", sa.Float(), nullable=False),
        sa.Column("step_time_s", sa.Float(), nullable=False),
        sa.Column("plan", sa.JSON(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.job_id"]),
        sa.PrimaryKeyConstraint("id"))
    op.create_index("ix_plans_job_id", "plans", ["job_id"], unique=False)
    op.create_table(
        "gpus",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node_id", sa.String(), nullable=False),
        sa.Column("device_index", sa.Integer(), nullable=False),
        sa.Column("pool", sa.String(), nullable=False),
        sa.Column("gpu_type", sa.String(), nullable=False),
        sa.Column("alloc_id", sa.String(), nullable=True),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(["node_id"], ["nodes.node_id"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("node_id", "device_index", name="uq_gpu_node_device"))
    op.create_index("ix_gpus_alloc_id", "gpus", ["alloc_id"], unique=False)
    op.create_index("ix_gpus_type_free", "gpus", ["gpu_type", "alloc_id"], unique=False)


def downgrade() -> None:
    for index, table in (("ix_gpus_type_free", "gpus"), ("ix_gpus_alloc_id", "gpus"),
                         ("ix_plans_job_id", "plans"), ("ix_nodes_pool", "nodes"),
                         ("ix_allocations_status", "allocations"), ("ix_allocations_job_id", "allocations"),
                         ("ix_measurements_job_id", "measurements"),
                         ("ix_measurements_gpu_type", "measurements")):
        op.drop_index(index, table_name=table)
    for table in ("gpus", "plans", "nodes", "allocations", "pools", "measurements", "jobs"):
        op.drop_table(table)
