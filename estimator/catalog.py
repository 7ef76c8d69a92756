"""GPU catalog: what each GPU type can hold and how fast it computes and communicates.

Pure data + lookups (no torch, no NVML). Cluster files and workloads name GPU types by the
catalog names below; a cluster file may add its own types (``gpu_types:``), which reach the
catalog through ``get_gpu(name, extra=...)``.

Units
-----
* ``memory_gib``: total device memory as NVML / ``nvidia-smi`` reports it (MiB / 1024), i.e.
  the capacity a predicted ``device_used_gib`` is compared with (minus a safety margin).
* ``*_tflops``: peak *dense* tensor throughput (no 2:4 sparsity) in TFLOP/s; ``fp32_tflops`` is
  the non-tensor FP32 rate. ``bf16_tflops == 0`` means no native bf16 (V100, T4): bf16 matmuls
  then run without tensor cores at roughly the FP32 rate (see ``GPU.peak_tflops``).
  GeForce/RTX figures are with FP32 accumulation (what PyTorch training uses).
* ``mem_bw_gbs``: HBM/GDDR bandwidth in GB/s.
* ``intra_link_gbps`` / ``inter_node_gbps``: **gigabits per second** (like network specs).
  ``intra_link_gbps`` is the per-GPU, per-direction bandwidth a collective inside one node can
  use (NVLink: links x per-link rate; PCIe: an achievable bus bandwidth, below the x16 peak,
  lower still where consumer cards lack peer-to-peer). ``inter_node_gbps`` is the typical
  aggregate network bandwidth of one node of that class (e.g. DGX A100: 8 x 200 Gb/s HDR).
* ``util``: the sustained fraction of the dense peak that large training GEMMs reach on that
  GPU class (clocks under the power limit x kernel efficiency; see the ``UTIL_*`` constants).
  Everything else a step does (memory-bound kernels, attention, communication, launches) is
  a separate term of ``estimator.throughput``. A named, recalibratable factor: measured runs
  refine it per GPU type (``frenzy calibrate``).
* ``tf32_tflops`` / ``fp8_tflops``: dense TF32 / FP8 tensor rates (None where the GPU has none).
* ``l2_mib``, ``tdp_w`` (board power), ``gpu_class`` (datacenter | workstation | consumer).

Sources: NVIDIA datasheets (V100, A100, H100, H200, A10, L4, L40S, T4, RTX A6000 and the
Ampere/Ada GA102/AD102 architecture whitepapers for RTX 3090 / 4090); NVML memory totals as
printed by ``nvidia-smi`` on the respective cards; AWS / GCP instance pages for typical
inter-node bandwidth of cloud-only cards (A10G on g5, L4 on g6/g2, T4 on g4dn, L40S on g6e);
the development notes, notes/scheduling.md section 4 for measured speed ratios.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import FrenzyInputError


class GPU(BaseModel):
    """One GPU type. Frozen: share instances freely."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., min_length=1)
    # upper bounds far beyond any device (so a typo in units fails; 1e300 GiB was taken): the
    # largest accelerator memory is ~0.3 TB (CPU "GPU" types hold a host's, at most a few TB),
    # the fastest dense tensor rates ~2-5 PFLOP/s, HBM ~8 TB/s
    memory_gib: float = Field(..., gt=0, le=65536)
    bf16_tflops: float = Field(..., ge=0, le=100_000)
    fp16_tflops: float = Field(..., gt=0, le=100_000)
    fp32_tflops: float = Field(..., gt=0, le=100_000)
    mem_bw_gbs: float = Field(..., gt=0, le=1_000_000)
    # the link family and generation; the throughput model credits NVLink's collectives their
    # efficiency (any other spelling was taken, and timed as PCIe)
    intra_link: str = Field("pcie4", pattern=r"^(nvlink|nvswitch|pcie|xgmi|shm)[0-9]*$")
    intra_link_gbps: float = Field(128.0, gt=0)
    inter_node_gbps: float = Field(100.0, gt=0)
    util: float = Field(0.4, gt=0, le=1)
    tf32_tflops: float | None = Field(None, gt=0)   # dense TF32 tensor rate; None = no TF32 (pre-Ampere)
    fp8_tflops: float | None = Field(None, gt=0)    # dense FP8 tensor rate; None = no FP8 (pre-Ada/Hopper)
    l2_mib: float = Field(6.0, gt=0)
    tdp_w: float = Field(300.0, gt=0)
    gpu_class: Literal["datacenter", "workstation", "consumer", "cpu"] = "datacenter"
    flash_attn_eff: float = Field(0.7, gt=0, le=1)  # fused attention's share of the GEMM rate
    is_cpu: bool = False

    @field_validator("intra_link", mode="before")
    @classmethod
    def _link_lower(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v     # "NVLink4" is nvlink4

    @property
    def supports_bf16(self) -> bool:
        return self.bf16_tflops > 0

    def peak_tflops(self, precision: str, matmul_precision: str = "default") -> float:
        """Peak dense TFLOP/s of matmuls in ``precision`` (fp32 | fp16 | bf16).

        ``matmul_precision``: ``default`` (fp32 matmuls on FP32 units, 16-bit on tensor cores),
        ``tf32`` (fp32 matmuls on TF32 tensor cores) or ``fp8`` (16-bit training whose GEMMs run
        in FP8, Transformer-Engine style). A rate the GPU lacks is an input error naming the field.
        """
        if matmul_precision == "tf32":
            if precision != "fp32":
                raise FrenzyInputError("matmul_precision", f"tf32 applies to fp32 training (precision {precision!r})")
            if not self.tf32_tflops:
                raise FrenzyInputError("matmul_precision", f"{self.name} has no TF32 tensor cores")
            return self.tf32_tflops
        if matmul_precision == "fp8":
            if precision == "fp32":
                raise FrenzyInputError("matmul_precision", "fp8 applies to 16-bit training (precision 'fp32')")
            if not self.fp8_tflops:
                raise FrenzyInputError("matmul_precision", f"{self.name} has no FP8 tensor cores")
            return self.fp8_tflops
        if matmul_precision != "default":
            raise FrenzyInputError("matmul_precision", f"must be one of default, tf32, fp8 (got {matmul_precision!r})")
        if precision == "bf16":
            # No native bf16 (V100, T4): matmuls fall back to non-tensor-core kernels.
            return self.bf16_tflops if self.bf16_tflops > 0 else self.fp32_tflops
        if precision == "fp16":
            return self.fp16_tflops
        if precision == "fp32":
            return self.fp32_tflops
        raise FrenzyInputError("precision", f"must be one of fp32, fp16, bf16 (got {precision!r})")


# Peer-to-peer collectives inside a node, per GPU and direction, in Gbit/s.
NVLINK2_GBPS = 150 * 8      # V100 SXM2: 6 links x 25 GB/s
NVLINK3_GBPS = 300 * 8      # A100 SXM4: 12 links x 25 GB/s
NVLINK4_GBPS = 450 * 8      # H100/H200 SXM: 18 links x 25 GB/s
PCIE3_GBPS = 80.0           # ~10 GB/s achievable bus bandwidth for all-reduce over PCIe 3 x16
PCIE4_GBPS = 128.0          # ~16 GB/s achievable over PCIe 4 x16 with P2P
PCIE4_NOP2P_GBPS = 80.0     # GeForce Ada (RTX 4090): no P2P, traffic bounces through host memory

# CPU pseudo-type: local CPU training (processes over gloo). Fixed, documented figures so that
# plans and tests are reproducible across machines: 8 GiB of host RAM per training process
# (the demo's tiny models use megabytes), ~0.1 TFLOP/s fp32 per process on a couple of cores;
# bf16/fp16 matmuls on generic x86 CPUs are slower than fp32.
CPU_MEMORY_GIB = 8.0

_G = GPU  # brevity in the table below

# ``util``: the sustained fraction of the datasheet dense peak that large training GEMMs reach =
# (clock the card holds under dense tensor-core load / the boost clock the peak figure uses) x
# cuBLAS kernel efficiency at that clock (~0.8-0.85 for large bf16/fp16 GEMMs on Volta..Hopper).
# Whether a card holds its boost clock depends on its board power per unit of tensor throughput:
UTIL_HBM_DC = 0.80        # A100 (400 W) / V100 SXM2 (300 W) hold ~0.95-1.0 of boost in GEMMs
                          # (public cuBLAS: ~250-270 of 312, ~100-105 of 125 TF/s)
UTIL_HOPPER = 0.64        # H100 / H200 SXM: ~1.7 of 1.98 GHz under the 700 W cap in dense GEMMs
                          # (0.86) x 0.75 (Hopper needs wgmma-pipelined kernels to approach peak)
UTIL_GEFORCE = 0.95       # RTX 3090 / 4090: the FP32-accumulate tensor rate is capped at half the
                          # silicon's rate, so the card stays below its power limit and holds
                          # (often exceeds) the rated boost clock the peak figure uses
UTIL_PRO_300W = 0.70      # RTX A6000 (300 W, full-rate FP32 accumulate): ~1.6 of 1.8 GHz x 0.8
UTIL_LOW_TDP = 0.55       # A10 (150 W) / T4 (70 W) / L4 (72 W): full tensor rate on a small power
                          # budget; ~0.7 of boost under GEMM load x 0.8
UTIL_ADA_DC = 0.60        # L40S (350 W for 362 TF/s dense): power-limited, ~0.75 of boost x 0.8
UTIL_A10G = 0.80          # A10G: a lower rated peak (~70 TF/s) on a 300 W budget holds its clock

# ``flash_attn_eff``: fused attention (fwd + bwd) runs at this share of the GEMM rate. FlashAttention-2
# reaches 50-73% of A100 peak (Dao 2023) against ~80% for GEMMs -> ~0.7 (the default); on Hopper it
# reaches only ~35% of H100 peak (Shah et al. 2024, FlashAttention-3) against ~64% -> 0.55
FLASH_ATTN_EFF_HOPPER = 0.55

# Datasheet figures (dense, no sparsity): tensor bf16/fp16 (FP32 accumulate), TF32, FP8, FP32,
# memory bandwidth, L2, TDP (board power). V100 SXM2, A100 SXM4, H100 SXM5, H200 SXM, A10, L4,
# L40S, T4, RTX A6000 product datasheets; RTX 3090 / 4090 from NVIDIA's Ampere GA102 and Ada
# AD102 architecture whitepapers (GeForce, FP32 accumulate); A10G from AWS g5 documentation and
# nvidia-smi on g5 (300 W cap).
CATALOG: dict[str, GPU] = {g.name: g for g in [
    _G(name="V100-16GB", memory_gib=15.78, bf16_tflops=0, fp16_tflops=125, fp32_tflops=15.7,
       mem_bw_gbs=900, intra_link="nvlink2", intra_link_gbps=NVLINK2_GBPS, inter_node_gbps=400,
       util=UTIL_HBM_DC, l2_mib=6, tdp_w=300),
    _G(name="V100-32GB", memory_gib=31.75, bf16_tflops=0, fp16_tflops=125, fp32_tflops=15.7,
       mem_bw_gbs=900, intra_link="nvlink2", intra_link_gbps=NVLINK2_GBPS, inter_node_gbps=400,
       util=UTIL_HBM_DC, l2_mib=6, tdp_w=300),
    _G(name="A100-40GB", memory_gib=39.59, bf16_tflops=312, fp16_tflops=312, fp32_tflops=19.5, tf32_tflops=156,
       mem_bw_gbs=1555, intra_link="nvlink3", intra_link_gbps=NVLINK3_GBPS, inter_node_gbps=1600,
       util=UTIL_HBM_DC, l2_mib=40, tdp_w=400),
    _G(name="A100-80GB", memory_gib=80.0, bf16_tflops=312, fp16_tflops=312, fp32_tflops=19.5, tf32_tflops=156,
       mem_bw_gbs=2039, intra_link="nvlink3", intra_link_gbps=NVLINK3_GBPS, inter_node_gbps=1600,
       util=UTIL_HBM_DC, l2_mib=40, tdp_w=400),
    _G(name="H100-80GB", memory_gib=79.65, bf16_tflops=989, fp16_tflops=989, fp32_tflops=67, tf32_tflops=495,
       fp8_tflops=1979, mem_bw_gbs=3350, intra_link="nvlink4", intra_link_gbps=NVLINK4_GBPS,
       inter_node_gbps=3200, util=UTIL_HOPPER, l2_mib=50, tdp_w=700,
       flash_attn_eff=FLASH_ATTN_EFF_HOPPER),
    _G(name="H200-141GB", memory_gib=140.4, bf16_tflops=989, fp16_tflops=989, fp32_tflops=67, tf32_tflops=495,
       fp8_tflops=1979, mem_bw_gbs=4800, intra_link="nvlink4", intra_link_gbps=NVLINK4_GBPS,
       inter_node_gbps=3200, util=UTIL_HOPPER, l2_mib=50, tdp_w=700,
       flash_attn_eff=FLASH_ATTN_EFF_HOPPER),
    _G(name="A10-24GB", memory_gib=22.49, bf16_tflops=125, fp16_tflops=125, fp32_tflops=31.2, tf32_tflops=62.5,
       mem_bw_gbs=600, intra_link="pcie4", intra_link_gbps=PCIE4_GBPS, inter_node_gbps=100,
       util=UTIL_LOW_TDP, l2_mib=6, tdp_w=150),
    _G(name="A10G-24GB", memory_gib=22.49, bf16_tflops=70, fp16_tflops=70, fp32_tflops=31.2, tf32_tflops=35,
       mem_bw_gbs=600, intra_link="pcie4", intra_link_gbps=PCIE4_GBPS, inter_node_gbps=100,
       util=UTIL_A10G, l2_mib=6, tdp_w=300),
    _G(name="L4-24GB", memory_gib=22.49, bf16_tflops=121, fp16_tflops=121, fp32_tflops=30.3, tf32_tflops=60,
       fp8_tflops=242, mem_bw_gbs=300, intra_link="pcie4", intra_link_gbps=PCIE4_GBPS, inter_node_gbps=100,
       util=UTIL_LOW_TDP, l2_mib=48, tdp_w=72),
    _G(name="L40S-48GB", memory_gib=44.99, bf16_tflops=362, fp16_tflops=362, fp32_tflops=91.6, tf32_tflops=183,
       fp8_tflops=733, mem_bw_gbs=864, intra_link="pcie4", intra_link_gbps=PCIE4_GBPS, inter_node_gbps=400,
       util=UTIL_ADA_DC, l2_mib=96, tdp_w=350),
    _G(name="T4-16GB", memory_gib=15.0, bf16_tflops=0, fp16_tflops=65, fp32_tflops=8.1,
       mem_bw_gbs=320, intra_link="pcie3", intra_link_gbps=PCIE3_GBPS, inter_node_gbps=50,
       util=UTIL_LOW_TDP, l2_mib=4, tdp_w=70),
    _G(name="RTX3090-24GB", memory_gib=24.0, bf16_tflops=71, fp16_tflops=71, fp32_tflops=35.6, tf32_tflops=35.6,
       mem_bw_gbs=936, intra_link="pcie4", intra_link_gbps=PCIE4_GBPS, inter_node_gbps=25,
       util=UTIL_GEFORCE, l2_mib=6, tdp_w=350, gpu_class="consumer"),
    _G(name="RTX4090-24GB", memory_gib=23.99, bf16_tflops=165, fp16_tflops=165, fp32_tflops=82.6, tf32_tflops=82.6,
       fp8_tflops=330, mem_bw_gbs=1008, intra_link="pcie4", intra_link_gbps=PCIE4_NOP2P_GBPS, inter_node_gbps=25,
       util=UTIL_GEFORCE, l2_mib=72, tdp_w=450, gpu_class="consumer"),
    _G(name="RTXA6000-48GB", memory_gib=47.99, bf16_tflops=155, fp16_tflops=155, fp32_tflops=38.7, tf32_tflops=77.4,
       mem_bw_gbs=768, intra_link="pcie4", intra_link_gbps=PCIE4_GBPS, inter_node_gbps=100,
       util=UTIL_PRO_300W, l2_mib=6, tdp_w=300, gpu_class="workstation"),
    _G(name="CPU", memory_gib=CPU_MEMORY_GIB, bf16_tflops=0.05, fp16_tflops=0.02, fp32_tflops=0.1,
       mem_bw_gbs=20, intra_link="shm", intra_link_gbps=40, inter_node_gbps=10, util=0.3, is_cpu=True,
       gpu_class="cpu"),
]}

GPU_NAMES: tuple[str, ...] = tuple(n for n in CATALOG if n != "CPU")


def make_gpu(name: str, fields: dict[str, Any], *, where: str = "gpu_types") -> GPU:
    """Build a custom GPU type from a cluster file's ``gpu_types`` entry.

    Missing speed figures default sensibly (fp16 = bf16, fp32 = bf16 / 8) so a user can add an
    unknown card with just ``memory_gib`` and ``bf16_tflops``; errors name the field.
    """
    d = dict(fields)
    d["name"] = name
    if "bf16_tflops" in d:
        d.setdefault("fp16_tflops", d["bf16_tflops"] or d.get("fp32_tflops", 0) * 2 or 1.0)
    if "fp16_tflops" in d:
        d.setdefault("bf16_tflops", d["fp16_tflops"])
        d.setdefault("fp32_tflops", max(d["fp16_tflops"] / 8, 0.01))
    d.setdefault("mem_bw_gbs", 500.0)
    try:
        return GPU(**d)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "?"
        raise FrenzyInputError(f"{where}.{name}.{loc}", err["msg"].lower()) from None
    except TypeError as e:  # a non-mapping entry
        raise FrenzyInputError(f"{where}.{name}", f"must be a mapping of GPU fields ({e})") from None


def get_gpu(name: str, extra: dict[str, GPU] | None = None) -> GPU:
    """The GPU type called ``name``: from ``extra`` (a cluster's custom types) first, then the catalog."""
    if extra and name in extra:
        return extra[name]
    try:
        return CATALOG[name]
    except KeyError:
        known = sorted(set(CATALOG) | set(extra or ()))
        raise FrenzyInputError("gpu", f"unknown GPU type {name!r}; known types: {', '.join(known)}") from None


def gpu_names_meant(name: str, extra: dict[str, GPU] | None = None, *, field: str = "gpu") -> list[str]:
    """The GPU types a person may mean by ``name``: the exact name, else the one name equal to
    it ignoring case ('h100-80gb'), else every type whose name before the size suffix is it
    ('H100' -> H100-80GB; 'A100' -> A100-40GB, A100-80GB). ``extra``: a cluster's own types,
    searched with the catalog. Raises FrenzyInputError naming ``field`` when none is."""
    known = {**CATALOG, **(extra or {})}
    if name in known:
        return [name]
    if not isinstance(name, str) or not name.strip():
        raise FrenzyInputError(field, f"must be a GPU type name, got {name!r}")
    key = name.strip().upper()
    same = [n for n in known if n.upper() == key]
    if len(same) == 1:
        return same
    family = sorted(n for n in known if n.upper().split("-")[0] == key)
    if family:
        return family
    raise FrenzyInputError(field, f"unknown GPU type {name!r}; known types: {', '.join(sorted(known))}")


def resolve_gpu_name(name: str, extra: dict[str, GPU] | None = None, *, field: str = "gpu") -> str:
    """The one GPU type a person means by ``name`` (``gpu_names_meant``; 'A100' is ambiguous:
    A100-40GB or A100-80GB). Raises FrenzyInputError naming ``field``."""
    names = gpu_names_meant(name, extra, field=field)
    if len(names) > 1:
        raise FrenzyInputError(field, f"GPU type {name!r} is ambiguous: one of {', '.join(names)}")
    return names[0]


# NVML product names -> catalog names. Ordered: the first matching rule wins. Patterns run on
# the upper-cased name with the vendor words removed ("NVIDIA", "TESLA", "GEFORCE").
_NVML_RULES: list[tuple[str, str | None]] = [
    (r"^H200", "H200-141GB"),
    (r"^H100", "H100-80GB"),          # SXM5 "H100 80GB HBM3", "H100 PCIE" (80 GB)
    (r"^A100.*80GB", "A100-80GB"),
    (r"^A100", "A100-40GB"),          # SXM4-40GB, PCIE-40GB
    (r"^V100S?.*32GB", "V100-32GB"),
    (r"^V100", None),                 # resolved by memory below (16 or 32 GB)
    (r"^A10G\b", "A10G-24GB"),
    (r"^A10\b", "A10-24GB"),
    (r"^L40S\b", "L40S-48GB"),
    (r"^L4\b", "L4-24GB"),
    (r"^T4\b", "T4-16GB"),
    (r"^RTX 3090", "RTX3090-24GB"),
    (r"^RTX 4090", "RTX4090-24GB"),
    (r"^RTX A6000", "RTXA6000-48GB"),
]
_VENDOR = re.compile(r"\b(NVIDIA|TESLA|GEFORCE)\b")


def from_nvml_name(nvml_name: str, memory_gib: float | None = None) -> str | None:
    """Map an NVML product name ("NVIDIA A100-SXM4-80GB") to a catalog name ("A100-80GB").

    ``memory_gib`` (NVML's total) disambiguates names without a size (e.g. "Tesla V100-SXM2").
    Returns None for a GPU the catalog does not know; discovery then makes a custom type.
    """
    s = " ".join(_VENDOR.sub(" ", nvml_name.upper()).split())
    for pattern, target in _NVML_RULES:
        if re.search(pattern, s):
            if target is None:  # V100 without size in the name
                if memory_gib is not None and memory_gib > 20:
                    return "V100-32GB"
                return "V100-16GB"
            return target
    return None
