"""Training data: text, JSONL, datasets folders, byte-level and local tokenizers, offline; and
the pre-launch checks that name the file or setting."""
from __future__ import annotations

import json

import pytest

from estimator.errors import FrenzyInputError
from trainer.data import TokenSource, check_data, token_stream

TEXT = "the quick brown fox jumps over the lazy dog. " * 40


def test_text_file_byte_level(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT)
    data = {"kind": "text", "path": str(f), "tokenizer": "byte"}
    toks = token_stream(data)
    assert toks[:3] == list(b"the") and max(toks) < 256
    check_data(data, vocab=256, seq_len=64)
    src = TokenSource(data, seq_len=16, vocab=256, seed=0)
    assert bytes(src.sequence(0).tolist()) == TEXT.encode()[:16]
    assert src.batch(3, 2).shape == (2, 16)


def test_jsonl_and_datasets_folder_give_the_same_tokens(tmp_path):
    rows = [{"text": f"document number {i} " * 5, "id": i} for i in range(30)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    a = token_stream({"kind": "jsonl", "path": str(jl), "text_field": "text"})
    b = token_stream({"kind": "datasets", "path": str(folder), "text_field": "text"})
    assert a == b and len(a) > 100
    with pytest.raises(FrenzyInputError, match="data.text_field"):
        token_stream({"kind": "datasets", "path": str(folder), "text_field": "body"})
    with pytest.raises(FrenzyInputError, match="data.text_field"):
        token_stream({"kind": "jsonl", "path": str(jl), "text_field": "body"})


def _word_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[EOS]", "the", "quick", "brown", "fox", "jumps", "over",
                                         "lazy", "dog."])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(str(folder))


def test_local_tokenizer_folder_offline(tmp_path):
    _word_tokenizer(tmp_path / "tok")
    f = tmp_path / "c.txt"
    f.write_text(TEXT)
    data = {"kind": "text", "path": str(f), "tokenizer": str(tmp_path / "tok")}
    toks = token_stream(data)
    assert toks[:4] == [2, 3, 4, 5] and toks[-1] == 1        # words, then EOS at the document end
    check_data(data, vocab=256, seq_len=32)
    with pytest.raises(FrenzyInputError, match="vocabulary"):
        check_data(data, vocab=8, seq_len=32)


@pytest.mark.parametrize("data,field", [
    ({"kind": "text", "path": "/nonexistent/corpus.txt"}, "data.path"),
    ({"kind": "jsonl", "path": "/nonexistent/d.jsonl"}, "data.path"),
    ({"kind": "datasets", "path": "/nonexistent/ds"}, "data.path"),
])
def test_missing_data_is_named(data, field):
    with pytest.raises(FrenzyInputError) as e:
        check_data(data, vocab=256, seq_len=8)
    assert e.value.field == field and "/nonexistent/" in str(e.value)


def test_bad_tokenizer_and_folder_are_named(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text(TEXT)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FrenzyInputError, match="data.tokenizer") as e:
        check_data({"kind": "text", "path": str(f), "tokenizer": str(tmp_path / "empty")}, vocab=256, seq_len=8)
    assert "empty" in str(e.value)
    with pytest.raises(FrenzyInputError, match="data.tokenizer"):
        check_data({"kind": "text", "path": str(f), "tokenizer": "gpt2"}, vocab=50257, seq_len=8)  # a hub name
    with pytest.raises(FrenzyInputError, match="save_to_disk"):
        check_data({"kind": "datasets", "path": str(tmp_path / "empty")}, vocab=256, seq_len=8)
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(FrenzyInputError, match="seq_len"):
        check_data({"kind": "text", "path": str(short)}, vocab=256, seq_len=64)


def test_synthetic_is_deterministic_and_learnable():
    a = TokenSource({"kind": "synthetic"}, seq_len=32, vocab=256, seed=1)
    b = TokenSource({"kind": "synthetic"}, seq_len=32, vocab=256, seed=1)
    assert a.batch(10, 4).equal(b.batch(10, 4))
    s = a.sequence(5)
    diffs = ((s[1:] - s[:-1]) % 256).unique()
    assert len(diffs) == 1                                      # a fixed stride: next token predictable


def test_the_run_says_how_often_its_data_repeats(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT)                            # 1,800 bytes: 28 windows of 64 (+1) tokens
    src = TokenSource({"kind": "text", "path": str(f), "tokenizer": "byte"}, seq_len=64, vocab=256, seed=0)
    assert len(src) == 28
    once = src.coverage(steps=7, global_batch=4)
    assert "28 training sequences of 64 tokens" in once and "28 sequences read, 1.00 passes" in once
    assert "repeats" not in once
    many = src.coverage(steps=70, global_batch=4)
    assert "10.00 passes" in many and "the data repeats" in many
    assert TokenSource({"kind": "synthetic"}, seq_len=64, vocab=256, seed=0).coverage(10, 4) is None


def test_data_users_get_wrong_fails_before_launch_in_one_line(tmp_path):
    """From a probe of job inputs: each of these trained on garbage, crashed with a traceback,
    or failed only inside the training's ranks."""
    from pydantic import ValidationError

    from estimator.job import DataSpec

    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(FrenzyInputError, match=r"weights.bin:2 is not UTF-8 text \(byte 128\)"):
        check_data({"kind": "text", "path": str(binary)}, vocab=256, seq_len=16)
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'{"text": "ok"}\n' + '{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(FrenzyInputError, match=r"latin1.jsonl:2 is not UTF-8"):
        check_data({"kind": "jsonl", "path": str(latin)}, vocab=256, seq_len=4)
    nulls = tmp_path / "null.jsonl"
    nulls.write_text('{"text": "a real line of text"}\n{"text": null}\n')
    with pytest.raises(FrenzyInputError, match=r"null.jsonl:2: 'text' is NoneType, not a string"):
        check_data({"kind": "jsonl", "path": str(nulls)}, vocab=256, seq_len=4)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(FrenzyInputError, match="holds no text"):
        check_data({"kind": "text", "path": str(empty)}, vocab=256, seq_len=4)
    with pytest.raises(ValidationError, match="synthetic data reads no file"):      # path, no kind
        DataSpec(path=str(empty))
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list([{"body": "hi"}]).save_to_disk(str(folder))
    with pytest.raises(FrenzyInputError, match="data.text_field: .* has no column 'text'"):
        check_data({"kind": "datasets", "path": str(folder)}, vocab=256, seq_len=4)
    with pytest.raises(FrenzyInputError, match="holds 3 tokens, fewer than seq_len"):
        check_data({"kind": "datasets", "path": str(folder), "text_field": "body"}, vocab=256, seq_len=16)
    none_rows = tmp_path / "ds-none"                 # a null text trained on "None", as in JSONL
    datasets.Dataset.from_list([{"text": "a real row"}, {"text": None}]).save_to_disk(str(none_rows))
    with pytest.raises(FrenzyInputError, match=r"ds-none row 1: 'text' is NoneType, not a string"):
        check_data({"kind": "datasets", "path": str(none_rows)}, vocab=256, seq_len=64)
    # the count check_data returns is the training stream's, which the eval split reads
    f = tmp_path / "c.txt"
    f.write_text(TEXT)
    assert check_data({"kind": "text", "path": str(f)}, vocab=256, seq_len=64) == len(token_stream(
        {"kind": "text", "path": str(f)}))


def test_an_export_never_replaces_a_folder_that_is_not_an_export(tmp_path):
    """export.dir at an existing folder of data deleted it after the training."""
    from trainer.modeling import EXPORT_MARKER
    from trainer.runner import check_export_folder

    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "medium.txt").write_text("my data")
    with pytest.raises(FrenzyInputError, match="export.dir: .* not an earlier export"):
        check_export_folder(str(victim))
    check_export_folder(str(tmp_path / "new"))                      # new, empty or an earlier export: fine
    (tmp_path / "empty").mkdir()
    check_export_folder(str(tmp_path / "empty"))
    (victim / EXPORT_MARKER).write_text("{}")
    check_export_folder(str(victim))


def test_resume_from_another_runs_checkpoint_of_other_weights_is_refused_before_launch(tmp_path):
    """A LoRA job resumed from a full fine-tune's checkpoint passed every check and failed in
    the training (no adapter_state file); other adapters or another model likewise."""
    from estimator.job import TrainingJob
    from trainer import checkpoints, resume

    base = {"seq_len": 32, "global_batch": 4, "train_steps": 4, "precision": "fp32", "model": "gpt2-tiny"}

    def checkpoint_of(name: str, **job) -> checkpoints.Checkpoint:
        run = tmp_path / name
        resume.record_job(run, TrainingJob(**{**base, **job}))
        d = checkpoints.checkpoint_path(run, 4)
        d.mkdir(parents=True)
        (d / checkpoints.MARKER).write_text("{}")
        return resume.explicit_checkpoint(str(run))

    full = checkpoint_of("full")
    lora = checkpoint_of("lora", finetune={"method": "lora", "rank": 8, "target_modules": ["c_attn"]})
    other = checkpoint_of("other", model="gpt2")
    lora_job = TrainingJob(**base, finetune={"method": "lora", "rank": 8, "target_modules": ["c_attn"]})
    with pytest.raises(FrenzyInputError, match="resume_from: .* holds full-model weights; this job trains lora"):
        resume.check_resumable(lora_job, full)
    resume.check_resumable(lora_job, lora)
    with pytest.raises(FrenzyInputError, match="adapters of rank 8 on c_attn; this job's are rank 16"):
        resume.check_resumable(TrainingJob(**base, finetune={"method": "lora", "target_modules": ["c_attn"]}), lora)
    with pytest.raises(FrenzyInputError, match="is of another model"):
        resume.check_resumable(TrainingJob(**base), other)
    resume.check_resumable(TrainingJob(**{**base, "seq_len": 64, "global_batch": 8}), full)   # batch, length: fine
