"""Implementation profiles: memory depends on what runs, not only on the maths.

An estimate names the framework that will run the job (``estimate(..., framework=NAME)``).
Each profile fixes the terms where implementations differ; every term says what the code does
and where it was measured. The knobs a profile cannot express raise a one-line error naming
both (``check_knobs``).

| term | what differs |
|---|---|
| ``zero0_regime`` | zero 0 with bf16/fp16: fp32 weights + autocast ("amp"), or 16-bit weights with no master ("pure") |
| ``adamw_impl`` | torch AdamW foreach (one state-sized temporary at the step), fused (none) |
| ``loss`` | how the LM loss holds logits: "hf" keeps the 16-bit logits in the model output and upcasts inside the loss; "deleted" frees them (the recipe upcasts in the model and deletes the output before backward) |
| ``repeat_kv`` | grouped-query attention materialises k/v repeated to every head before SDPA |
| ``ddp_bucket_copy`` | DDP's flat buckets duplicate the gradients (gradient_as_bucket_view=False) |
| ``zero_bucket_elems`` | DeepSpeed reduce_bucket_size (elements) |
| ``overlap_comm`` | DeepSpeed overlap_comm default (a second ZeRO-1/2 reduce buffer) |
| ``zero3_subgroup_elems`` | ZeRO-3 fp32 gradient copy made per optimizer sub-group, not for the whole partition |
| ``master_copy_when_pure`` | a 16-bit run without fp32 master still keeps a separate 16-bit master partition |
| ``lora`` / ``qlora`` | the profile runs adapters (PEFT / its own LoRA) |
| ``pipeline_torch_zero`` | a pipeline's ZeRO is torch's (ZeroRedundancyOptimizer at 1: its zero 0 states, optimizer states sharded; FSDP2 at 2/3), not DeepSpeed's |
| ``pipeline_tie_whole`` | a pipeline beside tp sums a tied embedding's two copies as whole gradients (embeddings sharded over the hidden size, the head over the vocabulary), not shard by shard |
| ``fsdp2_copy_in`` | FSDP2 copies a unit's unsharded gradients into one reduce-scatter input before freeing them |
| ``accelerate_amp`` | zero-0 16-bit runs with fp32 weights go through Accelerate's native AMP: autocast, outputs converted to fp32 (loss "auto" holds fp32 logits; fp32 LoRA adapters save a 16-bit copy of their input) |
| ``expandable_segments`` | the trainer launches with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (the estimate's ``allocator`` "auto"): full recomputation fragments the allocator less (``fragmentation_recompute_expandable``), LoRA more (``fragmentation_adapters``) |
| ``selective_ac`` | what ``act_ckpt="selective"`` recomputes: "attention" (Megatron's: the attention core) or "op" (torchtitan's per-op policy: a checkpointed block that keeps every other matmul output and the attention kernel's outputs) |
| ``job_knobs_only`` | the profile runs only what a Frenzy job can ask for (no loss kernel, activation offloading, optimizer in backward, fused kernels) |
Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import FrenzyInputError


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    what: str
    zero0_regime: str = "amp"            # zero 0, 16-bit: amp (fp32 weights + autocast) | master | pure
    adamw_impl: str = "foreach"          # foreach | fused
    loss: str = "hf"                     # hf | deleted | vocab-parallel
    repeat_kv: bool = False
    ddp_bucket_copy: bool = True
    zero_bucket_elems: float | None = None   # None: the GPU type's overhead term (Frenzy's config)
    zero3_subgroup_elems: float | None = None
    master_copy_when_pure: bool = False
    lora: bool = True
    qlora: bool = True
    hf_models: bool = True               # runs the Hugging Face modelling code (its quirks apply)
    torch_sharding: bool = False         # ZeRO stages are torch's (ZeroRedundancyOptimizer, FSDP):
    #                                      fp32 parameters stay, as at zero 0 (AMP regime)
    # pipelines (pp > 1) run their ZeRO as torch's: Frenzy's pipeline path is its own program
    # beside DeepSpeed, and shards the optimizer states with ZeroRedundancyOptimizer over each
    # stage's data-parallel replicas (trainer/parallel/pipeline.py, zero1): the model states of
    # its zero 0, optimizer states divided by dp, no DeepSpeed reduce bucket; ZeRO-2/3 with
    # FSDP2 over the same replicas (pipeline.fsdp; ZeRO-2 as FSDP's SHARD_GRAD_OP)
    pipeline_torch_zero: bool = False
    # Frenzy's pipeline beside tensor parallel shards the embeddings over the hidden size and the
    # head over the vocabulary, so a tied embedding's two gradients are summed whole
    # (trainer/parallel/pipeline.py, Pipeline.sum_tied_gradients): a transient of the whole
    # V x e gradient after the backward on the first and last stage. Megatron's embeddings and
    # head are both vocabulary-parallel and sum shard by shard (no such transient)
    pipeline_tie_whole: bool = False
    # FSDP2 (fully_shard): foreach_reduce allocates the reduce-scatter input (the unit's size, in
    # the reduce dtype), copies the unsharded gradients in, and only then frees them
    # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: "Only after the copy-in
    # finishes can we free the gradients"): both exist while the largest unit reduces
    fsdp2_copy_in: bool = False
    # DeepSpeed's overlap_comm (double-buffered ZeRO-1/2 reduce buffer): "" the profile runs no
    # DeepSpeed engine (the knob is not expressible), "off" always off (Frenzy's trainer config,
    # trainer/launch_config.py), "stage3" DeepSpeed's own default (on at stage 3 only)
    overlap_comm: str = ""
    # the profile runs only what a Frenzy job can ask for (estimator.job.TrainingJob has no loss
    # kernel, activation offloading, optimizer in backward or fused kernels; its trainer runs
    # bitsandbytes' paged 8-bit AdamW as it runs the unpaged one: trainer/optim.py)
    job_knobs_only: bool = False
    # the trainer runs zero-0 16-bit steps with fp32 weights through Accelerate's native AMP
    # (Accelerator(mixed_precision=...) without DeepSpeed): autocast around the forward and
    # convert_outputs_to_fp32 on its outputs (memory.Knobs.accelerate_amp). The HF Trainer
    # does the same, but "hf" also stands for plain loops with torch.autocast, which do not
    accelerate_amp: bool = False
    # the trainer launches with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (Frenzy's
    # launcher does): recomputation fragments less, LoRA more (overheads.FRAGMENTATION_*)
    expandable_segments: bool = False
    # act_ckpt "selective": "attention" recomputes the attention core (Megatron-LM's selective
    # recomputation; with flash attention nothing of it was saved); "op" is torchtitan's per-op
    # selective checkpointing (torchtitan/models/llama3/infra/parallelize.py, _custom_policy):
    # each block is checkpointed and keeps only the outputs of its save list (mm, the attention
    # kernels, reduce-scatter, max), every second mm recomputed
    selective_ac: str = "attention"
    measured: str = ""

    def __hash__(self) -> int:
        # a profile keys the validation cache: its name tells profiles apart (equal profiles
        # share it, so this agrees with ==), cheaper than hashing all 20 fields
        return hash(self.name)


PROFILES: dict[str, Profile] = {p.name: p for p in [
    # Frenzy's trainer never runs torch's default (foreach) AdamW: trainer/optim.py
    # (optimizer_impl) builds torch.optim.AdamW/Adam(fused=True) without ZeRO (CUDA and CPU),
    # DeepSpeed FusedAdam (multi-tensor apply, in place) at ZeRO 1-3, DeepSpeedCPUAdam with
    # offload: none allocates a state-sized temporary at the step, so the profile is "fused".
    # (The H200 runs in bench/estimator_measured_h200*.json were measured with torch's default
    # foreach AdamW by bench/estimator_gpu_measure.py; bench/estimator_accuracy.py says so.)
    Profile("frenzy", "Frenzy's own trainer (Accelerate + HF models; DeepSpeed for ZeRO)",
            adamw_impl="fused", overlap_comm="off", job_knobs_only=True, pipeline_torch_zero=True,
            pipeline_tie_whole=True, accelerate_amp=True, expandable_segments=True,
            measured="54 H200 runs of the trainer (bench/estimator_measured_h200*.json)"),
    Profile("hf", "Hugging Face Trainer or a plain PyTorch loop over HF/timm models "
                  "(torch AMP or a model loaded in 16 bits; DDP; torch AdamW)",
            torch_sharding=True, measured="PEFT method-comparison suite (L40S)"),
    # nanoGPT / llm.c / timm models: F.scaled_dot_product_attention(is_causal=True) (flash),
    # no HF attention-mask plumbing; torch DDP, ZeroRedundancyOptimizer, FSDP
    Profile("pytorch", "a plain PyTorch loop over its own model code (nanoGPT/llm.c, timm): "
                       "SDPA with is_causal, torch DDP / ZeroRedundancyOptimizer / FSDP",
            hf_models=False, torch_sharding=True,
            measured="llm.c GPT-2 XL (A100), torchao ViT benchmarks (RTX 4070 Ti SUPER)"),
    Profile("torchtitan", "torchtitan: FSDP2 with fp32 sharded params and bf16 compute, fused "
                          "AdamW, per-op selective checkpointing, loss on fp32 logits",
            adamw_impl="fused", loss="deleted", ddp_bucket_copy=False, lora=False, qlora=False,
            hf_models=False, torch_sharding=True, fsdp2_copy_in=True, selective_ac="op",
            measured="documented behaviour (no public measured row in the data set); per-op selective "
                     "checkpointing against its saved outputs on the CPU (tests/test_estimator_sac.py)"),
    Profile("megatron", "Megatron-core: fused kernels, vocab-parallel cross-entropy, "
                        "distributed optimizer, fp32 gradient buffer",
            zero0_regime="master", adamw_impl="fused", loss="vocab-parallel",
            ddp_bucket_copy=False, lora=False, hf_models=False,
            qlora=False, measured="documented formulas (report_theoretical_memory)"),
    # DeepSpeed: reduce_bucket_size and allgather_bucket_size default to 5e8 elements
    # (deepspeed/runtime/zero/config.py); stage 3 copies fp32 gradients per sub-group
    # (sub_group_size default 1e9 elements) during the step; FusedAdam / CPUAdam (no foreach
    # temporaries); bf16_master_weights_and_grads still keeps a (16-bit) master partition.
    Profile("deepspeed", "DeepSpeed engine (ZeRO 0-3, FusedAdam / CPUAdam) over HF or plain "
                         "PyTorch models",
            zero0_regime="master", adamw_impl="fused", ddp_bucket_copy=False, zero_bucket_elems=5e8,
            zero3_subgroup_elems=1e9, master_copy_when_pure=True, qlora=False,
            overlap_comm="stage3",
            measured="DeepSpeed-Chat logs (V100), DeepSpeedExamples bf16_master_weight (H100), "
                     "ml-engineering Llama-3.1-8B runs (H200)"),
    # torchtune recipes train in the model dtype (pure bf16), upcast logits in the model and
    # delete them before backward, and (at the measured versions) repeat k/v to all heads;
    # their configs build torch.optim.AdamW with fused=True (the 3B row with checkpointing
    # measures 24.9 GiB, below the 29.9 GiB a foreach step's temporaries would need).
    Profile("torchtune", "torchtune recipes: pure bf16, its own Llama modules, FSDP2",
            zero0_regime="pure", adamw_impl="fused", loss="deleted", repeat_kv=True,
            ddp_bucket_copy=False, hf_models=False, torch_sharding=True, fsdp2_copy_in=True,
            measured="torchtune README tables (A100, RTX 4090)"),
    Profile("lightning", "Lightning / Fabric (DDP, FSDP strategies; precision 32-true, "
                         "bf16-mixed or bf16-true)", torch_sharding=True,
            measured="Lightning Fabric FSDP guide (A100 40GB), LitGPT config hub (A10G)"),
]}

FRAMEWORKS = tuple(PROFILES)

# Free-text framework labels (the public data set's `framework` column, a run's metadata) ->
# a profile; the first matching pattern wins
_LABELS = [
    (r"^torchtune", "torchtune"),
    (r"^deepspeed", "deepspeed"),
    (r"^colossalai", "deepspeed"),          # Gemini: chunk-based ZeRO-3, the closest profile
    (r"^litgpt|^lightning", "lightning"),
    (r"^torchao|^pytorch|^timm|^nanogpt|^llm\.c", "pytorch"),   # plain loops over own model code
    (r"^peft|^hf|^hugging ?face|^transformers|^accelerate", "hf"),
    (r"^megatron|^nemo", "megatron"),
    (r"^torchtitan", "torchtitan"),
    (r"^frenzy", "frenzy"),
]


def profile_for_label(label: str, default: str = "hf") -> str:
    """The profile a free-text framework label maps to (``default`` when none matches)."""
    import re
    for pat, name in _LABELS:
        if re.search(pat, label.strip(), re.IGNORECASE):
            return name
    return default


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise FrenzyInputError("framework", f"must be one of {', '.join(FRAMEWORKS)} (got {name!r})") from None


def check_knobs(p: Profile, *, finetune: str, zero: int, master: str, precision: str,
                opt_in_bwd: bool, optimizer: str, offload: str = "none", loss: str = "standard",
                act_offload: bool = False, fused: bool = False) -> None:
    """One-line errors for knobs profile ``p`` cannot express (naming both)."""
    if p.job_knobs_only:
        asked = [(field, value) for field, value, on in (
            ("loss", f"{loss} ", loss in ("chunked", "fused-linear", "fp32-logits")),
            ("act_offload", "", act_offload), ("optimizer_in_backward", "", opt_in_bwd),
            ("fused_kernels", "", fused)) if on]
        if asked:
            field, value = asked[0]
            raise FrenzyInputError(field, f"{value}is not expressible with framework {p.name} "
                                          "(its trainer does not run it; name the framework that does)")
    if finetune == "lora" and not p.lora:
        raise FrenzyInputError("finetune", f"lora is not expressible with framework {p.name} "
                                           "(it has no adapter support)")
    if finetune == "qlora" and not p.qlora:
        raise FrenzyInputError("finetune", f"qlora is not expressible with framework {p.name} "
                                           "(no 4-bit base weights)")
    if p.name == "torchtune" and master == "fp32" and precision != "fp32":
        raise FrenzyInputError("master_weights", "fp32 master weights are not expressible with "
                                                 "framework torchtune (its recipes train in the model dtype)")
    if opt_in_bwd and p.name in ("megatron", "deepspeed"):
        raise FrenzyInputError("optimizer_in_backward", f"is not expressible with framework {p.name}")
    if opt_in_bwd and zero >= 1 and p.name != "torchtune":
        raise FrenzyInputError("optimizer_in_backward", "needs zero 0 (one optimizer per parameter)")
    if offload == "optimizer+params" and p.name in ("hf", "pytorch", "lightning"):
        # FSDP1's parameter CPU offload keeps a GPU working set (padded flat parameters and
        # gradients per unit) that no validated term models: the one public row measures
        # 2.76 GiB where gathered units alone would give 0.5 GiB
        raise FrenzyInputError("offload", f"optimizer+params is not expressible with framework "
                                          f"{p.name} (FSDP CPU offload's GPU working set is not modelled)")
    if optimizer.startswith("adamw8bit") and p.name in ("megatron", "torchtitan"):
        raise FrenzyInputError("optimizer", f"{optimizer} is not expressible with framework {p.name}")
