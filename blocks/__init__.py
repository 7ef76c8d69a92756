"""Frenzy's Prefect blocks. Importing this module defines them; Prefect imports it through the
``prefect.collections`` entry point (``frenzy = "blocks"`` in pyproject.toml) at server and
worker start, so once the package is installed both block types appear in the UI catalog."""
from .cluster import GPUCluster
from .settings import FrenzySettings

__all__ = ["GPUCluster", "FrenzySettings"]
