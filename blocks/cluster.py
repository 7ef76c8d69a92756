"""`GPUCluster` block: the GPU inventory (pools, nodes, GPUs per node, GPU type, node addresses)
kept on the Prefect server, editable in the UI, loadable by any flow or worker.

The pool and GPU-type models are the cluster file's own (``scheduler.cluster.Pool``,
``estimator.catalog.GPU``) and every block is validated by the cluster file's loader, so a block
and a cluster YAML accept exactly the same inventories.
"""
from __future__ import annotations

from pathlib import Path

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_serializer, field_validator, model_validator

from blocks.known_fields import KnownFields
from blocks.schema import tidy_block_schema
from estimator.catalog import GPU
from scheduler.cluster import Cluster, Pool, cluster_from_dict, load_cluster


class GPUCluster(KnownFields, Block):
    """The GPUs Frenzy may schedule on: one pool per GPU type (a Prefect work pool each)."""

    _block_type_name = "GPU Cluster"
    _block_type_slug = "gpu-cluster"
    _description = ("Frenzy's GPU inventory: pools (one GPU type each), nodes, GPUs per node, node "
                    "addresses and custom GPU types. `frenzy pools sync --cluster block:NAME` "
                    "mirrors it into Prefect work pools.")
    _documentation_url = "https://github.com/frenzy/frenzy#cluster-file"   # type: ignore[assignment]

    # The UI edits a list of models as JSON (Prefect 3.9's block editor), so the description
    # shows one entry as it is typed there.
    pools: list[Pool] = Field(..., min_length=1, title="Pools", description=(
        'one object per pool, e.g. {"name": "a100", "gpu": "A100-80GB", "nodes": 2, "gpus_per_node": 8}; '
        "optional: inter_node_gbps, addresses (one host per node), devices (indices on each node)"))
    gpu_types: dict[str, GPU] = Field(default_factory=dict, title="GPU types",
                                      description="GPU types the catalog lacks, by name")
    node_credentials: SecretStr | None = Field(
        None, title="Node credentials",
        description="token or SSH key for the node addresses (stored encrypted, never logged)")

    @classmethod
    def model_json_schema(cls, *args, **kwargs):
        # the block editor's form: optional fields without the "None" type tab (blocks/schema.py)
        return tidy_block_schema(super().model_json_schema(*args, **kwargs))

    @field_validator("gpu_types", mode="before")
    @classmethod
    def _gpu_types_as_in_a_file(cls, value):
        # an entry typed as in a cluster file ({memory_gib, bf16_tflops}) gets the file's defaults
        # (``catalog.make_gpu``): the block and the file accept the same inventories
        if not isinstance(value, dict):
            return value
        from estimator.catalog import make_gpu
        return {name: make_gpu(name, g) if isinstance(g, dict) else g for name, g in value.items()}

    @field_serializer("pools", "gpu_types")
    def _without_unset(self, value):
        # the saved document leaves unset optional fields out instead of storing null: the block
        # editor then shows them empty, as its schema (no null choice) describes them
        if isinstance(value, dict):
            return {k: g.model_dump(exclude_none=True) for k, g in value.items()}
        return [p.model_dump(exclude_none=True) for p in value]

    @model_validator(mode="after")
    def _valid_inventory(self) -> "GPUCluster":
        self.to_cluster()      # raises FrenzyInputError (a ValueError) naming the field and rule
        return self

    def to_cluster(self) -> Cluster:
        """The inventory as ``scheduler.cluster.Cluster`` (what the scheduler and pool sync use)."""
        data = {"pools": [p.model_dump(exclude_none=True) for p in self.pools]}
        if self.gpu_types:
            data["gpu_types"] = {k: g.model_dump(exclude={"name"}) for k, g in self.gpu_types.items()}
        return cluster_from_dict(data, source="GPUCluster")

    @classmethod
    def from_cluster(cls, cluster: Cluster, **kw) -> "GPUCluster":
        return cls(pools=list(cluster.pools), gpu_types=dict(cluster.gpu_types), **kw)

    @classmethod
    def from_file(cls, path: str | Path, **kw) -> "GPUCluster":
        """A block from a cluster YAML (validated by ``scheduler.cluster.load_cluster``)."""
        return cls.from_cluster(load_cluster(path), **kw)
