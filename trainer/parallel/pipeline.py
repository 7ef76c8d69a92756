"""Pipeline parallel (``pp > 1``) with ``torch.distributed.pipelining``: the training program's
own path beside Accelerate (Accelerate and transformers offer no trainable pipeline: transformers'
``pp_size`` is forward-only, ``prepare_pippy`` inference-only, DeepSpeed's ``PipelineModule``
wants a LayerSpec list).

Layout: ``dp x pp x tp`` ranks, the (dp, pp, tp) device mesh in row-major order (``rank =
(dp_rank * pp + stage) * tp + tp_rank``: a tensor-parallel group is consecutive ranks, one
pipeline's stages ``tp`` ranks apart; without tp one pipeline is consecutive). Every rank
builds the whole model from the same weights, keeps its stage (embeddings on the first,
``layers[lo:hi]``, the final norm and the head on the last; rotary embeddings and the causal
mask recomputed on every stage) and drops the rest. A step feeds the data-parallel
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
optimizer's states over the stage's data-parallel replicas (``zero1``); ZeRO-2/3 (``zero: 2, 3``)
shard the stage's weights, gradients and optimizer states over them with FSDP2 (``fsdp``), whose
reduce-scatter replaces the gradient averaging.

Tensor parallel (``tp > 1``): inside each stage torch's DTensor tensor parallel over the
stage's tp ranks (``tensor_parallel``: the decoder layers by the model's own plan, embeddings
over the hidden size, head over the vocabulary with a vocab-parallel loss); each tp rank sends
``1/tp`` of a boundary's activations to the same tp rank of the next stage and the receiver
all-gathers them (``holder``); every rank of a tp group is fed the same micro-batches. Beside
ZeRO-2/3 FSDP2 shards the tp shards over dp (2-D DTensors). ZeRO-1 beside it is refused
(``trainer.launch_config.check_realisable``).

Checkpoints: one file per stage, i.e. per pipeline rank with all its chunks (its parameters
under the whole model's names, and its optimizer state), then rank 0 writes
``consolidated.safetensors`` from them, so a run re-planned to another layout resumes from the
full weights (optimizer restarted). Sharded states are gathered whole into the stage file.

Llama-family decoders (``model.model.layers``, ``embed_tokens``, ``norm``, ``rotary_emb``,
``lm_head``) only; full fine-tuning, no evaluation split, no offload or cp beside it.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

from trainer.parallel import pipeline_layers_rule
from trainer.problems import InputProblem

STAGE_FILE = "stage-{stage:02d}.pt"


class PipeLayout(NamedTuple):
    """One rank's coordinates in a ``dp x pp x tp`` pipeline: the device mesh's row-major order
    ``rank = (dp_rank x pp + stage) x tp + tp_rank``, so a tensor-parallel group is consecutive
    ranks (inside a node, as AutoTP's) and one pipeline's stages are ``tp`` ranks apart."""

    dp: int
    pp: int
    dp_rank: int
    stage: int
    tp: int = 1
    tp_rank: int = 0

    def rank_of(self, dp_rank: int, stage: int, tp_rank: int = 0) -> int:
        return (dp_rank * self.pp + stage) * self.tp + tp_rank


def pipe_layout(plan: dict[str, Any], rank: int) -> PipeLayout:
    dp, pp, tp = int(plan.get("dp", 1)), int(plan.get("pp", 1)), int(plan.get("tp", 1))
    if not 0 <= rank < dp * pp * tp:
        raise ValueError(f"rank {rank} outside a dp {dp} x pp {pp} x tp {tp} layout")
    return PipeLayout(dp, pp, rank // (pp * tp), rank // tp % pp, tp, rank % tp)


def stage_layers(layers: int, pp: int, stage: int) -> tuple[int, int]:
    """The decoder layers ``[lo, hi)`` of ``stage`` of ``pp`` stages (interleaved: of the
    ``pp x vpp`` chunks): as even as the count allows, the first stages one more (the
    estimator's split, ``estimator.models.stage_layers``, whose counts these bounds are)."""
    from estimator.models import stage_layers as counts_of

    counts = counts_of(layers, pp)
    lo = sum(counts[:stage])
    return lo, lo + counts[stage]


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

    inner = model.model
    lo, hi = stage_layers(len(inner.layers), pp, stage)
    first, last = stage == 0, stage == pp - 1
    cap = getattr(model.config, "final_logit_softcapping", None)

    class Stage(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = inner.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(inner.layers[lo:hi])
            self.rotary_emb = inner.rotary_emb
            self.rotary_per_type = rotary_per_type(inner.rotary_emb)
            self.norm = inner.norm if last else None
            self.lm_head = model.lm_head if last else None
            self.config = model.config
            # the whole model's name of each of this stage's parameters, by the stage's own
            # name (FSDP2 replaces the parameter objects but keeps their names)
            whole = {id(p): n for n, p in model.named_parameters()}
            self.names = {n: whole[id(p)] for n, p in self.named_parameters()}

        def forward(self, x):
            h = self.embed_tokens(x) if first else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            masks = layer_masks(self.config, lo, hi, inputs_embeds=h, attention_mask=None, cache=None,
                                position_ids=pos)
            pes = layer_rotary(self.rotary_emb, self.rotary_per_type, self.config, lo, hi, h, pos)
            for layer, mask, pe in zip(self.layers, masks, pes):
                h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
            if last:
                h = self.lm_head(self.norm(h))
                if cap:          # Gemma 2 soft-caps its logits in the model's forward, after the head
                    h = torch.tanh(h / cap) * cap
            return h

        def full_names(self) -> dict[str, Any]:
            """Whole-model name -> parameter, for the checkpoint."""
            return {self.names[n]: p for n, p in self.named_parameters()}

    return Stage()


def layer_masks(config, lo: int, hi: int, **kw) -> list:
    """The attention mask of each of the whole model's layers ``lo..hi-1``, as the model's own
    forward makes them: per ``config.layer_types`` (Qwen2/3: full or sliding attention per
    layer), else a sliding window for every layer where the config has one (Mistral), else
    causal; ``kw``: the mask functions' other arguments."""
    from transformers.masking_utils import create_causal_mask as causal
    from transformers.masking_utils import create_sliding_window_causal_mask as sliding

    kw["config"] = config
    types = getattr(config, "layer_types", None)
    if types:
        made = {t: (sliding if t == "sliding_attention" else causal)(**kw) for t in set(types[lo:hi])}
        return [made[types[i]] for i in range(lo, hi)]
    one = (sliding if getattr(config, "sliding_window", None) is not None else causal)(**kw)
    return [one] * (hi - lo)


def rotary_per_type(rotary_emb) -> bool:
    """Whether the model's rotary embedding makes one (cos, sin) per layer type (Gemma 3: its
    local layers rotate at another base than its global ones)."""
    import inspect

    return "layer_type" in inspect.signature(rotary_emb.forward).parameters


def layer_rotary(rotary_emb, per_type: bool, config, lo: int, hi: int, h, pos) -> list:
    """The rotary (cos, sin) of each of the whole model's layers ``lo..hi-1``, as the model's own
    forward makes them: one per layer type where the embedding takes the type
    (``rotary_per_type``), else one for all."""
    if per_type:
        types = config.layer_types
        made = {t: rotary_emb(h, pos, t) for t in set(types[lo:hi])}
        return [made[types[i]] for i in range(lo, hi)]
    return [rotary_emb(h, position_ids=pos)] * (hi - lo)


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
        from torch.distributed.device_mesh import init_device_mesh
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
        # the (dp, pp, tp) device mesh: every group below is one of its dimensions (every rank
        # creates every group, in the same order: new_group is collective)
        self.mesh = init_device_mesh(device.type, (lay.dp, lay.pp, lay.tp), mesh_dim_names=("dp", "pp", "tp"))
        self.pp_group, self.dp_group = self.mesh.get_group("pp"), self.mesh.get_group("dp")
        self.tie_group = None
        if self.tied:
            for d in range(lay.dp):
                for t in range(lay.tp):
                    g = dist.new_group([lay.rank_of(d, 0, t), lay.rank_of(d, lay.pp - 1, t)])
                    if (d, t) == (lay.dp_rank, lay.tp_rank) and (self.first or self.last):
                        self.tie_group = g
        self.zero = int(plan.get("zero", 0))
        # tp > 1: each chunk's matrices sharded over the stage's tensor-parallel ranks
        # (``tensor_parallel``) before FSDP2 and the optimizer see them
        self.tp_partial: list = []        # modules of whole weights whose gradients sum over the tp ranks
        if lay.tp > 1:
            self.tp_partial = tensor_parallel(model, self.chunks, self.mesh["tp"])
        # ZeRO-2/3: each chunk sharded over its stage's replicas before the optimizer is built
        # (over the shards), and handed to its stage behind a holder (``fsdp``)
        self.sharded = self.zero >= 2
        if self.sharded:
            fsdp(self.chunks, self.mesh["dp"], self.zero)
        # weights held as DTensors (tp shards, FSDP2 shards): checkpoints gather them
        self.dtensors = self.sharded or lay.tp > 1
        tp_mesh = self.mesh["tp"] if lay.tp > 1 else None
        units = [holder(m, tp_mesh, gather_input=c > 0, scatter_output=c < n_chunks - 1)
                 if self.dtensors else m for m, c in zip(self.chunks, ids)]
        stages = [PipelineStage(m, c, n_chunks, device, group=self.pp_group) for m, c in zip(units, ids)]
        if self.vpp > 1:
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=self.ga, loss_fn=causal_lm_loss,
                                                    scale_grads=True)
        else:
            kind = Schedule1F1B if self.ga >= lay.pp else ScheduleGPipe
            self.schedule = kind(stages[0], n_microbatches=self.ga, loss_fn=causal_lm_loss, scale_grads=True)
        self.optimizer, self.optimizer_impl = make_optimizer(self.module)
        self.grad_norm: float | None = None          # the last step's global norm before clipping
        if self.zero == 1:
            self.optimizer, self.optimizer_impl = zero1(self.optimizer, self.optimizer_impl, self.dp_group)
        elif self.sharded:
            self.optimizer_impl = f"torch.distributed.fsdp.fully_shard({self.optimizer_impl})"
        if lay.tp > 1:
            self.optimizer_impl = f"torch.distributed.tensor.parallel({self.optimizer_impl})"

    def tied_weight(self):
        return self.chunks[0].embed_tokens.weight if self.first else self.chunks[-1].lm_head.weight

    def sum_tied_gradients(self) -> None:
        """A tied embedding's two copies (first and last stage) get the sum of their gradients.
        FSDP2 alone shards both alike (the same shape over the same dp size): the shards are
        summed in place. Beside tensor parallel the embeddings shard the hidden size and the head
        the vocabulary: each stage gathers its whole gradient (over its tp and dp ranks), the
        two are summed and each rank keeps its part again (a transient of the whole
        ``V x hidden`` gradient on those two stages)."""
        import torch.distributed as dist

        grad = self.tied_weight().grad
        if self.lay.tp == 1:
            dist.all_reduce(local(grad), group=self.tie_group)
            return
        from torch.distributed.tensor import distribute_tensor

        whole = grad.full_tensor()
        dist.all_reduce(whole, group=self.tie_group)
        local(grad).copy_(distribute_tensor(whole, grad.device_mesh, grad.placements, src_data_rank=None).to_local())

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
        # tp > 1: the last stage's logits stay sharded over the vocabulary (the head's
        # ``Shard(-1)`` output) and the loss is computed on the shards (``loss_parallel``)
        with vocab_parallel_loss(self.lay.tp > 1 and self.last):
            if self.first:
                self.schedule.step(x, target=x if self.last else None, losses=losses)
            elif self.last:
                self.schedule.step(target=x, losses=losses)
            else:
                self.schedule.step()
        params = [p for p in self.module.parameters() if p.grad is not None]
        for p in (p for m in self.tp_partial for p in m.parameters()):
            if p.grad is not None:            # each tp rank's share of a whole weight's gradient
                dist.all_reduce(local(p.grad), group=self.mesh.get_group("tp"))
        # FSDP2 has reduce-scattered them already: each replica holds its shard, averaged
        if self.lay.dp > 1 and not self.sharded:
            for p in params:
                dist.all_reduce(local(p.grad), group=self.dp_group)
                p.grad.div_(self.lay.dp)
        if self.tied and self.tie_group is not None and self.lay.pp > 1:
            self.sum_tied_gradients()
        if clip:
            # one norm over the whole model: every rank's squares summed over the world, each
            # divided by the ranks that hold the same values (data-parallel replicas, the tp
            # ranks of a replicated weight); a tied weight counted once (on the first stage)
            # A Partial gradient (unreduced) has no norm: counted beside the squares, so every
            # rank learns it from the one all-reduce and all stop together (one rank raising
            # alone would leave the others waiting in the collective)
            own = [p for p in params if not (self.tied and self.last and self.lay.pp > 1
                                             and p is self.tied_weight())]
            sq = torch.zeros(2, dtype=torch.float64, device=x.device)     # squares, Partial gradients
            for p in own:
                n = copies(p.grad, self.lay.dp * self.lay.tp)
                if n is None:
                    sq[1] += 1
                else:
                    sq[0] += local(p.grad).detach().double().pow(2).sum() / n
            dist.all_reduce(sq)
            if sq[1] > 0:
                raise RuntimeError(f"{int(sq[1])} gradients with a Partial placement (unreduced) have no norm yet")
            self.grad_norm = math.sqrt(float(sq[0]))
            coef = clip / (self.grad_norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=x.device)
        if self.lay.tp_rank == 0:                     # the tp ranks of the last stage hold one loss
            for loss in losses:
                total += local(loss).detach().float()
        return total

    # -------------------------------------------------------------- checkpoints
    def save(self, path: Path) -> None:
        """This stage's weights (whole-model names) and optimizer state; the first data-parallel
        replica of each stage writes. Every rank calls it: under ZeRO-1 the stage's optimizer
        shards are first gathered to that replica (a collective over the stage's dp group), so
        the file holds the whole stage's state, which each replica's partition loads back.
        Under ZeRO-2/3 (FSDP2) and tensor parallel every weight and optimizer state is gathered
        from its shards the same way, one tensor at a time to the host (the optimizer state keyed
        by parameter name, torch.distributed.checkpoint's layout), so the file holds whole tensors
        too; the first tp rank of the first replica writes."""
        import torch

        writer = self.lay.dp_rank == 0 and self.lay.tp_rank == 0
        if self.zero == 1:
            self.optimizer.consolidate_state_dict(to=0)   # rank 0 of the dp group: dp_rank 0
        if self.dtensors:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            params = {n: gathered(p, writer) for n, p in self.full_names().items()}
            optimizer = gathered(get_optimizer_state_dict(self.module, self.optimizer), writer)
        elif writer:
            params = {n: p.detach().cpu() for n, p in self.full_names().items()}
            optimizer = self.optimizer.state_dict()
        if writer:
            path.mkdir(parents=True, exist_ok=True)
            torch.save({"params": params, "optimizer": optimizer}, path / STAGE_FILE.format(stage=self.lay.stage))

    def load(self, path: Path) -> None:
        import torch

        state = torch.load(path / STAGE_FILE.format(stage=self.lay.stage), map_location="cpu", weights_only=False)
        with torch.no_grad():
            for n, p in self.full_names().items():
                if hasattr(p, "device_mesh"):   # every rank read the whole tensor: each keeps its shard
                    from torch.distributed.tensor import distribute_tensor

                    whole = state["params"][n].to(p.device)
                    p.to_local().copy_(distribute_tensor(whole, p.device_mesh, p.placements,
                                                         src_data_rank=None).to_local())
                else:
                    p.copy_(state["params"][n])
        if self.dtensors:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=True))
        else:
            self.optimizer.load_state_dict(state["optimizer"])


def fsdp(chunks, dp_mesh, zero: int) -> None:
    """ZeRO-2/3 over a stage's data-parallel replicas: FSDP2 (``fully_shard``) on each decoder
    layer and on each chunk (embeddings, norm and head in the chunk's own unit) over the stage's
    data-parallel ranks. Parameters, gradients and optimizer states are sharded between steps; ZeRO-3
    (``reshard_after_forward``) frees each unit's gathered weights after its forward and gathers
    them again for its backward, ZeRO-2 keeps them from the forward to the backward.

    Each chunk reaches its ``PipelineStage`` inside a ``holder``: given an FSDP module itself,
    the stage (torch 2.13, ``backward_maybe_with_nosync`` and ``perform_reduce_grad``) runs
    every micro-batch's backward without gradient sync and without resharding and
    reduce-scatters once after the last, so the stage would hold its whole weights and whole
    gradients through the step's backward: ZeRO-1's memory plus the shards. Behind the holder
    FSDP2's own backward hooks run: each unit reduce-scatters its gradients (accumulated into
    the sharded ones) and reshards after every micro-batch's backward, the memory ZeRO-2/3 stand
    for (and the estimator counts), for one reduce-scatter per unit and micro-batch.

    ``dp_mesh``: the data-parallel dimension of the pipeline's (dp, pp, tp) mesh; beside tensor
    parallel FSDP2 shards the tp shards over it (2-D DTensors, the tp dimension its sibling)."""
    from torch.distributed.fsdp import fully_shard

    for chunk in chunks:
        for layer in chunk.layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=zero == 3)
        fully_shard(chunk, mesh=dp_mesh, reshard_after_forward=zero == 3)


def holder(module, tp_mesh=None, *, gather_input: bool = False, scatter_output: bool = False):
    """``module`` behind a plain module that calls it (``fsdp`` says why). Beside tensor parallel
    (``tp_mesh``) it also cuts the point-to-point volume by tp (Megatron-LM's scatter-gather):
    a chunk that sends its output on keeps only its tp rank's slice of the hidden size (the
    backward all-gathers the slices' gradients), a chunk that receives one all-gathers the
    slices over its tp ranks (the backward keeps the slice's gradient), so each tp rank sends
    ``1 / tp`` of the activation, as the throughput model's pipeline term counts."""
    import torch

    def relaid(t, have, want):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t, tp_mesh, [have], run_check=False).redistribute(tp_mesh, [want]).to_local()

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = module

        def forward(self, x):
            if tp_mesh is None:
                return self.inner(x)
            from torch.distributed.tensor import Replicate, Shard

            y = self.inner(relaid(x, Shard(-1), Replicate()) if gather_input else x)
            return relaid(y, Replicate(), Shard(-1)) if scatter_output else y

    return Holder()


def tensor_parallel(model, chunks, tp_mesh) -> list:
    """Tensor parallel inside each pipeline stage, torch's DTensor ``parallelize_module`` over the
    stage's tp ranks: every decoder layer by the model's own plan (``base_model_tp_plan``; Llama:
    q/k/v/gate/up column-wise, o/down row-wise, so two all-reduces forward and two backward per
    layer), the embeddings over the hidden size (column-wise, an all-gather of the looked-up
    slices: torch 2.13's DTensor computes a vocabulary-sharded embedding's weight gradient whole
    on every rank, ``embedding_dense_backward`` having no vocabulary-sharded strategy, which would
    hold ``V x hidden`` gradients per rank where this holds ``1 / tp`` of them), the head
    column-wise (over the vocabulary) with its logits left sharded for a vocab-parallel loss
    (``vocab_parallel_loss``). Norms stay whole (plain tensors, equal on every tp rank: their
    inputs and gradients are replicated). Heads and KV heads divide by tp (``check_heads``).
    Weights the plan marks ``replicated_with_grad_allreduce`` (Qwen3's per-head q/k norms, which
    see only the rank's heads) stay whole too; their gradients are partial sums over the rank's
    heads: their modules are returned, for the step to sum them over the tp ranks (modules, not
    parameters: FSDP2 replaces a module's parameters with its shards)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = getattr(model.config, "base_model_tp_plan", None) or {}
    layer_plan, summed = {}, []
    for key, style in plan.items():
        if not key.startswith("layers.*."):
            continue
        if style == "replicated_with_grad_allreduce":
            summed.append(key.removeprefix("layers.*."))
            continue
        if style not in styles:
            raise InputProblem(f"plan.tp: the model's tensor-parallel plan has {key}: {style!r}; "
                               f"a pipeline stage shards {', '.join(styles)} layers only")
        layer_plan[key.removeprefix("layers.*.")] = styles[style]()
    if not layer_plan:
        raise InputProblem(f"plan.tp: {type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan)")
    partial = []
    for chunk in chunks:
        for layer in chunk.layers:
            parallelize_module(layer, tp_mesh, layer_plan)
            partial += [layer.get_submodule(name) for name in summed]
        if chunk.embed_tokens is not None:
            parallelize_module(chunk.embed_tokens, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
        if chunk.lm_head is not None:
            parallelize_module(chunk.lm_head, tp_mesh,
                               ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    return partial


def vocab_parallel_loss(active: bool):
    """Context: the cross entropy (and its backward) on vocabulary-sharded logits, torch's
    ``loss_parallel``, where ``active`` (the last stage beside tensor parallel)."""
    import contextlib

    if not active:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def copies(t, block: int) -> int | None:
    """Ranks of a stage's ``block`` (dp x tp ranks) that hold the same values as this rank's
    part of ``t``: a DTensor's shards are distinct over its sharded mesh dimensions and equal
    over its replicated ones; a plain tensor is equal on all of them. None for a ``Partial``
    placement (unreduced values: no norm; ``Pipeline.step`` stops every rank on it). (FSDP2
    beside tensor parallel shards over dp with a ``_StridedShard``, which ``is_shard()`` does not
    count: every other placement but ``Replicate`` is a sharding here.)"""
    placements = getattr(t, "placements", None)
    if placements is None:
        return block
    distinct = 1
    for dim, placement in enumerate(placements):
        if placement.is_partial():
            return None
        if not placement.is_replicate():
            distinct *= t.device_mesh.size(dim)
    return block // distinct


def local(t):
    """A gradient's part on this rank: its shard under FSDP2 (a DTensor), the tensor otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def gathered(obj, keep: bool):
    """``obj`` (a tensor, or dicts/lists of them) with every sharded tensor gathered whole, on the
    host where ``keep`` (the replica that writes; the others drop each whole tensor at once). A
    collective over each tensor's mesh: every replica calls it in the same order."""
    if hasattr(obj, "detach"):
        whole = obj.full_tensor() if hasattr(obj, "full_tensor") else obj
        return whole.detach().cpu() if keep else None
    if isinstance(obj, dict):
        return {k: gathered(v, keep) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(gathered(v, keep) for v in obj)
    return obj


def zero1(optimizer, impl: str, dp_group):
    """ZeRO-1 over a stage's data-parallel replicas: torch's ``ZeroRedundancyOptimizer`` with the
    job's optimizer class and settings, each replica keeping the states of its share of the
    stage's parameters (partitioned by size) and broadcasting its updated parameters after the
    step. Gradients stay whole and all-reduced (ZeRO-1), so the pipeline's own averaging, tied
    embedding sum and global norm are unchanged. It needs only broadcasts (gloo has them).
    ZeRO-2/3 are FSDP2's (``fsdp``)."""
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
