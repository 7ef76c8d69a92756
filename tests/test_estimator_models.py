"""Model presets, exact parameter counts, config.json reading, hf_config round trip."""
import json
import math

import pytest

from estimator.errors import FrenzyInputError
from estimator.models import PRESETS, ModelSpec, model_from_kwargs, resolve_model

ISSUE_PRESETS = ["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "bert-base-uncased",
                 "bert-large-uncased", "opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b", "opt-6.7b",
                 "opt-13b", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3.1-8b",
                 "llama-3.1-70b", "mistral-7b", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b",
                 "qwen2.5-7b", "gpt2-tiny"]

# Published totals (model cards / papers / the notes' fixture table).
PUBLISHED = {
    "gpt2": 124_439_808, "gpt2-xl": 1_557_611_200, "bert-base-uncased": 109_482_240,
    "bert-large-uncased": 335_141_888, "llama-2-7b": 6_738_415_616, "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192, "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096, "qwen2.5-0.5b": 494_032_768, "qwen2.5-1.5b": 1_543_714_304,
    "qwen2.5-7b": 7_615_616_512, "opt-125m": 125_239_296, "opt-350m": 331_196_416,
}


def test_issue_presets_exist():
    missing = [n for n in ISSUE_PRESETS if n not in PRESETS]
    assert not missing


@pytest.mark.parametrize("name,total", sorted(PUBLISHED.items()))
def test_published_parameter_counts(name, total):
    assert PRESETS[name].params == total


def test_gpt2_tiny_shape():
    m = PRESETS["gpt2-tiny"]
    assert (m.layers, m.hidden, m.heads, m.max_positions, m.vocab) == (2, 64, 4, 256, 256)
    assert m.model_type == "gpt2"


@pytest.mark.parametrize("name", ["gpt2", "opt-350m", "llama-2-7b", "llama-3.1-8b", "mistral-7b",
                                  "qwen2.5-0.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-8b", "bert-base-uncased"])
def test_hf_config_builds_exactly_this_model(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = PRESETS[name]
    cfg = transformers.AutoConfig.for_model(**spec.hf_config())
    with torch.device("meta"):
        cls = transformers.AutoModel if spec.arch == "bert" else transformers.AutoModelForCausalLM
        model = cls.from_config(cfg)
    assert sum(p.numel() for p in model.parameters()) == spec.params


def test_weight_shapes_cover_the_training_model():
    for name in ("gpt2", "llama-2-7b", "qwen2.5-0.5b", "qwen3-0.6b", "opt-350m", "bert-base-uncased"):
        spec = PRESETS[name]
        assert sum(math.prod(s) for s in spec.weight_shapes()) == spec.train_params


def test_resolve_config_json(tmp_path):
    cfg = {"model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24,
           "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
           "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 32768}
    path = tmp_path / "qwen" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    spec = resolve_model(str(path))
    assert spec.params == PUBLISHED["qwen2.5-0.5b"]
    assert resolve_model(str(path.parent)).params == spec.params     # folder works too
    assert spec.name == "qwen"


def test_a_config_json_without_its_dimensions_or_not_text_is_one_line(tmp_path):
    """The keys a supported config must give are named (it leaked "unsupported operand type(s)
    for //"); a binary file is "cannot read", not a UnicodeDecodeError."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(FrenzyInputError, match="missing num_hidden_layers, intermediate_size, vocab_size"):
        resolve_model(str(path))
    path.write_bytes(b"\x97\xff\x00 not json")
    with pytest.raises(FrenzyInputError, match="cannot read"):
        resolve_model(str(path))


def test_dimensions_dict_and_keywords():
    d = dict(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
             tied_embeddings=False)
    assert resolve_model(d).params == PUBLISHED["llama-2-7b"]
    assert model_from_kwargs(None, **d).params == PUBLISHED["llama-2-7b"]
    # GQA and tying change the count the way the architecture says
    gqa = resolve_model({**d, "kv_heads": 8})
    assert PUBLISHED["llama-2-7b"] - gqa.params == 32 * 2 * 4096 * (4096 - 1024)
    tied = resolve_model({**d, "tied_embeddings": True})
    assert PUBLISHED["llama-2-7b"] - tied.params == 32000 * 4096


@pytest.mark.parametrize("bad,field", [
    (dict(arch="gpt", layers=2, hidden=100, heads=3, vocab=10), "heads"),
    (dict(arch="llama", layers=2, hidden=64, heads=4, kv_heads=3, vocab=10), "kv_heads"),
    (dict(arch="gpt", layers=0, hidden=64, heads=4, vocab=10), "layers"),
    (dict(arch="gpt", layers=2, hidden=-64, heads=4, vocab=10), "hidden"),
    (dict(arch="gpt", layers=2, hidden=64, heads=4), "vocab"),
])
def test_bad_dimensions_name_the_field(bad, field):
    with pytest.raises(FrenzyInputError) as err:
        resolve_model(bad)
    assert err.value.field == field


def test_unknown_preset_and_missing_file():
    with pytest.raises(FrenzyInputError, match="unknown preset"):
        resolve_model("gpt5-ultra")
    with pytest.raises(FrenzyInputError, match="not found"):
        resolve_model("/nonexistent/config.json")


def test_a_folder_or_a_hub_id_is_not_called_a_missing_config_file(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FrenzyInputError, match="has no config.json") as e:
        resolve_model(str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FrenzyInputError, match="has no config.json"):
        resolve_model("empty")                          # relative: also a Hub id's shape
    with pytest.raises(FrenzyInputError, match="Hub id in the local Hugging Face cache") as e:
        resolve_model("someorg/not-cached")
    assert "config file not found" not in str(e.value) and "models--someorg--not-cached" in str(e.value)


# Qwen3 model cards: total and non-embedding parameters, in billions as published (rounded)
QWEN3_CARDS = {"qwen3-0.6b": (0.6, 0.44), "qwen3-1.7b": (1.7, 1.4), "qwen3-4b": (4.0, 3.6),
               "qwen3-8b": (8.2, 6.95), "qwen3-14b": (14.8, 13.2), "qwen3-32b": (32.8, 31.2)}


@pytest.mark.parametrize("name", sorted(QWEN3_CARDS))
def test_qwen3_presets_have_the_model_cards_parameter_counts(name):
    spec = PRESETS[name]
    total, body = QWEN3_CARDS[name]
    digits = len(str(total).split(".")[1])
    embeddings = spec.vocab * spec.hidden * (1 if spec.tied else 2)
    assert round(spec.params / 1e9, digits) == total
    assert round((spec.params - embeddings) / 1e9, len(str(body).split(".")[1])) == body
    assert spec.has_qk_norm and spec.d_head == 128 and not spec.has_qkv_bias


def test_a_qwen3_config_json_is_the_model_transformers_builds(tmp_path):
    """A Qwen3 config.json as the Hub ships it (no head_dim: Qwen3Config's 128, not hidden /
    heads; transformers 5's rope_parameters) sizes the model transformers builds from it."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = {"model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
           "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert (spec.d_head, spec.has_qk_norm, spec.rope_theta, spec.max_positions) == (128, True, 1e6, 32768)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    assert sum(p.numel() for p in model.parameters()) == spec.params
    assert transformers.AutoConfig.for_model(**spec.hf_config()).head_dim == 128


LLAMA_FAMILY_CFG = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 64, "head_dim": 32,
                    "intermediate_size": 512, "vocab_size": 1000, "tie_word_embeddings": False}


@pytest.mark.parametrize("model_type,extra", [
    ("qwen3", {"attention_bias": True}),          # o_proj has a bias too
    ("llama", {"attention_bias": True}),
    ("qwen2", {}),                                # q, k, v biases by default, none on o_proj
    ("mistral", {"attention_bias": True}),        # MistralConfig builds no bias at all
    ("qwen3", {"num_key_value_heads": None}),     # null: every head
    *((t, {"drop": "num_key_value_heads"}) for t in ("qwen3", "qwen2", "mistral", "llama", "gemma",
                                                     "gemma3_text")),  # each one's default
    ("gemma", {"attention_bias": True}),          # on all four projections
    ("gemma3_text", {"attention_bias": True, "drop": "head_dim"}),    # Gemma's 256-wide default
])
def test_llama_family_configs_size_what_transformers_builds(model_type, extra):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = {"model_type": model_type, **LLAMA_FAMILY_CFG, "num_key_value_heads": 16, **extra}
    cfg.pop(cfg.pop("drop", None) or "", None)
    spec = resolve_model(cfg)
    built = {k: v for k, v in cfg.items() if not (model_type == "mistral" and k == "attention_bias")}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**built))
    assert sum(p.numel() for p in model.parameters()) == spec.params
    assert spec.params == sum(math.prod(s) for s in spec.weight_shapes())


def test_an_arch_given_beside_a_preset_builds_its_own_model_type():
    """``--model qwen2.5-0.5b --arch gpt`` kept the preset's qwen2 model type for a GPT-2 shape."""
    spec = model_from_kwargs("qwen2.5-0.5b", arch="gpt")
    assert spec.arch == "gpt" and spec.model_type == "gpt2"


def test_a_hugging_face_type_its_arch_does_not_build_is_refused():
    with pytest.raises(FrenzyInputError) as e:
        resolve_model(dict(arch="llama", layers=2, hidden=64, heads=4, vocab=100, hf_model_type="falcon"))
    assert e.value.field == "hf_model_type" and "qwen3" in e.value.rule
    with pytest.raises(FrenzyInputError, match="hf_model_type"):
        resolve_model(dict(arch="gpt", layers=2, hidden=64, heads=4, vocab=100, hf_model_type="qwen3"))


def test_unsupported_model_type(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(FrenzyInputError, match="model_type"):
        resolve_model(str(p))


def test_spec_is_hashable_and_frozen():
    spec = PRESETS["gpt2"]
    assert hash(spec) == hash(PRESETS["gpt2"])
    with pytest.raises(Exception):
        spec.layers = 3
    assert isinstance(spec, ModelSpec)


def test_knobs_beyond_a_training_jobs_bounds_are_refused_not_estimated():
    """micro_batch 10^30 answered ~1e29 GiB; a job's own bounds apply to an estimate too."""
    from estimator import estimate
    with pytest.raises(FrenzyInputError, match="micro_batch: must be at most 1,048,576"):
        estimate(model="gpt2", seq_len=512, micro_batch=10 ** 30)
    with pytest.raises(FrenzyInputError, match="tp: must be at most"):
        estimate(model="gpt2", seq_len=512, tp=2 ** 21)
