"""GPU catalog: names, units, NVML mapping, custom types."""
import pytest

from estimator.catalog import CATALOG, GPU_NAMES, from_nvml_name, get_gpu, make_gpu
from estimator.errors import FrenzyInputError

ISSUE_NAMES = ["V100-16GB", "V100-32GB", "A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB",
               "A10-24GB", "A10G-24GB", "L4-24GB", "L40S-48GB", "T4-16GB", "RTX3090-24GB",
               "RTX4090-24GB", "RTXA6000-48GB"]


def test_every_issue_name_is_in_the_catalog_with_its_memory():
    assert set(ISSUE_NAMES) == set(GPU_NAMES)
    for name in ISSUE_NAMES:
        g = get_gpu(name)
        nominal = int(name.rsplit("-", 1)[1].removesuffix("GB"))
        # NVML totals sit slightly below the marketing figure (GB vs GiB, reserved pages)
        assert 0.9 * nominal <= g.memory_gib <= nominal + 0.01, name
        assert g.fp16_tflops > g.fp32_tflops > 0


def test_speed_ordering_matches_generations():
    assert get_gpu("H100-80GB").peak_tflops("bf16") > get_gpu("A100-80GB").peak_tflops("bf16") \
        > get_gpu("RTX3090-24GB").peak_tflops("bf16")
    assert get_gpu("H200-141GB").mem_bw_gbs > get_gpu("H100-80GB").mem_bw_gbs


def test_bf16_falls_back_to_fp32_on_cards_without_it():
    v100 = get_gpu("V100-32GB")
    assert not v100.supports_bf16
    assert v100.peak_tflops("bf16") == v100.fp32_tflops
    assert v100.peak_tflops("fp16") == 125


def test_cpu_pseudo_type():
    cpu = get_gpu("CPU")
    assert cpu.is_cpu and cpu.memory_gib > 0 and cpu.peak_tflops("fp32") < 1


def test_unknown_name_lists_known_types():
    with pytest.raises(FrenzyInputError) as e:
        get_gpu("B200-192GB")
    assert e.value.field == "gpu" and "A100-80GB" in str(e.value) and "B200-192GB" in str(e.value)


def test_extra_types_take_precedence():
    b200 = make_gpu("B200-192GB", {"memory_gib": 178, "bf16_tflops": 2250})
    assert get_gpu("B200-192GB", {"B200-192GB": b200}).memory_gib == 178
    assert b200.fp16_tflops == 2250 and b200.fp32_tflops > 0


def test_make_gpu_names_the_bad_field():
    with pytest.raises(FrenzyInputError) as e:
        make_gpu("X", {"memory_gib": -1, "bf16_tflops": 10})
    assert e.value.field == "gpu_types.X.memory_gib"


@pytest.mark.parametrize("nvml,expected", [
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA H200", "H200-141GB"), ("Tesla V100-SXM2-16GB", "V100-16GB"),
    ("Tesla V100S-PCIE-32GB", "V100-32GB"), ("NVIDIA A10G", "A10G-24GB"), ("NVIDIA A10", "A10-24GB"),
    ("NVIDIA L4", "L4-24GB"), ("NVIDIA L40S", "L40S-48GB"), ("Tesla T4", "T4-16GB"),
    ("NVIDIA GeForce RTX 3090", "RTX3090-24GB"), ("NVIDIA GeForce RTX 4090", "RTX4090-24GB"),
    ("NVIDIA RTX A6000", "RTXA6000-48GB"), ("Quadro RTX 8000", None),
])
def test_nvml_names(nvml, expected):
    assert from_nvml_name(nvml) == expected


def test_nvml_v100_without_size_uses_memory():
    assert from_nvml_name("Tesla V100-SXM2", memory_gib=31.7) == "V100-32GB"
    assert from_nvml_name("Tesla V100-SXM2", memory_gib=15.7) == "V100-16GB"
    assert all(CATALOG[n].name == n for n in CATALOG)


def test_a_custom_types_link_is_a_known_family_in_any_case():
    """'NVLink4' was timed as PCIe (the model credits only 'nvlink...'), 'warp' was taken."""
    import pytest
    from pydantic import ValidationError

    from estimator.catalog import GPU
    kw = dict(name="X1", memory_gib=80, bf16_tflops=900, fp16_tflops=900, fp32_tflops=60, mem_bw_gbs=3000,
              intra_link_gbps=3600)
    assert GPU(**kw, intra_link="NVLink4").intra_link == "nvlink4"
    for bad in ("warp", "nv-link", ""):
        with pytest.raises(ValidationError):
            GPU(**kw, intra_link=bad)
    with pytest.raises(ValidationError):
        GPU(**kw, gpu_class="gaming")
