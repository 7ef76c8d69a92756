"""The traced estimator (FakeTensorMode + MemTracker) and its use as the analytic model's oracle.

The oracle grid: single-GPU configurations (architectures x sizes x batch x sequence x
precision regime x optimizer x checkpointing x attention) on tiny models, so each trace takes
well under a second. The analytic allocated peak, evaluated with CPU kernel semantics (what
the trace runs), must stay within 5 % of the traced one. Where and why the two differ in
general is in docs/benchmarks-estimator.md.

Every run of the suite traces a pairwise-covering set (every pair of values of any two
dimensions appears in some configuration: 18 configurations, ~0.3 s each on 2 cores); the
200-configuration sample (~60-100 s) runs with ``pytest -m bench``.
"""
import itertools
import random
import time
import warnings

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from estimator import estimate  # noqa: E402
from estimator.memory import stage_peaks, validate_knobs  # noqa: E402
from estimator.models import ModelSpec  # noqa: E402
from estimator.overheads import overheads_for  # noqa: E402
from estimator.traced import trace_step  # noqa: E402

ARCHS = {
    "gpt": dict(arch="gpt"),
    "llama-gqa": dict(arch="llama", kv_heads=2),
    "opt": dict(arch="opt"),
    "bert": dict(arch="bert"),
    "qwen2-tied-bias": dict(arch="llama", kv_heads=2, hf_model_type="qwen2", qkv_bias=True,
                            tied_embeddings=True),
    # per-head q/k norms; heads wider than hidden / heads (q and k 2-2.7x the hidden size)
    "qwen3": dict(arch="llama", kv_heads=2, hf_model_type="qwen3", head_dim=128),
    # a window the 512-token shape reaches (SDPA then gets an explicit mask) and the 256 one not
    "mistral-window": dict(arch="llama", kv_heads=2, hf_model_type="mistral", sliding_window=384),
    # Gemma's fp32-scaling norms, one KV head, 128-wide heads; Gemma 3 adds post-sublayer and
    # q/k norms and windows every other layer (the 2-layer size has one local, one global)
    "gemma": dict(arch="llama", kv_heads=1, hf_model_type="gemma", head_dim=128),
    "gemma3": dict(arch="llama", kv_heads=2, hf_model_type="gemma3_text", head_dim=128, sliding_window=384,
                   window_pattern=2),
    # Gemma 2: soft-capped attention scores (eager only), every other layer windowed. Its logit
    # cap is left out: the fake-tensor trace keeps one more 16-bit copy per logit on that chain
    # than a real run does (tests/test_estimator_gemma.py measures the real one)
    "gemma2": dict(arch="llama", kv_heads=2, hf_model_type="gemma2", head_dim=128, sliding_window=384,
                   attn_softcap=50.0, logit_softcap=None),
    # Phi-3: fused qkv and gate/up projections (its merged attention output a copy), a window
    "phi3": dict(arch="llama", kv_heads=2, hf_model_type="phi3", sliding_window=384),
}
# architectures Hugging Face builds without SDPA (their attention is eager only)
EAGER_ONLY = {"gemma2"}
# Fake tensors cost the same at any size, so the grid uses realistic ratios of hidden size,
# vocabulary and tokens (tiny hidden sizes would exaggerate per-token bookkeeping).
SIZES = [dict(layers=1, hidden=256, heads=4, vocab=8192), dict(layers=2, hidden=384, heads=6, vocab=16384)]
SHAPES = [(1, 512), (4, 256)]
REGIMES = [("bf16", 0), ("fp32", 0), ("bf16", 1)]          # AMP, fp32, master weights
OPTIMIZERS = ["adamw", "sgd", "adafactor"]
CKPTS = ["none", "full"]
ATTNS = ["flash", "eager"]


def valid_configs() -> list[tuple]:
    return [c for c in itertools.product(ARCHS, range(len(SIZES)), SHAPES, REGIMES, OPTIMIZERS,
                                         CKPTS, ATTNS)
            if not (c[4] == "adafactor" and c[3][1] >= 1) and not (c[0] in EAGER_ONLY and c[6] == "flash")]


def oracle_grid(n: int = 200, seed: int = 0) -> list[tuple]:
    return random.Random(seed).sample(valid_configs(), n)


def _value_pairs(c: tuple) -> set[tuple]:
    return {(i, c[i], j, c[j]) for i, j in itertools.combinations(range(len(c)), 2)}


def covering_grid() -> list[tuple]:
    """Greedy pairwise cover of the valid configurations: every (dimension, value) pair that any
    valid configuration has appears in one of them (so every architecture meets every regime,
    optimizer, shape, checkpointing and attention, and so on). Deterministic."""
    valid = valid_configs()
    need = set().union(*map(_value_pairs, valid))
    out = []
    while need:
        best = max(valid, key=lambda c: len(_value_pairs(c) & need))
        out.append(best)
        need -= _value_pairs(best)
    return out


def _spec(arch: str, size: int) -> ModelSpec:
    return ModelSpec(name=arch, max_positions=512, **ARCHS[arch], **SIZES[size])


def _assert_analytic_matches_traced(grid: list[tuple]) -> None:
    ov = overheads_for(None, is_cpu=True)
    errors, worst = [], (0.0, None)
    t0 = time.perf_counter()
    for arch, size, (b, s), (prec, zero), opt, ck, attn in grid:
        spec = _spec(arch, size)
        k = validate_knobs(spec, seq_len=s, micro_batch=b, precision=prec, zero=zero,
                           optimizer=opt, act_ckpt=ck, attention=attn)
        traced = trace_step(spec, k)["Total"]
        analytic = max(p.allocated for p in stage_peaks(spec, k, ov, cpu=True))
        err = (analytic - traced) / traced
        errors.append(err)
        if abs(err) > abs(worst[0]):
            worst = (err, (arch, size, b, s, prec, zero, opt, ck, attn))
    elapsed = time.perf_counter() - t0
    print(f"oracle grid: {len(grid)} configs in {elapsed:.0f}s, worst {worst[0]:+.1%} at {worst[1]}")
    assert abs(worst[0]) <= 0.05, worst


@pytest.mark.slow
def test_analytic_matches_traced_on_a_pairwise_covering_grid():
    grid = covering_grid()
    valid = valid_configs()
    # each value of each dimension, and each pair of values, appears
    assert set().union(*map(_value_pairs, grid)) == set().union(*map(_value_pairs, valid))
    assert set(grid) <= set(valid)
    _assert_analytic_matches_traced(grid)


@pytest.mark.slow
@pytest.mark.bench
def test_analytic_matches_traced_on_200_configs():
    grid = oracle_grid()
    assert len(grid) >= 200
    _assert_analytic_matches_traced(grid)


def test_traced_estimate_contract_gpt2_tiny():
    e = estimate(model="gpt2-tiny", seq_len=128, micro_batch=2, method="traced")
    a = estimate(model="gpt2-tiny", seq_len=128, micro_batch=2)
    assert e.method == "traced" and e.params == a.params
    assert set(e.breakdown_gib) == {"weights", "gradients", "optimizer", "activations", "other"}
    assert e.allocated_peak_gib == pytest.approx(a.allocated_peak_gib, rel=0.05)
    assert e.allocated_peak_gib <= e.reserved_peak_gib <= e.device_used_gib
    assert e.warnings and "traced one rank" in e.warnings[0]


def test_traced_adds_distribution_terms_analytically():
    single = estimate(model="gpt2-tiny", seq_len=128, micro_batch=2, method="traced")
    sharded = estimate(model="gpt2-tiny", seq_len=128, micro_batch=2, dp=4, zero=3, method="traced")
    assert sharded.allocated_peak_gib < single.allocated_peak_gib
    assert len(estimate(model="gpt2-tiny", seq_len=64, pp=2, grad_accum=2,
                        method="traced").stages) == 2


def test_untraceable_falls_back_with_a_warning():
    with pytest.warns(UserWarning, match="fell back to analytic"):
        e = estimate(model="gpt2-tiny", seq_len=64, optimizer="adamw8bit", method="traced")
    assert e.method == "analytic" and "bitsandbytes" in e.warnings[0]


def test_user_module_factory():
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 64)
            self.out = torch.nn.Linear(64, 256)

        def forward(self, ids):
            return self.out(torch.relu(self.emb(ids)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")     # must trace, not fall back
        e = estimate(model="gpt2-tiny", seq_len=64, micro_batch=2, precision="fp32",
                     method="traced", model_factory=Tiny)
    assert e.method == "traced" and e.allocated_peak_gib > 0


def test_legacy_foreach_adam_second_temporary_traced():
    # PyTorch 2.0/2.1's foreach Adam built its denominator out of place: at the step, one more
    # state-sized temporary than today's in-place update. The trace runs both updates; a short
    # fp32 sequence makes the step the peak, where the analytic model adds 4 B per parameter
    spec = _spec("gpt", 0)
    ov = overheads_for(None, is_cpu=True)
    peaks = {}
    for impl in ("foreach", "foreach-legacy"):
        k = validate_knobs(spec, seq_len=16, precision="fp32", adamw_impl=impl)
        peaks[impl] = (trace_step(spec, k)["Total"],
                       max(p.allocated for p in stage_peaks(spec, k, ov, cpu=True)))
    # the legacy step is the peak of both: weights + gradients + 2 states + 2 temporaries
    assert peaks["foreach-legacy"][1] == pytest.approx(peaks["foreach-legacy"][0], rel=0.02)
    assert peaks["foreach-legacy"][1] == pytest.approx(24.0 * spec.train_params, rel=0.01)
    assert peaks["foreach-legacy"][1] - peaks["foreach"][1] == pytest.approx(4.0 * spec.train_params,
                                                                           rel=1e-6)
    # (today's foreach step stays below this tiny model's backward peak in the trace)
    assert peaks["foreach-legacy"][0] > peaks["foreach"][0]


def test_fp32_logits_loss_traced():
    # transformers before 4.46 returned fp32 logits from forward: 2 B per logit more than
    # today's path at the loss backward's peak; the trace runs that forward + shifted loss
    spec = _spec("llama-gqa", 1)
    ov = overheads_for(None, is_cpu=True)
    got = {}
    for loss in ("standard", "fp32-logits"):
        # (the hf profile: Frenzy's own trainer runs today's transformers only)
        k = validate_knobs(spec, seq_len=512, micro_batch=2, zero=1, loss=loss, framework="hf",
                           mp_style="master")
        got[loss] = (trace_step(spec, k)["Total"],
                     max(p.allocated for p in stage_peaks(spec, k, ov, cpu=True)))
        assert got[loss][1] == pytest.approx(got[loss][0], rel=0.02)
    logits = 2 * 512 * spec.vocab_padded
    assert got["fp32-logits"][1] - got["standard"][1] == pytest.approx(2.0 * logits, rel=0.01)


@pytest.mark.parametrize("window,masked", [(64, True), (256, True), (512, False)])
def test_a_sliding_window_the_sequence_reaches_saves_an_sdpa_mask_per_layer(window, masked):
    """The rule ``layer_activation_bytes`` counts for Mistral's sliding window under SDPA, on the
    installed transformers and torch (saved-tensor hooks, CPU): a window no longer than the
    sequence makes each layer save a b x 1 x s x s mask in the query dtype, and with a mask
    transformers repeats the grouped k / v to every head before SDPA, which saves the repeated
    copies; a longer window takes the is_causal path and changes nothing. The estimate adds
    exactly the bytes the hooks see, and says so. Selective checkpointing recomputes the mask:
    only the repeated k / v stay."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    b, s, layers, heads, kv, d = 2, 256, 2, 4, 2, 16

    def saved_bytes(w):
        torch.manual_seed(0)
        cfg = MistralConfig(hidden_size=heads * d, intermediate_size=128, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=kv, vocab_size=128, sliding_window=w,
                            attn_implementation="sdpa")
        m = MistralForCausalLM(cfg).to(torch.bfloat16)
        m.train()
        saved, masks = {}, []

        def pack(t):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            if t.dim() == 4 and t.shape[-2:] == (s, s):
                masks.append((tuple(t.shape), t.dtype))
            return t

        ids = torch.randint(0, 128, (b, s))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(input_ids=ids, labels=ids)
        return sum(saved.values()), masks

    with_window, masks = saved_bytes(window)
    without, _ = saved_bytes(None)
    assert masks == ([((b, 1, s, s), torch.bfloat16)] * layers if masked else [])
    kw = dict(arch="llama", layers=layers, hidden=heads * d, heads=heads, kv_heads=kv, ffn=128, vocab=128)

    def extra(**knobs):
        windowed = estimate(model=dict(kw, hf_model_type="mistral", sliding_window=window), seq_len=s,
                            micro_batch=b, **knobs)
        plain = estimate(model=dict(kw, hf_model_type="mistral"), seq_len=s, micro_batch=b, **knobs)
        return (windowed.allocated_peak_gib - plain.allocated_peak_gib) * 2 ** 30, windowed.warnings

    added, notes = extra()
    assert added == pytest.approx(with_window - without, abs=1.0)
    assert any("sliding window" in w for w in notes) == masked
    repeated = layers * b * s * 2 * 2 * (heads - kv) * d if masked else 0.0     # bf16 k and v
    assert extra(act_ckpt="selective")[0] == pytest.approx(repeated, abs=1.0)
