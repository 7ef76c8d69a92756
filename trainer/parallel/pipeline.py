"""Pipeline parallel (``pp > 1``) with ``torch.distributed.pipelining``: the training program's
own path beside Accelerate (Accelerate and transformers offer no trainable pipeline: transformers'
``pp_size`` is forward-only, ``prepare_pippy`` inference-only, DeepSpeed's ``PipelineModule``
wants a LayerSpec list).

Layout: ``dp x pp`` ranks, the ranks of one pipeline consecutive (``rank = dp_rank * pp +
stage``). Every rank builds the whole model from the same weights, keeps its stage (embeddings
on the first, ``layers[lo:hi]``, the final norm and the head on the last; rotary embeddings and
the causal mask recomputed on every stage) and drops the rest. A step feeds the data-parallel
rank's ``micro_batch x grad_accum`` sequences as ``grad_accum`` micro-batches through 1F1B
(GPipe when there are fewer micro-batches than stages), ``scale_grads`` averaging them, so the
gradient is the one a single process accumulates.

Interleaved (``vpp > 1``): the layers are cut into ``pp x vpp`` equal chunks and pipeline rank
``s`` holds chunks ``s, s + pp, s + 2 pp, ...`` (Megatron-LM's virtual stages; embeddings in
chunk 0 on the first rank, the head in the last chunk on the last rank), run by
``ScheduleInterleaved1F1B``: each warm-up and cool-down slot is one chunk's work, ``1/vpp`` of a
rank's, so the bubble shrinks by ``vpp`` for ``vpp`` times the point-to-point sends.

Then: gradients averaged over the data-parallel ranks of each stage, a tied embedding's two
copies summed between the first and last stage, one global gradient norm over every stage for
clipping, one optimizer per stage (over all the rank's chunks); ZeRO-1 (``zero: 1``) shards that
optimizer's states over the stage's data-parallel replicas (``zero1``).

Checkpoints: one file per stage, i.e. per pipeline rank with all its chunks (its parameters
under the whole model's names, and its optimizer state), then rank 0 writes
``consolidated.safetensors`` from them, so a run re-planned to another layout resumes from the
full weights (optimizer restarted).

Llama-family decoders (``model.model.layers``, ``embed_tokens``, ``norm``, ``rotary_emb``,
``lm_head``) only; full fine-tuning, no evaluation split, no ZeRO-2/3, offload, tp or cp beside it.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

from trainer.parallel import pipeline_layers_rule
from trainer.problems import InputProblem

STAGE_FILE = "stage-{stage:02d}.pt"


class PipeLayout(NamedTuple):
    dp: int
    pp: int
    dp_rank: int
    stage: int

    def rank_of(self, dp_rank: int, stage: int) -> int:
        return dp_rank * self.pp + stage


def pipe_layout(plan: dict[str, Any], rank: int) -> PipeLayout:
    dp, pp = int(plan.get("dp", 1)), int(plan.get("pp", 1))
    if not 0 <= rank < dp * pp:
        raise ValueError(f"rank {rank} outside a dp {dp} x pp {pp} layout")
    return PipeLayout(dp, pp, rank // pp, rank % pp)


def stage_layers(layers: int, pp: int, stage: int) -> tuple[int, int]:
    """The decoder layers ``[lo, hi)`` of ``stage`` of ``pp`` stages (interleaved: of the
    ``pp x vpp`` chunks): as even as the count allows, the first stages one more (the
    estimator's ``_stage_layers`` split)."""
    base, extra = divmod(layers, pp)
    lo = stage * base + min(stage, extra)
    return lo, lo + base + (1 if stage < extra else 0)


def rank_chunks(pp: int, vpp: int, stage: int) -> list[int]:
    """The chunks (global stage indices of ``pp x vpp``) pipeline rank ``stage`` holds: every
    ``pp``-th from its own, the layout ``ScheduleInterleaved1F1B`` expects (a micro-batch goes
    round the ranks ``vpp`` times)."""
    return [stage + k * pp for k in range(vpp)]


def check_pipeline(spec: dict[str, Any], model) -> None:
    """What this path runs, refused in one line otherwise (before any collective)."""
    plan = spec["plan"]
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        raise InputProblem(f"plan.pp: pipeline stages are built for Llama-family decoders "
                           f"(model.layers, embed_tokens, norm, rotary_emb, lm_head); got {type(model).__name__}")
    rule = pipeline_layers_rule(len(inner.layers), int(plan["pp"]), int(plan.get("vpp", 1)))
    if rule is not None:
        raise InputProblem(f"{rule[0]}: {rule[1]}")
    if spec.get("finetune", {}).get("method", "full") != "full":
        raise InputProblem("plan.pp: pipeline parallel trains the full model (no LoRA/QLoRA adapters)")
    if spec.get("eval"):
        raise InputProblem("plan.pp: evaluation of a pipeline-parallel run is not supported (drop eval)")


def build_stage_module(model, stage: int, pp: int):
    """The ``torch.nn.Module`` of ``stage`` of ``pp`` (interleaved: chunk ``stage`` of
    ``pp x vpp``): the model's own submodules (so parameter names map back to the whole
    model's), the rest of the model dropped."""
    import torch
    from transformers.masking_utils import create_causal_mask

    inner = model.model
    lo, hi = stage_layers(len(inner.layers), pp, stage)
    first, last = stage == 0, stage == pp - 1

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = inner.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(inner.layers[lo:hi])
            self.rotary_emb = inner.rotary_emb
            self.norm = inner.norm if last else None
            self.lm_head = model.lm_head if last else None
            self.config = model.config
            # the whole model's name of each parameter this stage holds
            self.names = {id(p): n for n, p in model.named_parameters()}

        def forward(self, x):
            h = self.embed_tokens(x) if first else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                      cache=None, position_ids=pos)
            pe = self.rotary_emb(h, position_ids=pos)
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
            if last:
                h = self.lm_head(self.norm(h))
            return h

        def full_names(self) -> dict[str, Any]:
            """Whole-model name -> parameter, for the checkpoint."""
            out = {}
            for p in self.parameters():
                out[self.names[id(p)]] = p
            return out

    return Stage()


def causal_lm_loss(logits, x):
    """The Hugging Face causal-LM loss (labels = inputs, shifted by one, mean over tokens)."""
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))


def tied(model) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


class Pipeline:
    """One rank's stage, schedule, groups and optimizer (module docstring)."""

    def __init__(self, model, plan: dict[str, Any], rank: int, device, make_optimizer):
        import torch.distributed as dist
        import torch
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        self.lay = lay = pipe_layout(plan, rank)
        self.mb, self.ga = int(plan["micro_batch"]), int(plan["grad_accum"])
        self.first, self.last = lay.stage == 0, lay.stage == lay.pp - 1
        self.tied = tied(model)
        self.vpp = int(plan.get("vpp", 1))
        n_chunks = lay.pp * self.vpp
        ids = rank_chunks(lay.pp, self.vpp, lay.stage)
        # this rank's chunks in pipeline order: chunk 0 (embeddings) first on the first rank,
        # the last chunk (head) last on the last rank
        self.chunks = [build_stage_module(model, c, n_chunks).to(device) for c in ids]
        # one module over the chunks: optimizer, gradients and checkpoint see them all
        self.module = torch.nn.ModuleList(self.chunks)
        # every rank creates every group, in the same order (new_group is collective)
        self.pp_group = self.dp_group = self.tie_group = None
        for d in range(lay.dp):
            g = dist.new_group([lay.rank_of(d, s) for s in range(lay.pp)])
            if d == lay.dp_rank:
                self.pp_group = g
        for s in range(lay.pp):
            g = dist.new_group([lay.rank_of(d, s) for d in range(lay.dp)])
            if s == lay.stage:
                self.dp_group = g
        if self.tied:
            for d in range(lay.dp):
                g = dist.new_group([lay.rank_of(d, 0), lay.rank_of(d, lay.pp - 1)])
                if d == lay.dp_rank and (self.first or self.last):
                    self.tie_group = g
        stages = [PipelineStage(m, c, n_chunks, device, group=self.pp_group) for m, c in zip(self.chunks, ids)]
        if self.vpp > 1:
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=self.ga, loss_fn=causal_lm_loss,
                                                    scale_grads=True)
        else:
            kind = Schedule1F1B if self.ga >= lay.pp else ScheduleGPipe
            self.schedule = kind(stages[0], n_microbatches=self.ga, loss_fn=causal_lm_loss, scale_grads=True)
        self.zero = int(plan.get("zero", 0))
        self.optimizer, self.optimizer_impl = make_optimizer(self.module)
        if self.zero == 1:
            self.optimizer, self.optimizer_impl = zero1(self.optimizer, self.optimizer_impl, self.dp_group)

    def tied_weight(self):
        return self.chunks[0].embed_tokens.weight if self.first else self.chunks[-1].lm_head.weight

    def full_names(self) -> dict[str, Any]:
        """Whole-model name -> parameter over this rank's chunks."""
        out: dict[str, Any] = {}
        for chunk in self.chunks:
            out.update(chunk.full_names())
        return out

    def step(self, x, clip: float | None, lr: float):
        """One optimizer step on the rank's ``mb x ga`` sequences ``x``; returns the sum of the
        micro-batch losses on the last stage (0 elsewhere)."""
        import torch
        import torch.distributed as dist

        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses: list = []
        if self.first:
            self.schedule.step(x, target=x if self.last else None, losses=losses)
        elif self.last:
            self.schedule.step(target=x, losses=losses)
        else:
            self.schedule.step()
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.lay.dp > 1:
            for p in params:
                dist.all_reduce(p.grad, group=self.dp_group)
                p.grad.div_(self.lay.dp)
        if self.tied and self.tie_group is not None and self.lay.pp > 1:
            dist.all_reduce(self.tied_weight().grad, group=self.tie_group)
        if clip:
            # one norm over the whole model: every stage's squares summed over the pipeline
            # (a tied weight counted once: on the first stage)
            own = [p for p in params if not (self.tied and self.last and self.lay.pp > 1
                                             and p is self.tied_weight())]
            sq = torch.zeros((), dtype=torch.float64, device=x.device)
            for p in own:
                sq += p.grad.detach().double().pow(2).sum()
            dist.all_reduce(sq, group=self.pp_group)
            coef = clip / (math.sqrt(float(sq)) + 1e-6)
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=x.device)
        for loss in losses:
            total += loss.detach().float()
        return total

    # -------------------------------------------------------------- checkpoints
    def save(self, path: Path) -> None:
        """This stage's weights (whole-model names) and optimizer state; the first data-parallel
        replica of each stage writes. Every rank calls it: under ZeRO-1 the stage's optimizer
        shards are first gathered to that replica (a collective over the stage's dp group), so
        the file holds the whole stage's state, which each replica's partition loads back."""
        import torch

        if self.zero == 1:
            self.optimizer.consolidate_state_dict(to=0)   # rank 0 of the dp group: dp_rank 0
        if self.lay.dp_rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            torch.save({"params": {n: p.detach().cpu() for n, p in self.full_names().items()},
                        "optimizer": self.optimizer.state_dict()},
                       path / STAGE_FILE.format(stage=self.lay.stage))

    def load(self, path: Path) -> None:
        import torch

        state = torch.load(path / STAGE_FILE.format(stage=self.lay.stage), map_location="cpu", weights_only=False)
        with torch.no_grad():
            for n, p in self.full_names().items():
                p.copy_(state["params"][n])
        self.optimizer.load_state_dict(state["optimizer"])


def zero1(optimizer, impl: str, dp_group):
    """ZeRO-1 over a stage's data-parallel replicas: torch's ``ZeroRedundancyOptimizer`` with the
    job's optimizer class and settings, each replica keeping the states of its share of the
    stage's parameters (partitioned by size) and broadcasting its updated parameters after the
    step. Gradients stay whole and all-reduced (ZeRO-1), so the pipeline's own averaging, tied
    embedding sum and global norm are unchanged. It needs only broadcasts (gloo has them);
    FSDP2 would be ZeRO-2/3, which the planner does not enumerate for pipelines."""
    import inspect

    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    # the defaults the class's constructor takes (AdamW's carry decoupled_weight_decay, which
    # its constructor does not accept)
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{k: v for k, v in g.items()} for g in optimizer.param_groups]
    return (ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=dp_group, **kwargs),
            f"torch.distributed.optim.ZeroRedundancyOptimizer({impl})")


def consolidate(path: Path, pp: int, out_name: str) -> None:
    """The whole model's weights from the stage files (rank 0, after every stage saved)."""
    import torch
    from safetensors.torch import save_file

    full: dict[str, Any] = {}
    for s in range(pp):
        full.update(torch.load(path / STAGE_FILE.format(stage=s), map_location="cpu", weights_only=False)["params"])
    save_file({k: v.contiguous() for k, v in full.items()}, str(path / out_name))


def load_consolidated(model, path: Path, name: str) -> None:
    """Whole-model weights (another layout's consolidated file) into the model before it is split."""
    from safetensors.torch import load_file

    state = load_file(str(path / name))
    missing, unexpected = model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()}, strict=False)
    real = [k for k in missing if not (tied(model) and k.endswith("lm_head.weight"))]
    if real or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {real[:5]}, unexpected {unexpected[:5]}")
