"""The training program that ``accelerate launch`` runs on every rank.

    accelerate launch --config_file <run>/accelerate.yaml -m trainer.train --run-dir <run>

It reads ``<run>/train_spec.json`` (plain JSON written by ``trainer.launch_config``: the Hugging
Face config of the model or the folder of its pretrained weights, fine-tune method, data and eval
split, batch geometry, optimizer and schedule, the plan), builds the model (``trainer.modeling``:
from the config, from pretrained weights, or the user's ``module:function``; LoRA/QLoRA adapters
through PEFT), trains with Accelerate (DeepSpeed ZeRO when the plan says so), evaluates every N
steps, checkpoints with ``save_state`` every N steps and at the end, resumes from the newest
checkpoint (or the one ``resume_from`` names), acts on the control file between optimizer steps
(``trainer.control``: stop with a checkpoint, or export), exports the result in Hugging Face
format, and speaks to the runner in single lines:

    FRENZY_MODEL {"params": 108608, "trainable_params": 1792, "optimizer_impl": "torch.optim.AdamW(fused)", ...}
    FRENZY_RESUME {"step": 4, "mode": "full"}
    FRENZY_STEP {"step": 5, "loss": 5.41, "step_time_s": 0.12, "tokens": 1024, "lr": 0.0003, "grad_norm": 1.57}
    FRENZY_EVAL {"step": 5, "loss": 5.30, "sequences": 16}
    FRENZY_CHECKPOINT {"step": 6, "dir": "...", "save_s": 0.05}
    FRENZY_EXPORT {"step": 8, "dir": "...", "request_id": null}
    FRENZY_STOPPED {"step": 6, "reason": "resize", "request_id": "r-17"}
    FRENZY_RESULT {"steps": 8, "step_time_s": ..., "tokens_per_s": ..., "memory_measured": false, ...}
    FRENZY_OOM {"step": 3, "rank": 0, "injected": true}
    FRENZY_ERROR {"type": "ValueError", "message": "...", "transient": false}

Rank and world come from the launcher's environment (RANK / WORLD_SIZE), not from Accelerate's
state: on CPU, Accelerate's DeepSpeed path reports every rank as process 0 of 1 (accelerate 1.15).
Imports only torch, transformers, accelerate, peft (+ deepspeed for ZeRO): no pydantic models, no
prefect, so it runs on a bare GPU box from a checkout.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from trainer.problems import InputProblem

GIB = 1024 ** 3


def emit(tag: str, payload: dict[str, Any]) -> None:
    print(f"{tag} {json.dumps(payload, separators=(', ', ': '))}", flush=True)


def dist_info() -> tuple[int, int, int]:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return rank, world, local


# ---------------------------------------------------------------------------------------- model
def apply_activation_checkpointing(model, mode: str) -> str:
    """``full``: recompute every block (HF gradient checkpointing). ``selective``: recompute only
    the attention sub-modules (the part whose activations grow fastest), as Megatron's selective
    recomputation does. Returns what was applied."""
    if mode == "none":
        return "none"
    import torch.utils.checkpoint as ckpt

    if mode == "selective":
        wrapped = 0
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("attn", "self_attn", "attention") and hasattr(module, "forward"):
                orig = module.forward

                def fwd(*args, __orig=orig, **kwargs):
                    return ckpt.checkpoint(__orig, *args, use_reentrant=False, **kwargs)

                module.forward = fwd
                wrapped += 1
        if wrapped:
            return f"selective ({wrapped} attention modules)"
    if getattr(model, "supports_gradient_checkpointing", False):
        # newer transformers renamed it; the GPU box may carry an older release
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return "full"
    return "none (model does not support it)"


# -------------------------------------------------------------------------------- measurement
class MemoryProbe:
    """Peak allocated/reserved from torch's caching allocator and the device's NVML used memory."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.nvml = None
        self.nvml_peak = 0.0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            try:
                import pynvml

                pynvml.nvmlInit()
                uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
                if uuid is not None:
                    self.nvml = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
                else:  # pragma: no cover - old torch
                    vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
                    self.nvml = pynvml.nvmlDeviceGetHandleByIndex(int(vis[device.index or 0]))
            except Exception as e:  # NVML missing: allocator peaks are still measured
                print(f"frenzy: NVML unavailable ({e}); device used memory not measured", flush=True)
                self.nvml = None

    def sample(self) -> None:
        if self.nvml is not None:
            import pynvml

            self.nvml_peak = max(self.nvml_peak, pynvml.nvmlDeviceGetMemoryInfo(self.nvml).used / GIB)

    def result(self) -> dict[str, Any]:
        if not self.cuda:
            return {"memory_measured": False}
        import torch

        self.sample()
        return {"memory_measured": True, "allocator": allocator_mode(),
                "allocated_peak_gib": torch.cuda.max_memory_allocated(self.device) / GIB,
                "reserved_peak_gib": torch.cuda.max_memory_reserved(self.device) / GIB,
                "nvml_used_gib": self.nvml_peak if self.nvml is not None else None}


def allocator_mode() -> str:
    """The caching allocator's segment mode this process runs (torch reads PYTORCH_ALLOC_CONF,
    and the older PYTORCH_CUDA_ALLOC_CONF): "expandable" or "default" (the estimator's
    ``allocator`` knob; ``frenzy calibrate`` fits each mode's fragmentation apart)."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    return "expandable" if "expandable_segments:true" in conf.replace(" ", "").lower() else "default"


# ----------------------------------------------------------------------------------- training
def _all_reduce_sum(t):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def begin_step(step: int, steps: int, spec: dict[str, Any], inject_at: int | None) -> float:
    """The start of an optimizer step in every training loop: the rehearsed out-of-memory
    failure (``FRENZY_INJECT_OOM_AT_STEP``) when due, else the step's learning rate."""
    import torch

    from trainer.optim import lr_at

    if inject_at is not None and step == inject_at:
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. (rehearsal injected by FRENZY_INJECT_OOM_AT_STEP={inject_at} at step {step})")
    return lr_at(step, spec["lr"], steps, spec.get("schedule"))


def sync_step(run_dir: Path, main: bool, loss_sum, device):
    """One collective per step: the loss (summed over ranks) and rank 0's control request (only
    rank 0 contributes it), so every rank acts on it after this same step. Returns rank 0's
    request (None elsewhere) and the reduced ``[loss_sum, action code]``."""
    import torch

    from trainer import control

    req = control.read_request(run_dir) if main else None
    code = 0
    if req is not None:
        code = control.ACTION_CODES[req["action"]] | (control.ACTION_CODES["export"] if req.get("export") else 0)
    return req, _all_reduce_sum(torch.stack([loss_sum, torch.tensor(float(code), device=device)]))


def evaluate(model, source, *, count: int, mb: int, rank: int, world: int, device) -> float:
    """Mean token loss over held-out sequences ``0..count-1`` of ``source``, split over ranks.
    Every rank runs the same number of forwards (ZeRO-3 gathers parameters collectively in each
    one); a rank with no sequence left runs a padding batch that is weighted 0."""
    import torch

    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    rounds = math.ceil(count / (mb * world))
    with torch.no_grad():
        for r in range(rounds):
            first = (r * world + rank) * mb
            n = max(0, min(mb, count - first))
            x = source.batch(first if n else 0, n or 1).to(device)
            out = model(input_ids=x, labels=x)
            loss = out.loss if hasattr(out, "loss") else out
            tokens = n * (x.shape[1] - 1)              # labels are shifted by one inside the model
            totals[0] += loss.detach().double() * tokens
            totals[1] += tokens
    _all_reduce_sum(totals)
    if was_training:
        model.train()
    return float(totals[0] / totals[1])


def check_device(plan: dict[str, Any], device_type: str) -> None:
    """A plan for a GPU type runs on a GPU or not at all: on a machine without one (a control
    machine, a worker of the wrong pool) it would train on the CPU and be reported as done on
    that GPU type, with its measurements stored as that type's. Not transient: a retry on the
    same machine finds no GPU either."""
    gpu = str(plan.get("gpu_type", ""))
    if gpu.upper() != "CPU" and device_type == "cpu":
        raise InputProblem(f"plan.gpu_type: the plan is for {gpu} but this machine gives the training no GPU "
                           f"(device=cpu, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}); "
                           f"it runs only on a worker of a {gpu} pool")


def without_deepspeed_unless_planned(spec: dict[str, Any]) -> None:
    """A plan that does not run under DeepSpeed runs as if DeepSpeed were not installed: Accelerate
    and transformers check whether it is installed and then import it for an isinstance test
    (``save_pretrained`` of the export unwraps the model that way); that import, which pulls in
    MLflow, took 2.7-2.9 s on rank 0 of a tiny CPU run on 2 cores, longer than its training.
    Call before Accelerate is imported. ``allow_deepspeed`` lifts it (a resume that consolidates
    a ZeRO checkpoint). A user's entry point may import DeepSpeed itself: its runs keep it."""
    from trainer.parallel import uses_deepspeed

    if not uses_deepspeed(spec["plan"]) and not spec.get("entry_point"):
        sys.modules.setdefault("deepspeed", None)   # importlib.util.find_spec then answers None


def allow_deepspeed() -> None:
    if "deepspeed" in sys.modules and sys.modules["deepspeed"] is None:
        del sys.modules["deepspeed"]


def train(run_dir: Path) -> None:
    spec = json.loads((run_dir / "train_spec.json").read_text())
    without_deepspeed_unless_planned(spec)
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    from trainer import checkpoints as ck
    from trainer import control
    from trainer.data import TokenSource, eval_source
    from trainer.modeling import add_adapters, build_model, count_params, export, uses_adapters
    from trainer.optim import make_optimizer
    from trainer.parallel import layout_of, plan_world, uses_deepspeed, without_partitioned_build

    plan = spec["plan"]
    rank, world, _local = dist_info()
    main = rank == 0
    attempt = int(os.environ.get("FRENZY_ATTEMPT", "1"))
    inject = os.environ.get("FRENZY_INJECT_OOM_AT_STEP")
    inject_at = int(inject) if inject and attempt == 1 else None
    deepspeed = uses_deepspeed(plan)
    check_device(plan, "cuda" if torch.cuda.is_available() else "cpu")   # before DeepSpeed looks for one
    mb, ga, dp = plan["micro_batch"], plan["grad_accum"], plan["dp"]
    if world != plan_world(plan):
        raise InputProblem(f"plan.gpus: dp x tp x pp x cp = {plan_world(plan)} but the launcher started {world} processes")
    if int(plan.get("pp", 1)) > 1:
        return train_pipelined(run_dir, spec, rank, world, attempt, inject_at)
    # data is indexed by data-parallel rank: the ranks of a tensor-parallel group share a batch
    lay = layout_of(plan, rank)
    dp_rank = lay.dp_rank
    G, seq_len, steps = spec["global_batch"], spec["seq_len"], spec["steps"]
    if mb * ga * dp != G:
        raise InputProblem(f"plan: micro_batch {mb} x grad_accum {ga} x dp {dp} != global_batch {G}")
    optim = spec.get("optim", {})
    clip = optim.get("grad_clip", 1.0)

    torch.manual_seed(spec["seed"])
    # created first: under ZeRO-3 it makes from_pretrained/from_config build partitioned (zero.Init)
    from trainer.parallel import ulysses

    accelerator = (Accelerator(**ulysses.accelerator_kwargs(lay.cp, seq_len)) if deepspeed
                   else Accelerator(gradient_accumulation_steps=ga))
    device = accelerator.device
    check_device(plan, device.type)
    vocab = int(spec["hf_config"].get("vocab_size", 256))
    # an eval fraction holds the last sequences of the training data out of training
    source = TokenSource(spec["data"], seq_len=seq_len, vocab=vocab, seed=spec["seed"],
                         holdout=(spec.get("eval") or {}).get("fraction"))
    held_out = eval_source(spec, vocab=vocab)
    eval_count = min(len(held_out), spec["eval"]["max_sequences"]) if held_out is not None else 0
    eval_every = (spec.get("eval") or {}).get("every")

    with without_partitioned_build(accelerator, plan):
        model = build_model(spec, device)
    applied = apply_activation_checkpointing(model, plan.get("act_ckpt", "none"))
    model = add_adapters(model, spec, act_ckpt=plan.get("act_ckpt", "none") != "none")
    adapters = uses_adapters(spec)
    params, trainable = count_params(model)
    fmt = {**ck.state_format(zero=plan["zero"], world=world, offload=plan.get("offload", "none"),
                             tp=lay.tp, deepspeed=deepspeed, cp=lay.cp),
           "adapters_only": adapters}
    latest = ck.latest_checkpoint(run_dir)
    if latest is None and spec.get("resume_from"):
        latest = ck.read_checkpoint(spec["resume_from"])      # a resubmission continues another run
    resume_mode = None
    if latest is not None and not ck.full_resume_possible(latest.meta.get("format", {}), fmt):
        load_weights_only(model, latest)          # before prepare: DeepSpeed then shards them
        resume_mode = "weights"
    optimizer, optimizer_impl = make_optimizer(plan.get("optimizer", "adamw"), model, lr=spec["lr"], optim=optim,
                                               device_type=device.type, zero=plan["zero"],
                                               offload=plan.get("offload", "none"))
    if lay.cp > 1:
        ulysses.prepare_model(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    # LoRA checkpoints hold the adapters and their optimizer state, not a copy of the frozen base
    save_kw: dict[str, Any] = {}
    load_kw: dict[str, Any] = {}
    if adapters:
        if deepspeed:
            save_kw, load_kw = {"exclude_frozen_parameters": True}, {"load_module_strict": False}
        else:
            register_adapter_state(accelerator, accelerator.unwrap_model(model), main)
    if latest is not None and resume_mode is None:
        accelerator.load_state(str(latest.path), **load_kw)
        resume_mode = "full"
    if latest is not None:
        # Accelerate counts micro-batches to place gradient-accumulation boundaries and restores
        # the count of the saving plan; a relaunch with another grad_accum (2 ranks x 1 -> 1 rank
        # x 2) would sync in mid step. Count the finished steps in this plan's micro-batches.
        accelerator.step = latest.step * ga
    start = latest.step if latest is not None else 0
    if main:
        print(f"frenzy: rank 0/{world} device={device} plan={plan['gpu_type']} dp={dp} tp={lay.tp} cp={lay.cp} zero={plan['zero']} "
              f"act_ckpt={applied} micro_batch={mb} grad_accum={ga} attempt={attempt} "
              f"finetune={spec.get('finetune', {}).get('method', 'full')} optimizer={optimizer_impl}", flush=True)
        if (coverage := source.coverage(steps, G)) is not None:
            print(f"frenzy: {coverage}", flush=True)
        emit("FRENZY_MODEL", {"params": params, "trainable_params": trainable, "optimizer_impl": optimizer_impl,
                              "finetune": spec.get("finetune", {}).get("method", "full"),
                              "init_from": spec.get("init_from")})
        if latest is not None:
            emit("FRENZY_RESUME", {"step": start, "mode": resume_mode, "from": str(latest.path)})

    def run_eval(step: int) -> None:
        if held_out is None:
            return
        t0 = time.perf_counter()
        loss = evaluate(model, held_out, count=eval_count, mb=mb, rank=dp_rank, world=dp, device=device)
        if main:
            emit("FRENZY_EVAL", {"step": step, "loss": round(loss, 6), "sequences": eval_count,
                                 "eval_time_s": round(time.perf_counter() - t0, 4)})

    def run_export(step: int, out: Path, request_id: str | None = None) -> None:
        where = export(accelerator, model, spec, out, step=step, main=main)
        accelerator.wait_for_everyone()
        if main and where is not None:
            emit("FRENZY_EXPORT", {"step": step, "dir": str(where), "request_id": request_id})

    probe = MemoryProbe(device)
    step_times: list[float] = []
    tokens_per_step = G * seq_len
    stopped: dict[str, Any] | None = None
    for step in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        lr = begin_step(step, steps, spec, inject_at)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        norm = None                  # the global gradient norm the clipping saw (the program's own clipping)
        for j in range(ga):
            first = (step - 1) * G + (j * dp + dp_rank) * mb
            x = source.batch(first, mb).to(device)
            with accelerator.accumulate(model):
                if lay.cp > 1:
                    loss = ulysses.loss(model, x, vocab=vocab)
                else:
                    out = model(input_ids=x, labels=x)
                    loss = out.loss if hasattr(out, "loss") else out
                accelerator.backward(loss)
                if not deepspeed and clip and accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            loss_sum += loss.detach().float()
        req, packed = sync_step(run_dir, main, loss_sum, device)
        mean_loss = float(packed[0]) / (ga * world)
        code = int(round(float(packed[1])))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        probe.sample()
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"loss is {mean_loss} at step {step}")
        if main:
            emit("FRENZY_STEP", {"step": step, "total": steps, "loss": round(mean_loss, 6),
                                 "step_time_s": round(dt, 6), "tokens": tokens_per_step, "lr": lr,
                                 **grad_norm_field(norm)})
        stop = bool(code & control.ACTION_CODES["stop"])
        export_now = bool(code & control.ACTION_CODES["export"])
        if step % spec["checkpoint_every"] == 0 or step == steps or stop:
            save_checkpoint(accelerator, run_dir, step, fmt, main, save_kw,
                            model=model if lay.tp > 1 and not adapters else None)
        if (eval_every and step % eval_every == 0 and step != steps) or (stop and export_now):
            run_eval(step)
        if export_now and not stop:
            run_export(step, run_dir / "exports" / f"step-{step:08d}", req["request_id"] if req else None)
        if main and req is not None:
            control.acknowledge(run_dir, req, step)
        if stop:
            stopped = {"step": step, "reason": req["reason"] if req else "", "request_id": req["request_id"] if req else ""}
            if export_now and spec.get("export", {}).get("enabled", True):
                run_export(step, Path(spec["export"]["dir"]))
            break
    if stopped is None:
        run_eval(steps)
        if spec.get("export", {}).get("enabled", True):
            run_export(steps, Path(spec["export"]["dir"]))

    # Measurements: every rank's peaks, gathered to rank 0.
    mine = {"rank": rank, **probe.result()}
    ranks = [mine]
    if dist.is_available() and dist.is_initialized():
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
    if main:
        timed = step_times[1:] or step_times          # the first step pays warm-up
        st = statistics.median(timed) if timed else 0.0
        result: dict[str, Any] = {"steps": steps, "resumed_from": start, "steps_run": len(step_times),
                                  "step_time_s": st, "tokens_per_s": tokens_per_step / st if st else 0.0,
                                  "memory_measured": all(r.get("memory_measured") for r in ranks),
                                  "params": params, "trainable_params": trainable,
                                  "optimizer_impl": optimizer_impl, "per_rank": ranks}
        if result["memory_measured"]:
            for key in ("allocated_peak_gib", "reserved_peak_gib", "nvml_used_gib"):
                vals = [r[key] for r in ranks if r.get(key) is not None]
                result[key] = max(vals) if vals else None
            result["allocator"] = ranks[0].get("allocator")
        if stopped is not None:
            result["stopped"] = stopped
            emit("FRENZY_STOPPED", stopped)
        emit("FRENZY_RESULT", result)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if dist.is_available() and dist.is_initialized():
        # gloo's worker threads still running at interpreter exit abort the process
        # ("terminate called without an active exception", SIGABRT) after a finished run
        dist.destroy_process_group()
    if os.environ.get("FRENZY_INJECT_ABORT_AT_EXIT"):     # rehearsal: a crash while tearing down
        os.abort()


def train_pipelined(run_dir: Path, spec: dict[str, Any], rank: int, world: int, attempt: int,
                    inject_at: int | None) -> None:
    """The ``pp > 1`` path (``trainer.parallel.pipeline``): the same data order, control file,
    checkpoints and FRENZY lines as ``train``, with the model cut into stages instead of
    Accelerate's engines."""
    import torch
    import torch.distributed as dist

    from trainer import checkpoints as ck
    from trainer import control
    from trainer.data import TokenSource
    from trainer.modeling import build_model, count_params
    from trainer.optim import make_optimizer
    from trainer.parallel import pipeline

    plan = spec["plan"]
    main = rank == 0
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and str(plan.get("gpu_type", "")).upper() != "CPU"
    device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    check_device(plan, device.type)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    lay = pipeline.pipe_layout(plan, rank)
    mb, ga, dp = int(plan["micro_batch"]), int(plan["grad_accum"]), lay.dp
    G, seq_len, steps = spec["global_batch"], spec["seq_len"], spec["steps"]
    if mb * ga * dp != G:
        raise InputProblem(f"plan: micro_batch {mb} x grad_accum {ga} x dp {dp} != global_batch {G}")
    optim = spec.get("optim", {})
    clip = optim.get("grad_clip", 1.0)
    torch.manual_seed(spec["seed"])
    vocab = int(spec["hf_config"].get("vocab_size", 256))
    source = TokenSource(spec["data"], seq_len=seq_len, vocab=vocab, seed=spec["seed"],
                         holdout=(spec.get("eval") or {}).get("fraction"))
    model = build_model(spec, torch.device("cpu"))
    pipeline.check_pipeline(spec, model)
    params, trainable = count_params(model)
    model.train()
    fmt = {**ck.state_format(zero=int(plan.get("zero", 0)), world=world, offload="none", tp=lay.tp, deepspeed=False),
           "pp": lay.pp,
           "vpp": int(plan.get("vpp", 1)), "adapters_only": False}
    latest = ck.latest_checkpoint(run_dir)
    if latest is None and spec.get("resume_from"):
        latest = ck.read_checkpoint(spec["resume_from"])
    resume_mode = None
    if latest is not None and not ck.full_resume_possible(latest.meta.get("format", {}), fmt):
        load_weights_only(model, latest)             # another layout's full weights, before the split
        resume_mode = "weights"

    def optimizer_for(module):
        return make_optimizer(plan.get("optimizer", "adamw"), module, lr=spec["lr"], optim=optim,
                              device_type=device.type, zero=0, offload="none")

    pipe = pipeline.Pipeline(model, plan, rank, device, optimizer_for)
    del model                                         # this rank keeps its stage only
    if latest is not None and resume_mode is None:
        pipe.load(latest.path)
        resume_mode = "full"
    start = latest.step if latest is not None else 0
    if main:
        print(f"frenzy: rank 0/{world} device={device} plan={plan['gpu_type']} dp={dp} pp={lay.pp} vpp={pipe.vpp} zero={pipe.zero} tp={lay.tp} "
              f"micro_batch={mb} grad_accum={ga} attempt={attempt} schedule={type(pipe.schedule).__name__} "
              f"optimizer={pipe.optimizer_impl}", flush=True)
        if (coverage := source.coverage(steps, G)) is not None:
            print(f"frenzy: {coverage}", flush=True)
        emit("FRENZY_MODEL", {"params": params, "trainable_params": trainable, "optimizer_impl": pipe.optimizer_impl,
                              "finetune": "full", "init_from": spec.get("init_from")})
        if latest is not None:
            emit("FRENZY_RESUME", {"step": start, "mode": resume_mode, "from": str(latest.path)})

    def save(step: int) -> None:
        path = ck.checkpoint_path(run_dir, step)
        t0 = time.perf_counter()
        dist.barrier()
        pipe.save(path)
        dist.barrier()                                # every stage has written its file
        if main:
            pipeline.consolidate(path, lay.pp, ck.CONSOLIDATED)
            (path / ck.MARKER).write_text(json.dumps({"step": step, "format": fmt, "time": time.time()}))
            ck.prune(run_dir, keep=2)
            emit("FRENZY_CHECKPOINT", {"step": step, "dir": str(path), "save_s": round(time.perf_counter() - t0, 4)})
        dist.barrier()

    probe = MemoryProbe(device)
    step_times: list[float] = []
    tokens_per_step = G * seq_len
    stopped: dict[str, Any] | None = None
    for step in range(start + 1, steps + 1):
        t0 = time.perf_counter()
        lr = begin_step(step, steps, spec, inject_at)
        # the data-parallel rank's micro-batches, in the order a single process accumulates them
        x = torch.cat([source.batch((step - 1) * G + (j * dp + lay.dp_rank) * mb, mb) for j in range(ga)]).to(device)
        loss_sum = pipe.step(x, clip, lr)
        req, packed = sync_step(run_dir, main, loss_sum, device)
        mean_loss = float(packed[0]) / (ga * dp)     # only the last stages hold losses
        code = int(round(float(packed[1])))
        if cuda:
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        step_times.append(dt)
        probe.sample()
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"loss is {mean_loss} at step {step}")
        if main:
            emit("FRENZY_STEP", {"step": step, "total": steps, "loss": round(mean_loss, 6),
                                 "step_time_s": round(dt, 6), "tokens": tokens_per_step, "lr": lr,
                                 **grad_norm_field(pipe.grad_norm)})
        stop = bool(code & control.ACTION_CODES["stop"])
        if step % spec["checkpoint_every"] == 0 or step == steps or stop:
            save(step)
        if main and req is not None:
            control.acknowledge(run_dir, req, step)
        if stop:
            stopped = {"step": step, "reason": req["reason"] if req else "", "request_id": req["request_id"] if req else ""}
            break
    if spec.get("export", {}).get("enabled", True) and main:
        print("frenzy: export skipped: a pipeline-parallel run leaves its full weights in the last "
              "checkpoint's consolidated.safetensors", flush=True)
    mine = {"rank": rank, **probe.result()}
    ranks: list[Any] = [None] * world
    dist.all_gather_object(ranks, mine)
    if main:
        timed = step_times[1:] or step_times
        st = statistics.median(timed) if timed else 0.0
        result: dict[str, Any] = {"steps": steps, "resumed_from": start, "steps_run": len(step_times),
                                  "step_time_s": st, "tokens_per_s": tokens_per_step / st if st else 0.0,
                                  "memory_measured": all(r.get("memory_measured") for r in ranks),
                                  "params": params, "trainable_params": trainable,
                                  "optimizer_impl": pipe.optimizer_impl, "per_rank": ranks}
        if result["memory_measured"]:
            for key in ("allocated_peak_gib", "reserved_peak_gib", "nvml_used_gib"):
                vals = [r[key] for r in ranks if r.get(key) is not None]
                result[key] = max(vals) if vals else None
            result["allocator"] = ranks[0].get("allocator")
        if stopped is not None:
            result["stopped"] = stopped
            emit("FRENZY_STOPPED", stopped)
        emit("FRENZY_RESULT", result)
    dist.barrier()
    dist.destroy_process_group()


def grad_norm_field(norm) -> dict[str, float]:
    """The step line's ``grad_norm``: the global gradient norm before clipping, where the program
    clipped (not under DeepSpeed, which clips inside its engine, nor without ``grad_clip``)."""
    return {} if norm is None else {"grad_norm": round(float(norm), 6)}


def save_checkpoint(accelerator, run_dir: Path, step: int, fmt: dict[str, Any], main: bool,
                    save_kw: dict[str, Any] | None = None, model=None) -> None:
    """``save_state`` of every rank, then rank 0's marker. With ``model`` (a tensor-parallel
    run) also the full weights, gathered from the TP shards, in ``consolidated.safetensors``:
    DeepSpeed's fp32 consolidation does not read AutoTP checkpoints, and a run re-planned to
    another layout resumes from these weights."""
    from trainer import checkpoints as ck

    path = ck.checkpoint_path(run_dir, step)
    t0 = time.perf_counter()
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path), **(save_kw or {}))
    if model is not None:
        state = accelerator.get_state_dict(model)     # collective: every rank gathers its shards
        if main:
            from safetensors.torch import save_file

            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path / ck.CONSOLIDATED))
    accelerator.wait_for_everyone()                   # every rank has written its shard
    if main:
        (path / ck.MARKER).write_text(json.dumps({"step": step, "format": fmt, "time": time.time()}))
        ck.prune(run_dir, keep=2)
        emit("FRENZY_CHECKPOINT", {"step": step, "dir": str(path), "save_s": round(time.perf_counter() - t0, 4)})
    accelerator.wait_for_everyone()


ADAPTER_STATE = "adapter_state.safetensors"


def register_adapter_state(accelerator, unwrapped, main: bool) -> None:
    """Plain (non-DeepSpeed) LoRA checkpoints: the trainable tensors under the unwrapped model's
    names in ``adapter_state.safetensors`` instead of Accelerate's model file (which would hold
    the frozen base too, under names that carry DDP's ``module.`` prefix on some world sizes
    only). The optimizer, RNG and step state stay Accelerate's."""
    from safetensors.torch import load_file, save_file

    names = trainable_names_of(unwrapped)

    def save(models, weights, out):
        weights.clear()
        if main:
            params = dict(unwrapped.named_parameters())
            save_file({n: params[n].detach().contiguous().cpu() for n in sorted(names)}, str(Path(out) / ADAPTER_STATE))

    def load(models, inp):
        models.clear()
        state = load_file(str(Path(inp) / ADAPTER_STATE))
        missing = names - state.keys()
        if missing:
            raise RuntimeError(f"checkpoint {inp} lacks adapter tensors {sorted(missing)[:5]}")
        unwrapped.load_state_dict(state, strict=False)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def trainable_names_of(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def load_weights_only(model, latest) -> None:
    """Model weights from a checkpoint of another format (the plan changed ZeRO stage or world
    size): Accelerate's ``model.safetensors`` or DeepSpeed's shards consolidated to fp32. The
    optimizer restarts; the step count and the data order continue. A LoRA checkpoint holds the
    adapters only: the frozen base comes from ``init_from`` as in the first launch."""
    from trainer import checkpoints as ck

    path = latest.path
    files = [f for f in (ck.CONSOLIDATED, ADAPTER_STATE, "model.safetensors") if (path / f).is_file()]
    if files:
        from safetensors.torch import load_file

        state = load_file(str(path / files[0]))
    else:
        allow_deepspeed()                             # a ZeRO checkpoint resumed by a plan without it
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(path))
    # a state saved from a DDP-wrapped model carries its "module." prefix
    state = {k.removeprefix("module."): v for k, v in state.items()}
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        # Built under ZeRO-3's zero.Init: parameters are partitioned placeholders. Gather them,
        # load on every rank, and let rank 0's values be re-partitioned on exit.
        import deepspeed

        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            missing, unexpected = model.load_state_dict(state, strict=False)
    else:
        missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    adapters_only = latest.meta.get("format", {}).get("adapters_only", False)
    real_missing = [k for k in missing if k not in tied and not k.endswith("lm_head.weight")
                    and not (adapters_only and k in frozen)]
    if real_missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {real_missing[:5]}, "
                           f"unexpected {list(unexpected)[:5]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def watch_orchestrator(poll_s: float = 2.0, what: str = "rank") -> None:
    """Exit when the process that launched us is gone (``FRENZY_PARENT_PID``); ``what`` names
    this process in the line it prints (a rank, or the launcher: ``trainer.bound_launch``).

    The runner kills the whole tree on timeout, cancellation or an exception; this covers the
    one case it cannot: the orchestrator itself killed hard (SIGKILL, OOM killer). The ranks run
    in sessions of their own under torch elastic, so nothing else would stop them, and they
    would keep their GPUs. A thread, not ``preexec_fn``/PDEATHSIG: forking from a threaded
    Prefect worker with a preexec hook is unsafe."""
    pid = int(os.environ.get("FRENZY_PARENT_PID", "0") or 0)
    if pid <= 0:
        return
    import threading

    def alive() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a zombie (killed, not yet reaped) is gone too
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def loop() -> None:
        while alive():
            time.sleep(poll_s)
        print(f"frenzy: orchestrator {pid} is gone; stopping this {what}", file=sys.stderr, flush=True)
        os._exit(4)

    threading.Thread(target=loop, name="frenzy-orchestrator-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Frenzy training program (run by accelerate launch)")
    ap.add_argument("--run-dir", required=True, type=Path)
    args = ap.parse_args(argv)
    watch_orchestrator()
    rank, _, _ = dist_info()
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        emit("FRENZY_ERROR", {"type": "ImportError", "message": str(e), "transient": False})
        return 2
    try:
        train(args.run_dir)
        return 0
    except torch.OutOfMemoryError as e:
        traceback.print_exc()
        emit("FRENZY_OOM", {"rank": rank, "message": str(e)[:300],
                            "injected": "FRENZY_INJECT_OOM_AT_STEP" in str(e)})
        return 3
    except InputProblem as e:
        emit("FRENZY_ERROR", {"rank": rank, "type": "InputProblem", "message": str(e), "transient": False})
        return 2
    except Exception as e:
        traceback.print_exc()
        emit("FRENZY_ERROR", {"rank": rank, "type": type(e).__name__, "message": str(e)[:500],
                              "transient": is_transient(e)})
        return 1


def is_transient(e: BaseException) -> bool:
    """Failures a retry can fix: lost peers, collective timeouts, vanished nodes."""
    import torch.distributed as dist

    kinds = tuple(k for k in (getattr(dist, "DistError", None), getattr(dist, "DistBackendError", None),
                              getattr(dist, "DistNetworkError", None), getattr(dist, "DistStoreError", None))
                  if k is not None)
    if kinds and isinstance(e, kinds):
        return True
    text = str(e).lower()
    return any(m in text for m in ("nccl", "gloo", "connection reset", "connection closed", "connection refused",
                                   "broken pipe", "socket", "by peer", "timed out", "timeout", "rendezvous",
                                   "ecc error", "unspecified launch failure"))


def exit_now(code: int) -> None:
    """Exit as the interpreter would, without its module teardown: wait for non-daemon threads,
    run the atexit handlers, flush stdio, then ``os._exit``. A rank that imported torch spent
    1.4-2.4 s (2 CPU cores) in that teardown after its last line, and the launcher waits for it."""
    import atexit
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
