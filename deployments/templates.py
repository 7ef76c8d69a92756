"""Base job templates for Frenzy's GPU work pools.

Prefect's default templates know nothing about GPUs. We add three typed template variables,
which the UI shows as form fields on every run of the pool and which Frenzy's dispatcher fills:

* ``gpu_ids``       comma-separated device indices (process pools: CUDA_VISIBLE_DEVICES)
* ``gpu_type``      the catalog GPU type (env FRENZY_GPU_TYPE)
* ``num_processes`` training processes = GPUs of the run (env FRENZY_NUM_PROCESSES; on
                    Kubernetes also the ``nvidia.com/gpu`` request)

The env entries are a literal dict with placeholders: Prefect drops an entry whose variable is
unset (so a manual run without ``gpu_ids`` keeps the worker's CUDA_VISIBLE_DEVICES), and deep-
merges the free-form ``env`` variable into it, so extra environment still works.

Pure functions over plain dicts: the defaults come from the server's worker metadata
(``client.read_worker_metadata()``) and are passed in.
"""
from __future__ import annotations

import copy
from typing import Any

# Kubernetes: GPU Feature Discovery labels nodes with nvidia.com/gpu.product = the NVML name with
# spaces as dashes. The common catalog types; others fall back to the type name and can be
# overridden per pool in the UI (variable ``gpu_product``).
GFD_PRODUCT = {
    "V100-16GB": "Tesla-V100-SXM2-16GB",
    "V100-32GB": "Tesla-V100-SXM2-32GB",
    "A100-40GB": "NVIDIA-A100-SXM4-40GB",
    "A100-80GB": "NVIDIA-A100-SXM4-80GB",
    "H100-80GB": "NVIDIA-H100-80GB-HBM3",
    "H200-141GB": "NVIDIA-H200",
    "A10-24GB": "NVIDIA-A10",
    "A10G-24GB": "NVIDIA-A10G",
    "L4-24GB": "NVIDIA-L4",
    "L40S-48GB": "NVIDIA-L40S",
    "T4-16GB": "Tesla-T4",
    "RTX3090-24GB": "NVIDIA-GeForce-RTX-3090",
    "RTX4090-24GB": "NVIDIA-GeForce-RTX-4090",
    "RTXA6000-48GB": "NVIDIA-RTX-A6000",
}

GPU_ENV = {
    "CUDA_VISIBLE_DEVICES": "{{ gpu_ids }}",
    "FRENZY_GPU_TYPE": "{{ gpu_type }}",
    "FRENZY_NUM_PROCESSES": "{{ num_processes }}",
}


def gpu_variables(gpu_type: str, max_gpus: int) -> dict[str, dict[str, Any]]:
    """JSON-schema properties of the GPU template variables (UI form fields)."""
    return {
        "gpu_ids": {
            "title": "GPU ids",
            "description": "Comma-separated device indices the run may use (CUDA_VISIBLE_DEVICES), "
                           "chosen by Frenzy's assigner. Leave empty to use the worker's own.",
            "type": "string",
            "pattern": r"^\d+(,\d+)*$",
        },
        "gpu_type": {
            "title": "GPU type",
            "description": "The pool's GPU type (Frenzy catalog name).",
            "type": "string",
            "default": gpu_type,
        },
        "num_processes": {
            "title": "Processes (GPUs)",
            "description": "Training processes, one per GPU.",
            "type": "integer",
            "minimum": 1,
            "maximum": max(1, int(max_gpus)),
            "default": 1,
        },
    }


def process_template(default: dict[str, Any], gpu_type: str, max_gpus: int) -> dict[str, Any]:
    """The process worker's default template plus the GPU variables."""
    t = copy.deepcopy(default)
    t["variables"]["properties"].update(gpu_variables(gpu_type, max_gpus))
    t["job_configuration"]["env"] = dict(GPU_ENV)
    return t


def kubernetes_template(default: dict[str, Any], gpu_type: str, max_gpus: int,
                        gpu_product: str | None = None) -> dict[str, Any]:
    """The Kubernetes worker's default template plus the GPU variables: the job's container
    requests ``nvidia.com/gpu: num_processes`` and the pod selects nodes whose
    ``nvidia.com/gpu.product`` label is ``gpu_product``.

    Inside a container the device plugin renumbers the GPUs it grants from 0, so ``gpu_ids`` is
    passed as FRENZY_GPU_IDS for the record, not as CUDA_VISIBLE_DEVICES.
    """
    t = copy.deepcopy(default)
    props = t["variables"]["properties"]
    props.update(gpu_variables(gpu_type, max_gpus))
    props["gpu_product"] = {
        "title": "GPU product label",
        "description": "Value of the node label nvidia.com/gpu.product (GPU Feature Discovery) to run on.",
        "type": "string",
        "default": gpu_product or GFD_PRODUCT.get(gpu_type, gpu_type),
    }
    t["job_configuration"]["env"] = {
        "FRENZY_GPU_IDS": "{{ gpu_ids }}",
        "FRENZY_GPU_TYPE": "{{ gpu_type }}",
        "FRENZY_NUM_PROCESSES": "{{ num_processes }}",
    }
    manifest = t["job_configuration"]["job_manifest"]
    pod = manifest["spec"]["template"]["spec"]
    pod["nodeSelector"] = {"nvidia.com/gpu.product": "{{ gpu_product }}"}
    pod.setdefault("tolerations", []).append(
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    container = pod["containers"][0]
    resources = container.setdefault("resources", {})
    resources.setdefault("limits", {})["nvidia.com/gpu"] = "{{ num_processes }}"
    resources.setdefault("requests", {})["nvidia.com/gpu"] = "{{ num_processes }}"
    return t


def pool_template(kind: str, default: dict[str, Any], gpu_type: str, max_gpus: int) -> dict[str, Any]:
    if kind == "process":
        return process_template(default, gpu_type, max_gpus)
    if kind == "kubernetes":
        return kubernetes_template(default, gpu_type, max_gpus)
    raise ValueError(f"unknown pool type {kind!r}")
