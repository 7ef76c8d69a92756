"""Pieces of the training program, in-process (no launcher): model construction from the
estimator's config, activation checkpointing that changes memory but not the math, the
learning-rate rule, transient-error classification, checkpoint bookkeeping."""
from __future__ import annotations

import json

import pytest
import torch

from estimator.models import resolve_model
from trainer import checkpoints as ck
from trainer.modeling import build_model
from trainer.optim import lr_at
from trainer.train import apply_activation_checkpointing, is_transient

LLAMA_TINY = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256}


def spec_for(model, attention="flash"):
    return {"hf_config": resolve_model(model).hf_config(), "plan": {"attention": attention, "precision": "fp32"},
            "entry_point": None}


def grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model,attention", [("gpt2-tiny", "flash"), ("gpt2-tiny", "eager"), (LLAMA_TINY, "flash")])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_keeps_loss_and_gradients(model, attention, mode):
    torch.manual_seed(0)
    ref = build_model(spec_for(model, attention), "cpu")
    torch.manual_seed(0)
    ckm = build_model(spec_for(model, attention), "cpu")
    ckm.load_state_dict(ref.state_dict())
    applied = apply_activation_checkpointing(ckm, mode)
    assert applied.startswith(mode)
    ref.train(), ckm.train()
    x = torch.randint(0, 256, (2, 32))
    l1, g1 = grads(ref, x)
    l2, g2 = grads(ckm, x)
    assert torch.allclose(l1, l2, atol=1e-6)
    assert g1.keys() == g2.keys()
    for n in g1:
        assert torch.allclose(g1[n], g2[n], atol=1e-5), n


def test_model_matches_the_estimators_parameter_count():
    for model in ("gpt2-tiny", LLAMA_TINY):
        m = build_model(spec_for(model), "cpu")
        n = sum(p.numel() for p in m.parameters())             # tied weights counted once
        assert n == resolve_model(model).params


def test_lr_rule_depends_on_the_step_only():
    assert lr_at(1, 1e-3, 1000) == pytest.approx(1e-5)
    assert lr_at(100, 1e-3, 1000) == 1e-3 == lr_at(999, 1e-3, 1000)
    assert lr_at(1, 1e-3, 5) == 1e-3


def test_transient_errors():
    assert is_transient(RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert is_transient(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"))
    assert not is_transient(ValueError("labels and logits have different shapes"))


def test_checkpoint_bookkeeping(tmp_path):
    for step in (2, 4, 6):
        d = ck.checkpoint_path(tmp_path, step)
        d.mkdir(parents=True)
        (d / ck.MARKER).write_text(json.dumps({"step": step, "format": ck.state_format(zero=0, world=1, offload="none")}))
    ck.checkpoint_path(tmp_path, 8).mkdir()                     # an interrupted save: no marker
    assert ck.latest_checkpoint(tmp_path).step == 6
    ck.prune(tmp_path, keep=2)
    assert [c.step for c in ck.list_checkpoints(tmp_path)] == [4, 6]
    plain1, plain4 = ck.state_format(zero=0, world=1, offload="none"), ck.state_format(zero=0, world=4, offload="none")
    z2w2, z2w4 = ck.state_format(zero=2, world=2, offload="none"), ck.state_format(zero=2, world=4, offload="none")
    assert ck.full_resume_possible(plain1, plain4)              # full tensors load at any world size
    assert not ck.full_resume_possible(plain1, z2w2)
    assert not ck.full_resume_possible(z2w2, z2w4)              # ZeRO shards need the same layout
    assert ck.full_resume_possible(z2w2, dict(z2w2))
