#!/usr/bin/env bash
# GPU-machine check for scheduler/discover.py and the catalog's NVML name mapping (H2).
# Prints NVML's view, then what local_cluster() builds from it (needs pydantic + pyyaml there).
set -u
nvidia-smi --query-gpu=index,name,memory.total --format=csv
python3 - <<'PY'
import importlib, subprocess, sys
for m in ("pynvml", "pydantic", "yaml", "torch"):
    try:
        importlib.import_module(m); print("have", m)
    except Exception as e:
        print("missing", m, type(e).__name__)
PY
uname -m; python3 --version
python3 - <<'PY'
import sys, time
sys.path.insert(0, ".")
from scheduler.discover import local_cluster, nvml_gpus
print("nvml:", nvml_gpus())
c = local_cluster()
print("cluster:", [(p.name, p.gpu, p.gpus_per_node, p.devices) for p in c.pools])
print("gpu:", c.gpu(c.pools[0].gpu))
try:
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
    for _ in range(3): a @ b
    torch.cuda.synchronize(); t = time.perf_counter(); n = 20
    for _ in range(n): a @ b
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"bf16 8192^3 GEMM: {2 * 8192**3 * n / dt / 1e12:.0f} TFLOP/s (catalog peak {c.gpu(c.pools[0].gpu).bf16_tflops})")
except Exception as e:
    print("torch check skipped:", e)
PY
