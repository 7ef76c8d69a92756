"""From a plan to the files that launch it: Accelerate config, DeepSpeed config, training spec.

Everything here is plain data (dicts, YAML/JSON files) derived from ``Plan`` + ``TrainingJob``;
the files are saved in the run folder so a person can rerun exactly what Frenzy ran with
``accelerate launch --config_file accelerate.yaml -m trainer.train --run-dir <run_dir>``.

The trainer realises data parallelism (+ ZeRO 1-3 and offload through DeepSpeed) and tensor
parallelism through DeepSpeed's AutoTP (``tensor_parallel.autotp_size``, ZeRO 0-3 beside it;
``trainer.parallel``) and sequence parallelism (``cp``) through DeepSpeed Ulysses
(``trainer.parallel.ulysses``) and pipeline parallelism (``pp``, interleaved where ``vpp > 1``)
through ``trainer.parallel.pipeline`` (ZeRO-1 beside it: torch's ``ZeroRedundancyOptimizer``
over each stage's data-parallel group; ZeRO-2/3: FSDP2 over that group). Layouts it cannot run
(pp beside offload or cp, ZeRO-1 beside pp x tp, cp beside tp, an interleaving torch refuses) are refused here with an error naming the setting, before
anything starts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from estimator.errors import FrenzyInputError
from estimator.home import write_atomic
from estimator.job import TrainingJob
from estimator.plan import Plan

from .parallel import pipeline_layers_rule, plan_world, uses_deepspeed

ACCELERATE_FILE = "accelerate.yaml"
DEEPSPEED_FILE = "deepspeed.json"
SPEC_FILE = "train_spec.json"

_MIXED = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def is_cpu_plan(plan: Plan) -> bool:
    """The CPU pseudo GPU type (training processes over gloo on this machine)."""
    return plan.gpu_type.upper() == "CPU"


def check_realisable(plan: Plan) -> None:
    """Refuse what the trainer cannot run, naming the setting."""
    if plan.pp > 1 and (plan.cp > 1 or plan.offload != "none"):
        raise FrenzyInputError(
            "plan.pp", f"pipeline parallel runs beside data and tensor parallel and ZeRO 0-3 only, without "
                       f"offload or cp (got pp={plan.pp}, tp={plan.tp}, cp={plan.cp}, zero={plan.zero}, "
                       f"offload={plan.offload})")
    if plan.pp > 1 and plan.tp > 1 and plan.zero == 1:
        raise FrenzyInputError(
            "plan.zero", "ZeRO-1 beside pipeline and tensor parallel is not run (torch's ZeroRedundancyOptimizer "
                         "broadcasts whole parameters; tensor-parallel DTensors have no broadcast): use zero 0, 2 or 3")
    vpp_rule = interleave_rule(plan.pp, getattr(plan, "vpp", 1), plan.grad_accum)
    if vpp_rule is not None:
        raise FrenzyInputError("plan.vpp", vpp_rule)
    if plan.cp > 1 and plan.tp > 1:
        raise FrenzyInputError("plan.cp", f"sequence parallel (Ulysses) runs beside data parallel, not beside "
                                          f"tensor parallel (got cp={plan.cp}, tp={plan.tp})")
    if plan.gpus != plan_world(plan):
        raise FrenzyInputError("plan.gpus", f"must equal dp x tp x pp x cp (gpus={plan.gpus}, dp={plan.dp}, "
                                            f"tp={plan.tp}, pp={plan.pp}, cp={plan.cp})")
    if plan.offload != "none" and plan.zero == 0:
        raise FrenzyInputError("plan.offload", f"{plan.offload!r} needs ZeRO (zero >= 1); got zero=0")
    if plan.offload == "optimizer+params" and plan.zero != 3:
        raise FrenzyInputError("plan.offload", f"'optimizer+params' needs zero=3 (got zero={plan.zero})")


def interleave_rule(pp: int, vpp: int, grad_accum: int) -> str | None:
    """Why ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` cannot run ``vpp`` chunks
    per pipeline rank over ``grad_accum`` micro-batches (one line), or None.

    torch 2.13 runs the micro-batches in rounds of ``max(1, grad_accum // pp)`` and raises
    unless the rounds divide them (so pp=2: 1-4, 6, 8 micro-batches run, 5 and 7 do not);
    Megatron-LM's stricter ``grad_accum % pp == 0`` is not needed."""
    if vpp <= 1:
        return None
    if pp <= 1:
        return f"interleaved pipeline stages (vpp={vpp}) need pp > 1 (got pp={pp})"
    rounds = max(1, grad_accum // pp)
    if grad_accum % rounds:
        return (f"interleaved 1F1B runs grad_accum micro-batches in rounds of max(1, grad_accum // pp) = {rounds}, "
                f"which must divide grad_accum (got grad_accum={grad_accum}, pp={pp}, vpp={vpp})")
    return None


def check_heads(plan: Plan, heads: int, kv_heads: int | None = None) -> None:
    """Refuse a tensor- or sequence-parallel degree the model's attention heads do not split
    into: DeepSpeed AutoTP (and beside pp torch's DTensor tensor parallel inside the stages)
    gives each of the ``tp`` ranks whole query and KV heads (with ``tp`` not dividing them its
    shards come out uneven, a rank without a KV head), and Ulysses hands each of the ``cp``
    ranks whole heads after its all-to-all. Both must divide the query heads and the KV heads."""
    kv = kv_heads if kv_heads is not None else heads
    tp_backend = "torch's DTensor tensor parallel" if getattr(plan, "pp", 1) > 1 else "DeepSpeed AutoTP"
    for knob, degree, how in (("tp", plan.tp, f"{tp_backend} gives every rank whole heads"),
                              ("cp", plan.cp, "Ulysses gives every rank whole heads")):
        if degree > 1 and (heads % degree or kv % degree):
            raise FrenzyInputError(f"plan.{knob}", f"{knob}={degree} must divide the model's {heads} attention heads "
                                                   f"and {kv} KV heads ({how})")


# The decoders whose layers the pipeline path cuts into stages (trainer.parallel.pipeline).
PIPELINE_ARCHS = ("llama",)


def check_pipeline_model(plan: Plan, arch: str, layers: int | None = None) -> None:
    """A ``pp > 1`` plan needs a model the pipeline path can cut into stages; with ``layers``
    (the model's decoder layers) the stages and chunks must fit them
    (``trainer.parallel.pipeline_layers_rule``, which the training program asks too)."""
    if plan.pp > 1 and arch not in PIPELINE_ARCHS:
        raise FrenzyInputError("plan.pp", f"pipeline stages are built for {', '.join(PIPELINE_ARCHS)} decoders "
                                          f"(got a {arch} model)")
    rule = pipeline_layers_rule(layers, plan.pp, getattr(plan, "vpp", 1)) if layers is not None else None
    if rule is not None:
        raise FrenzyInputError(*rule)


# Model types whose embedding DeepSpeed's AutoTP cannot shard: it keeps Gemma's and Gemma 2's
# scaled word embeddings (a custom forward it has no rule for; Gemma 3's it has) and the head tied to it
# whole on every tp rank, which no estimate of a tp plan counts (checked on the CPU: the
# per-rank checkpoints of a tp=2 run hold the whole vocabulary)
AUTOTP_WHOLE_EMBEDDING_TYPES = ("gemma", "gemma2")


# Model types neither tensor-parallel path shards: Phi-3's fused qkv_proj and gate_up_proj. Its
# Hugging Face plan gathers their outputs and splits o_proj's and down_proj's inputs
# ('colwise_gather_output', 'rowwise_split_input'): DeepSpeed 0.19's AutoTP rejects such a plan
# ("unsupported partition style(s)", tried: tp=2 of a tiny Phi-3 on the CPU); given layer rules of
# its own (tensor_parallel.partition_config: qkv_proj split per q / k / v width, gate_up_proj per
# half) it shards the weights, but Phi3Attention slices the fused output at the config's global
# head counts, so the rank's half-width output is misread (tried: a shape error in o_proj); and
# the pipeline's DTensor tensor parallel shards plain column / row pairs only
NO_TP_TYPES = ("phi3",)


def check_tp_model(plan: Plan, model_type: str | None) -> None:
    """A ``tp > 1`` plan without pipeline stages runs DeepSpeed's AutoTP, which must shard the
    model's embedding like every other matrix; no tensor-parallel path shards ``NO_TP_TYPES``."""
    if plan.tp > 1 and model_type in NO_TP_TYPES:
        raise FrenzyInputError("plan.tp", f"tensor parallel does not shard {model_type}'s fused qkv_proj and "
                                          f"gate_up_proj (DeepSpeed AutoTP rejects its tensor-parallel plan): "
                                          f"use data parallel with ZeRO, or pipeline stages")
    if plan.tp > 1 and plan.pp == 1 and model_type in AUTOTP_WHOLE_EMBEDDING_TYPES:
        raise FrenzyInputError("plan.tp", f"DeepSpeed AutoTP keeps a {model_type} model's embedding (and a head "
                                          f"tied to it) whole on every rank: use tp with pp >= 2 (the pipeline's "
                                          f"tensor parallel shards it) or ZeRO")


def accelerate_config(plan: Plan, *, num_machines: int = 1, machine_rank: int = 0,
                      main_address: str | None = None, main_port: int = 29500, cpu: bool = False,
                      deepspeed_config_file: str = DEEPSPEED_FILE, master_weights: str = "fp32") -> dict[str, Any]:
    """The Accelerate config (as ``accelerate config`` writes it) for ``plan``.

    ``plan.gpus`` processes in total over ``num_machines`` machines. Mixed precision comes from
    ``plan.precision`` with fp32 master weights; ``master_weights="none"`` (pure 16-bit: the
    program casts the model to ``precision``) turns autocast off. With ZeRO the DeepSpeed file
    carries the precision.
    """
    check_realisable(plan)
    if num_machines < 1 or not 0 <= machine_rank < num_machines:
        raise FrenzyInputError("machine_rank", f"must be in [0, {num_machines}) (got {machine_rank})")
    if plan.gpus % num_machines:
        raise FrenzyInputError("num_machines", f"must divide plan.gpus={plan.gpus} (got {num_machines})")
    if num_machines > 1 and not main_address:
        raise FrenzyInputError("main_address", "required when num_machines > 1")
    cfg: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "num_machines": num_machines,
        "num_processes": plan.gpus,
        "machine_rank": machine_rank,
        "main_process_port": int(main_port),
        "rdzv_backend": "static",
        "same_network": True,
        "gpu_ids": "all",
        "use_cpu": bool(cpu),
        "main_training_function": "main",
        "downcast_bf16": "no",
    }
    if main_address:
        cfg["main_process_ip"] = main_address
    if uses_deepspeed(plan):
        cfg["distributed_type"] = "DEEPSPEED"
        # ZeRO-3 builds the model partitioned (zero.Init), except beside tensor parallel:
        # transformers' partitioned loading refuses an AutoTP config, so a TP rank builds the
        # full model and DeepSpeed shards it (TP, then ZeRO-3) at initialize
        cfg["deepspeed_config"] = {"deepspeed_config_file": deepspeed_config_file,
                                   "zero3_init_flag": plan.zero == 3 and plan.tp == 1}
        if num_machines > 1:
            # Accelerate's default for several machines is pdsh (ssh from node 0 with a
            # hostfile); Frenzy starts the same command on every node itself (one flow run per
            # node), which is DeepSpeed's `standard` launcher: torchrun on each node
            cfg["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
        # With a DeepSpeed file, Accelerate insists mixed precision is left to that file.
    else:
        cfg["distributed_type"] = "MULTI_GPU" if plan.gpus > 1 else "NO"
        cfg["mixed_precision"] = "no" if master_weights == "none" else _MIXED[plan.precision]
    return cfg


def deepspeed_config(plan: Plan, job: TrainingJob) -> dict[str, Any] | None:
    """The DeepSpeed config for a ZeRO or tensor-parallel plan (None for plain data parallel).

    The batch triple keeps the job's global batch: micro_batch x grad_accum x dp == global_batch.
    """
    if not uses_deepspeed(plan):
        return None
    check_realisable(plan)
    if plan.global_batch != job.global_batch:
        raise FrenzyInputError(
            "plan.grad_accum",
            f"micro_batch x grad_accum x dp must equal the job's global_batch {job.global_batch} "
            f"(got {plan.micro_batch} x {plan.grad_accum} x {plan.dp} = {plan.global_batch})")
    zero: dict[str, Any] = {"stage": plan.zero, "overlap_comm": False, "contiguous_gradients": True,
                            "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7}
    if plan.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not is_cpu_plan(plan)}
    if plan.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": not is_cpu_plan(plan)}
    if plan.zero == 3 or plan.tp > 1:
        # the export (and, under TP, the consolidated weights of each checkpoint) gathers the
        # full weights from the shards (module by module, to rank 0); DeepSpeed's TP reads
        # the same switch
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    bf16: dict[str, Any] = {"enabled": plan.precision == "bf16"}
    if plan.precision == "bf16" and job.master_weights == "none":
        # pure bf16: no fp32 copy of the weights, gradients or optimizer states
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    extra: dict[str, Any] = {"train_batch_size": plan.global_batch}
    if plan.tp > 1:
        # DeepSpeed's batch check counts the world as data parallel with ZeRO 0-2 and the
        # data-parallel group under ZeRO-3 when AutoTP is on (0.19.8): no value fits both, so
        # the total is left out and DeepSpeed derives it; the program indexes data by dp rank
        # (the ranks of a TP group share a batch), so the job's global batch is kept.
        extra = {"tensor_parallel": {"autotp_size": plan.tp}}
    return {
        **extra,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": job.optim.grad_clip or 0.0,
        "zero_optimization": zero,
        "bf16": bf16,
        "fp16": {"enabled": plan.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        # The training program checkpoints activations itself (Hugging Face gradient
        # checkpointing, per plan.act_ckpt); this section records the choice and keeps
        # DeepSpeed's own partitioning off (it needs Megatron-style model code).
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                     "contiguous_memory_optimization": False,
                                     "number_checkpoints": None, "synchronize_checkpoint_boundary": False,
                                     "profile": False},
        # the program builds the optimizer itself (trainer.optim: DeepSpeed's FusedAdam or
        # CPUAdam where they apply); the others (SGD, Adafactor) are torch's
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10 ** 9,
        "wall_clock_breakdown": False,
    }


def validate_deepspeed_config(cfg: dict[str, Any], *, dp: int | None = None) -> None:
    """Check ``cfg`` with DeepSpeed's own config class (batch triple, ZeRO, offload and precision
    sections); raise ``FrenzyInputError("deepspeed_config", ...)`` naming what it rejects.

    DeepSpeed's class takes the world size from an initialised process group and falls back to
    1 without one (its ``mpu`` argument is ignored then), so the data-parallel factor ``dp`` is
    checked here and DeepSpeed checks the per-rank triple. DeepSpeed is imported lazily.
    """
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError as e:  # pragma: no cover - deepspeed is a dependency
        raise FrenzyInputError("deepspeed_config", f"ZeRO plans need the deepspeed package ({e})") from None
    try:
        mb, ga = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
        tb = cfg["train_batch_size"] if "tensor_parallel" not in cfg else mb * ga * (dp or 1)
    except KeyError as e:
        raise FrenzyInputError("deepspeed_config", f"missing {e.args[0]}") from None
    per_rank = dict(cfg)
    if dp is not None:
        if tb != mb * ga * dp:
            raise FrenzyInputError("deepspeed_config", f"train_batch_size {tb} != micro batch {mb} x grad accum {ga} x dp {dp}")
        per_rank["train_batch_size"] = mb * ga
    try:
        DeepSpeedConfig(per_rank)
    except Exception as e:  # DeepSpeed raises AssertionError / ValueError / pydantic errors
        msg = " ".join(str(e).split()) or type(e).__name__
        raise FrenzyInputError("deepspeed_config", f"rejected by DeepSpeed: {msg[:300]}") from None


def export_dir(job: TrainingJob, run_dir: str | Path) -> Path:
    """Where the end-of-training export goes: ``export.dir``, else ``<run_dir>/export``."""
    return Path(job.export.dir).resolve() if job.export.dir else Path(run_dir).resolve() / "export"


def training_spec(job: TrainingJob, plan: Plan, run_dir: str | Path = ".",
                  resume_from: str | None = None) -> dict[str, Any]:
    """What the training program needs, as plain JSON (it never imports pydantic models).

    The model is resolved here, in the orchestrator, through the estimator's one model
    resolver, so the program trains exactly the architecture that was estimated; pretrained
    weights are the local folder ``init_from`` resolves to (a Hub id: its cached snapshot).
    ``resume_from``: a checkpoint folder of another run to continue from.
    """
    from estimator.memory import attention_for
    from estimator.models import resolve_model  # the estimator's (H1) single source of models

    from .pretrained import start_folder

    spec = resolve_model(job.model)
    check_tp_model(plan, spec.model_type)
    hf = spec.hf_config()
    entry = getattr(job, "entry_point", None)
    if entry is None and hf.get("model_type") == "bert":
        raise FrenzyInputError("model", "bert is not a causal language model; the trainer trains causal LMs "
                                        "(give an entry_point for a custom model)")
    return {
        "job_name": job.name,
        "hf_config": hf,
        "entry_point": entry,
        "init_from": str(start_folder(job.init_from)) if job.init_from else None,
        "resume_from": resume_from,
        "finetune": job.finetune.model_dump(),
        "master_weights": job.master_weights,
        "seq_len": job.seq_len,
        "global_batch": job.global_batch,
        "steps": job.steps,
        "lr": job.lr,
        "optim": job.optim.model_dump(),
        "schedule": job.schedule.model_dump(),
        "seed": job.seed,
        "checkpoint_every": job.checkpoint_every,
        "data": job.data.model_dump(),
        "eval": job.eval.model_dump() if job.eval else None,
        "export": {**job.export.model_dump(), "dir": str(export_dir(job, run_dir))},
        # a model Hugging Face builds without SDPA attends eager, as the planner planned it
        "plan": {**plan.model_dump(), "attention": attention_for(spec, plan.attention)},
    }


class Paths(NamedTuple):
    """The launch files of one attempt, all inside the run folder."""

    run_dir: Path
    accelerate: Path
    deepspeed: Path | None
    spec: Path


def accelerate_file(num_machines: int = 1, machine_rank: int = 0) -> str:
    """The Accelerate config's file name: one per node when several nodes share the run folder
    (each node's file holds its own ``machine_rank``)."""
    return ACCELERATE_FILE if num_machines == 1 else f"accelerate-node{machine_rank}.yaml"


def write_launch_files(run_dir: str | Path, plan: Plan, job: TrainingJob, *, num_machines: int = 1,
                       machine_rank: int = 0, main_address: str | None = None, main_port: int = 29500,
                       cpu: bool | None = None, validate: bool = True, resume_from: str | None = None) -> Paths:
    """Write accelerate.yaml (``accelerate-node<r>.yaml`` on several nodes), deepspeed.json (ZeRO
    plans, validated first) and train_spec.json.

    Nothing is written when any check fails, so a rejected plan leaves no half-made run folder.
    """
    run_dir = Path(run_dir)
    cpu = is_cpu_plan(plan) if cpu is None else cpu
    ds = deepspeed_config(plan, job)
    if ds is not None and validate:
        validate_deepspeed_config(ds, dp=plan.dp)
    spec = training_spec(job, plan, run_dir, resume_from=resume_from)
    acc = accelerate_config(plan, num_machines=num_machines, machine_rank=machine_rank,
                            main_address=main_address, main_port=main_port, cpu=cpu,
                            deepspeed_config_file=str((run_dir / DEEPSPEED_FILE).resolve()),
                            master_weights=job.master_weights)
    run_dir.mkdir(parents=True, exist_ok=True)
    acc_path = run_dir / accelerate_file(num_machines, machine_rank)
    write_atomic(acc_path, yaml.safe_dump(acc, sort_keys=False))
    ds_path = None
    if ds is not None:
        ds_path = run_dir / DEEPSPEED_FILE
        write_atomic(ds_path, json.dumps(ds, indent=2))
    else:
        (run_dir / DEEPSPEED_FILE).unlink(missing_ok=True)   # a fallback from ZeRO to none
    spec_path = run_dir / SPEC_FILE
    write_atomic(spec_path, json.dumps(spec, indent=2))
    return Paths(run_dir, acc_path, ds_path, spec_path)
