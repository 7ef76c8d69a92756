"""Measure real per-GPU training memory on a CUDA device, for checking the estimator.

Self-contained on purpose (torch + transformers only, no Frenzy import): the GPU machine may
lack the project's dependencies. `bench/estimator_accuracy.py --write-configs FILE` writes the
configurations (with each model's ``hf_config()``); this script trains each for 3 optimizer
steps (peaks taken over steps 2-3, when optimizer states exist) and writes, per configuration,
torch.cuda.max_memory_allocated / max_memory_reserved and the device-wide used memory
(NVML-style ``total - free``) right after the steps.

    python bench/estimator_gpu_measure.py CONFIGS.json OUT.json

Regimes: ``amp`` = fp32 model + torch.autocast(bf16) (Accelerate / HF Trainer without
DeepSpeed); ``master`` = bf16 model, AdamW over fp32 master copies (DeepSpeed-style mixed
precision on one GPU); ``fp32`` = plain fp32.
"""
from __future__ import annotations

import gc
import json
import sys
import time


def run_one(cfg: dict, device: str = "cuda") -> dict:
    import torch
    import transformers
    from transformers import AutoConfig

    hf = dict(cfg["hf_config"])
    regime, b, s = cfg["regime"], cfg["micro_batch"], cfg["seq_len"]
    ga = cfg.get("grad_accum", 1)
    c16 = torch.bfloat16
    build_dtype = c16 if regime == "master" else torch.float32
    conf = AutoConfig.for_model(**hf)
    cls = transformers.AutoModelForMaskedLM if hf["model_type"] == "bert" else transformers.AutoModelForCausalLM
    attn = "sdpa" if cfg["attention"] == "flash" else "eager"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(build_dtype)
    try:
        with torch.device(device):
            model = cls.from_config(conf, attn_implementation=attn)
    finally:
        torch.set_default_dtype(prev)
    model.train()
    if cfg["act_ckpt"] == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    opt_params = [p.detach().float() for p in params] if regime == "master" else params
    name = cfg["optimizer"]
    if name in ("adamw", "adam"):
        opt = (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(opt_params, lr=1e-5)
    elif name == "sgd":
        opt = torch.optim.SGD(opt_params, lr=1e-4, momentum=0.9)
    else:
        from transformers.optimization import Adafactor
        opt = Adafactor(opt_params, lr=1e-4, relative_step=False, scale_parameter=False)
    vocab = hf.get("vocab_size")
    ids = torch.randint(0, vocab, (b, s), device=device)
    times = []
    for step in range(3):
        if step == 1:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(ga):
            with torch.autocast("cuda", dtype=c16, enabled=regime == "amp"):
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            del out
        if regime == "master":
            for p, m in zip(params, opt_params):
                m.grad = p.grad.float()
            opt.step()
            with torch.no_grad():
                for p, m in zip(params, opt_params):
                    p.copy_(m)
                    m.grad = None
                    p.grad = None
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    free, total = torch.cuda.mem_get_info()
    res = dict(allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
               reserved_gib=torch.cuda.max_memory_reserved() / 2**30,
               device_used_gib=(total - free) / 2**30, step_s=min(times[1:]),
               num_alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0))
    del model, opt, params, opt_params, ids
    gc.collect()
    torch.cuda.empty_cache()
    return res


def main(argv: list[str]) -> int:
    import torch
    configs = json.load(open(argv[0]))
    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    header = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  total_gib=total / 2**30, context_gib=(total - free) / 2**30)
    import transformers
    header["transformers"] = transformers.__version__
    print(json.dumps(header), flush=True)
    results = []
    for cfg in configs:
        t0 = time.perf_counter()
        try:
            r = run_one(cfg)
        except torch.cuda.OutOfMemoryError as err:
            r = {"error": f"OOM: {str(err)[:200]}"}
        except Exception as err:  # noqa: BLE001 - record and go on
            r = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        gc.collect()
        torch.cuda.empty_cache()
        r["wall_s"] = time.perf_counter() - t0
        results.append({"config": {k: v for k, v in cfg.items() if k != "hf_config"}, **r})
        print(json.dumps(results[-1]), flush=True)
        json.dump({"header": header, "results": results}, open(argv[1], "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
