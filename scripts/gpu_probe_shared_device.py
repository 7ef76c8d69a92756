"""Which collectives two processes can run on ONE GPU: the question behind measuring a tp=2 or
pp=2 plan's per-rank memory on a machine with a single GPU.

    python scripts/gpu_probe_shared_device.py        # prints one line per (backend, collective)

NCCL refuses two ranks on one device ("Duplicate GPU detected"); gloo moves CUDA tensors for some
collectives and not others; the "fake" backend (torch.testing's FakeStore) runs one rank alone with
no-op collectives, which is how torchtitan estimates multi-GPU memory on one device. Each probe
runs in a fresh pair of processes with a timeout, so a hang or a crash is reported, not inherited.
"""
from __future__ import annotations

import os
import sys
import traceback

PROBES = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
          "send_recv")


def one_collective(probe: str, rank: int, dist, torch) -> bool:
    x = torch.full((4,), float(rank + 1), device="cuda")
    if probe == "all_reduce":
        dist.all_reduce(x)
        return x.tolist() == [3.0] * 4
    if probe == "broadcast":
        dist.broadcast(x, src=0)
        return x.tolist() == [1.0] * 4
    if probe == "all_gather_into_tensor":
        out = torch.empty(8, device="cuda")
        dist.all_gather_into_tensor(out, x)
        return out.tolist() == [1.0] * 4 + [2.0] * 4
    if probe == "reduce_scatter_tensor":
        out = torch.empty(2, device="cuda")
        dist.reduce_scatter_tensor(out, x)
        return out.tolist() == [3.0] * 2
    if probe == "all_to_all_single":
        out = torch.empty(4, device="cuda")
        dist.all_to_all_single(out, x)
        return out.tolist() == [1.0, 1.0, 2.0, 2.0]
    if rank == 0:                                 # send_recv
        dist.send(x, dst=1)
        return True
    dist.recv(x, src=0)
    return x.tolist() == [1.0] * 4


def run_probes(rank: int, backend: str, probes: tuple[str, ...], port: int, q) -> None:
    """Both ranks on cuda:0; one answer per probe (an exception is the probe's answer)."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=rank, world_size=2)
    except Exception as e:
        q.put((rank, "init", f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"))
        return
    for probe in probes:
        try:
            ok = one_collective(probe, rank, dist, torch)
            torch.cuda.synchronize()
            q.put((rank, probe, "ok" if ok else "WRONG RESULT"))
        except Exception as e:
            q.put((rank, probe, f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"))
    dist.destroy_process_group()


def probe_backend(backend: str, probes: tuple[str, ...], port: int, timeout_s: float = 40.0) -> dict[str, str]:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=run_probes, args=(r, backend, probes, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
    got: dict[str, dict[int, str]] = {}
    while not q.empty():
        r, probe, a = q.get()
        got.setdefault(probe, {})[r] = a
    res = {k: v[0] if v.get(0) == v.get(1) else str(v) for k, v in got.items()}
    for probe in probes:
        res.setdefault(probe, f"no answer (hung after {timeout_s:.0f} s)" if hung else "not reached")
    return res


def fake_backend() -> str:
    """One rank of a world of 2 alone, with torch's fake process group and CUDA tensors."""
    try:
        import torch
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        out = torch.empty(8, device="cuda")
        dist.all_gather_into_tensor(out, x)
        dist.destroy_process_group()
        return "ok (collectives are no-ops: memory is real, values are not)"
    except Exception:
        return traceback.format_exc(limit=1).strip().splitlines()[-1][:200]


def main() -> int:
    import torch
    if not torch.cuda.is_available():
        print("gpu_probe_shared_device: no CUDA device", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, NCCL {torch.cuda.nccl.version()}")
    # NCCL: one collective says it (a duplicate device is refused at the communicator's creation)
    for port, (backend, probes) in enumerate((("nccl", ("all_reduce",)), ("gloo", PROBES)), start=29611):
        for probe, answer in probe_backend(backend, probes, port).items():
            print(f"{backend:5s} {probe:24s} {answer}", flush=True)
    print(f"fake  one rank of 2              {fake_backend()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
