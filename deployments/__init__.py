"""Frenzy's Prefect infrastructure: GPU work pools, their concurrency limits and training
deployments (``deployments.pools``), and the pool job templates (``deployments.templates``)."""
from .pools import (CONTROL_POOL, TRAIN_ENTRYPOINT, PoolStatus, SyncReport, gpu_limit_name, pools_status,
                    sync_pools, train_deployment_name)

__all__ = ["CONTROL_POOL", "TRAIN_ENTRYPOINT", "PoolStatus", "SyncReport", "gpu_limit_name",
           "pools_status", "sync_pools", "train_deployment_name"]
