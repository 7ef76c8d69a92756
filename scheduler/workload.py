"""Workloads for the simulator: the CSV contract, its validating reader, and the mapping from
real Microsoft ITP trace jobs (ElasticFlow traces) to LLM training jobs.

Contract (other tools read it; keep it stable)::

    job_id,submit_s,model,seq_len,global_batch,train_tokens,requested_gpu_type,requested_gpus

``model`` is a preset name (``estimator.models.PRESETS``); ``requested_gpu_type`` a catalog name.

The mapping (``frenzy workload``), reproducible from (trace, mix file, seed):

1. Read the trace (``job_id,submission_time,duration,num_gpu``); optionally cut a window
   ``[start_s, end_s)`` of submission times and keep the first ``max_jobs``; rebase arrivals so
   the first job arrives at 0 and divide them by ``time_scale`` (> 1 = heavier load). Optionally
   cap GPU counts at ``max_gpus`` and scale durations by ``duration_scale`` (Sia-like workloads:
   many short jobs of at most 16 GPUs).
2. For trace job *i* draw, from ``random.Random(f"{seed}:{i}")`` (so a job's draw does not
   depend on the other jobs), a model from the weighted presets of the first mix class whose
   ``max_gpus`` >= the job's ``num_gpu`` (the class of the largest ``max_gpus`` for a job
   larger than every class), a sequence length and a global batch from the weighted
   lists. The draw is repeated (up to ``MAX_DRAWS`` times) until the estimator finds a plan of
   exactly ``num_gpu`` GPUs of the reference type that fits in memory, so that the author's
   request is one a competent user could actually run.
3. ``train_tokens = steps x global_batch x seq_len`` with ``steps = round(duration / t)`` where
   ``t`` is the predicted step time of the fastest such plan (the trace's GPUs are taken to be the
   reference type, e.g. A100-40GB): the job takes the trace's duration on its trace GPU count of
   the reference type.
4. The author's request is the reference type and the trace's GPU count.
"""
from __future__ import annotations

import csv
import io
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from estimator.errors import FrenzyInputError, check_number
from estimator.job import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, MAX_STEPS, MAX_TOKENS, steps_for_tokens
from estimator.yamlfile import WORKLOAD_MIX, load_yaml, read_text
from scheduler.cluster import MAX_CLUSTER_GPUS, MAX_GPUS_PER_NODE

# time_scale and duration_scale: a factor of 10^6 already turns a month of trace into seconds
MAX_SCALE = 1e6
# submit times: ten years of trace (1e308 + a start-up is 1e308: such a job ran in no time)
MAX_SUBMIT_S = 10 * 366 * 86400.0
# trace and workload CSVs: a million-job trace is ~50 MB
MAX_CSV_BYTES = 256 * 1024 * 1024

WORKLOAD_COLUMNS = ("job_id", "submit_s", "model", "seq_len", "global_batch", "train_tokens",
                    "requested_gpu_type", "requested_gpus")
TRACE_COLUMNS = ("job_id", "submission_time", "duration", "num_gpu")
MAX_DRAWS = 50  # redraws per trace job before the mix is declared unable to serve its GPU count


@dataclass(slots=True, frozen=True)
class WorkloadJob:
    """One row of a workload CSV."""

    job_id: str
    submit_s: float
    model: str
    seq_len: int
    global_batch: int
    train_tokens: int
    requested_gpu_type: str
    requested_gpus: int

    @property
    def steps(self) -> int:
        return steps_for_tokens(self.train_tokens, self.global_batch, self.seq_len)


# ----------------------------------------------------------------------------- reading

def _known_models() -> set[str]:
    from estimator.models import PRESETS
    return set(PRESETS)


def _known_gpus() -> set[str]:
    from estimator.catalog import CATALOG
    return set(CATALOG)


def _int_field(raw: str, where: str, col: str, *, positive: bool = True, most: int | None = None) -> int:
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise FrenzyInputError(f"{where}: {col}", f"must be an integer, got {raw!r}") from None
    if positive and value <= 0:
        raise FrenzyInputError(f"{where}: {col}", f"must be > 0, got {value}")
    if most is not None and value > most:
        raise FrenzyInputError(f"{where}: {col}", f"must be <= {most:,} (a training job's bound), got {value:,}")
    return value


def _check_work(where: str, job: WorkloadJob) -> None:
    """A job's work within a training job's bounds (a job of 10^18 tokens kept the simulator
    ticking for ever): what read and mapped rows share."""
    if job.train_tokens > MAX_TOKENS:
        raise FrenzyInputError(where, f"{job.train_tokens:,} tokens; at most {MAX_TOKENS:,} (a training job's bound)")
    if job.steps > MAX_STEPS:
        raise FrenzyInputError(where, f"makes {job.steps:,} optimizer steps; at most {MAX_STEPS:,}")


def read_workload(path: str | Path, *, models: Iterable[str] | None = None,
                  extra_gpu_types: Iterable[str] = ()) -> list[WorkloadJob]:
    """Read and validate a workload CSV; the first bad row raises ``FrenzyInputError`` naming
    ``<file>:<line>: <column>`` and the rule, before anything is simulated.

    ``models`` defaults to the estimator's presets; requested GPU types are the catalog's plus
    ``extra_gpu_types`` (a cluster file's custom types: ``Cluster.gpu_types``).
    """
    from estimator.catalog import resolve_gpu_name
    from estimator.models import PRESETS as presets, resolve_model, seq_len_rule
    path = Path(path)
    known_models = set(models) if models is not None else _known_models()
    extra_gpus = dict.fromkeys(extra_gpu_types)     # resolve_gpu_name reads their names only
    specs: dict = {}                                # model -> its spec, resolved once per file
    if not path.is_file():
        raise FrenzyInputError("workload", f"{path} is a folder, not a file" if path.is_dir() else f"no such file: {path}")
    jobs: list[WorkloadJob] = []
    seen: set[str] = set()
    with _text(path, "workload") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or tuple(h.strip() for h in header) != WORKLOAD_COLUMNS:
            raise FrenzyInputError(f"{path}:1: header",
                                   f"columns must be exactly {','.join(WORKLOAD_COLUMNS)}")
        for row in reader:
            line = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            where = f"{path}:{line}"
            if len(row) != len(WORKLOAD_COLUMNS):
                raise FrenzyInputError(where, f"expected {len(WORKLOAD_COLUMNS)} columns, got {len(row)}")
            job_id, submit, model, seq, gb, tokens, gtype, ngpu = (c.strip() for c in row)
            if not job_id:
                raise FrenzyInputError(f"{where}: job_id", "must not be empty")
            if job_id in seen:
                raise FrenzyInputError(f"{where}: job_id", f"duplicate job_id {job_id!r}")
            seen.add(job_id)
            try:
                submit_s = float(submit)
            except ValueError:
                raise FrenzyInputError(f"{where}: submit_s", f"must be a number, got {submit!r}") from None
            if not math.isfinite(submit_s) or submit_s < 0 or submit_s > MAX_SUBMIT_S:
                raise FrenzyInputError(f"{where}: submit_s", f"must be a time from 0 to {MAX_SUBMIT_S:g} s "
                                                             f"(ten years), got {submit}")
            if model not in specs:            # a preset, or what `frenzy estimate --model` takes
                if model in known_models:
                    specs[model] = presets.get(model)
                else:
                    try:
                        specs[model] = resolve_model(model)
                    except FrenzyInputError as err:
                        raise FrenzyInputError(f"{where}: model", f"unknown model {model!r} ({err.rule})") from None
            # as people type it and the cluster file takes it: 'a100-80gb', 'H100'
            gtype = resolve_gpu_name(gtype, extra_gpus, field=f"{where}: requested_gpu_type")
            # the bounds a submitted TrainingJob has (a job of 10^18 tokens kept the simulator
            # ticking for ever)
            job = WorkloadJob(
                job_id=job_id, submit_s=submit_s, model=model,
                seq_len=_int_field(seq, where, "seq_len", most=MAX_SEQ_LEN),
                global_batch=_int_field(gb, where, "global_batch", most=MAX_GLOBAL_BATCH),
                train_tokens=_int_field(tokens, where, "train_tokens", most=MAX_TOKENS),
                requested_gpu_type=gtype,
                requested_gpus=_int_field(ngpu, where, "requested_gpus", most=MAX_CLUSTER_GPUS))
            _check_work(f"{where}: train_tokens", job)
            if specs[model] is not None:      # the model's own rule, as `frenzy plan` says it (not "no plan fits")
                rule = seq_len_rule(specs[model], job.seq_len)
                if rule is not None:
                    raise FrenzyInputError(f"{where}: seq_len", rule)
            jobs.append(job)
    if not jobs:
        raise FrenzyInputError(str(path), "workload has no jobs")
    jobs.sort(key=lambda j: j.submit_s)
    return jobs


def write_workload(jobs: Iterable[WorkloadJob], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)     # `--out runs/w.csv` in a fresh checkout
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(WORKLOAD_COLUMNS)
        for j in jobs:
            w.writerow([j.job_id, f"{j.submit_s:.0f}" if j.submit_s == int(j.submit_s) else f"{j.submit_s:.3f}",
                        j.model, j.seq_len, j.global_batch, j.train_tokens, j.requested_gpu_type,
                        j.requested_gpus])


# ----------------------------------------------------------------------------- the mix

@dataclass(slots=True)
class MixClass:
    max_gpus: int
    models: dict[str, float]


@dataclass(slots=True)
class Mix:
    """A workload mix file (see examples/workload-mix.yaml)."""

    reference_gpu: str
    classes: list[MixClass]
    seq_len: dict[int, float]
    global_batch: dict[int, float]
    gpus_per_node: int = 8
    start_s: float | None = None
    end_s: float | None = None
    max_jobs: int | None = None
    time_scale: float = 1.0
    duration_scale: float = 1.0      # a job's work lasts duration x this (< 1: shorter jobs, e.g. Sia's)
    max_gpus: int | None = None      # trace GPU counts above this are capped to it (Sia: 16)

    def class_for(self, num_gpu: int) -> MixClass:
        for c in self.classes:
            if num_gpu <= c.max_gpus:
                return c
        return self.classes[-1]


# the keys of a mix file (examples/workload-mix.yaml)
MIX_KEYS = ("reference_gpu", "classes", "seq_len", "global_batch", "gpus_per_node", "start_s", "end_s",
            "max_jobs", "time_scale", "duration_scale", "max_gpus")


def _weights(raw, where: str, keytype, bound: float = float("inf")) -> dict:
    if not isinstance(raw, dict) or not raw:
        raise FrenzyInputError(where, "must be a non-empty mapping of value -> weight")
    out = {}
    for k, w in raw.items():
        try:
            key = keytype(k)
        except (TypeError, ValueError):
            raise FrenzyInputError(f"{where}.{k}", f"{k!r} is not a whole number") from None
        if keytype is int:
            check_number(f"{where}.{k}", key, integer=True, high=bound)
        out[key] = check_number(f"{where}.{k} (its weight)", w, low_open=False)
    if sum(out.values()) <= 0:
        raise FrenzyInputError(where, "weights must not all be zero")
    return out


def _number(value: Any) -> Any:
    """YAML 1.1 reads ``1e3`` (no dot) as text: a number written so is taken as one."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _optional(raw: dict, key: str, path: Path, **kw) -> float | int | None:
    value = raw.get(key)
    return None if value is None else check_number(f"{path}: {key}", _number(value), **kw)


def load_mix(path: str | Path, *, models: Iterable[str] | None = None,
             gpu_types: Iterable[str] | None = None) -> Mix:
    path = Path(path)
    if path.is_dir():
        raise FrenzyInputError("mix", f"{path} is a folder, not a mix YAML file")
    if not path.is_file():
        raise FrenzyInputError("mix", f"no such file: {path}")
    raw = load_yaml(path, kind=WORKLOAD_MIX)
    if not isinstance(raw, dict):
        raise FrenzyInputError(str(path), "must be a mapping")
    unknown = sorted(set(raw) - set(MIX_KEYS), key=str)
    if unknown:     # a mistyped key (time_scal) was ignored without a word
        raise FrenzyInputError(f"{path}: {unknown[0]}", f"unknown key; a mix has {', '.join(MIX_KEYS)}")
    known_models = set(models) if models is not None else _known_models()
    known_gpus = set(gpu_types) if gpu_types is not None else _known_gpus()
    ref = raw.get("reference_gpu")
    if ref not in known_gpus:
        raise FrenzyInputError(f"{path}: reference_gpu", f"unknown GPU type {ref!r}")
    classes = []
    for i, c in enumerate(raw.get("classes") or []):
        if not isinstance(c, dict) or "max_gpus" not in c or "models" not in c:
            raise FrenzyInputError(f"{path}: classes[{i}]", "needs max_gpus and models")
        ms = _weights(c["models"], f"{path}: classes[{i}].models", str)
        for m in ms:
            if m not in known_models:
                raise FrenzyInputError(f"{path}: classes[{i}].models", f"unknown model {m!r}")
        classes.append(MixClass(max_gpus=check_number(f"{path}: classes[{i}].max_gpus", c["max_gpus"], integer=True,
                                                      high=MAX_CLUSTER_GPUS),
                                models=ms))
    if not classes:
        raise FrenzyInputError(f"{path}: classes", "at least one class is required")
    classes.sort(key=lambda c: c.max_gpus)
    scale = check_number(f"{path}: time_scale", _number(raw.get("time_scale", 1.0)), high=MAX_SCALE)
    dscale = check_number(f"{path}: duration_scale", _number(raw.get("duration_scale", 1.0)), high=MAX_SCALE)
    mix = Mix(reference_gpu=ref, classes=classes,
              seq_len=_weights(raw.get("seq_len"), f"{path}: seq_len", int, MAX_SEQ_LEN),
              global_batch=_weights(raw.get("global_batch"), f"{path}: global_batch", int, MAX_GLOBAL_BATCH),
              gpus_per_node=check_number(f"{path}: gpus_per_node", raw.get("gpus_per_node", 8), integer=True,
                                         high=MAX_GPUS_PER_NODE),
              start_s=_optional(raw, "start_s", path, low_open=False),
              end_s=_optional(raw, "end_s", path),
              max_jobs=_optional(raw, "max_jobs", path, integer=True), time_scale=scale, duration_scale=dscale,
              max_gpus=_optional(raw, "max_gpus", path, integer=True, high=MAX_CLUSTER_GPUS))
    if mix.start_s is not None and mix.end_s is not None and mix.end_s <= mix.start_s:
        raise FrenzyInputError(f"{path}: end_s", f"must be after start_s ({mix.end_s:g} <= {mix.start_s:g})")
    return mix


# ----------------------------------------------------------------------------- the trace

@dataclass(slots=True, frozen=True)
class TraceJob:
    job_id: str
    submission_time: float
    duration: float
    num_gpu: int


def _text(path: Path, what: str):
    """A CSV's text as a file object: size and UTF-8 checked as every user file is
    (``estimator.yamlfile.read_text``: a bad byte is named with its line and offset), a leading
    byte-order mark dropped."""
    # a spreadsheet's "CSV UTF-8" starts with a byte-order mark, which is no part of the header
    return io.StringIO(read_text(path, what, max_bytes=MAX_CSV_BYTES).removeprefix("\ufeff"), newline="")


def read_trace(path: str | Path, skipped: list[str] | None = None) -> list[TraceJob]:
    """The trace's jobs, by submission time. Rows of jobs that never ran on a GPU (duration 0,
    num_gpu 0: public traces keep failed-at-start and CPU jobs) are left out, their ids added
    to ``skipped`` when given; ``num_gpu`` may be written '2.0' (a pandas export)."""
    path = Path(path)
    if not path.is_file():
        raise FrenzyInputError("trace", f"{path} is a folder, not a file" if path.is_dir() else f"no such file: {path}")
    out = []
    seen: set[str] = set()
    with _text(path, "trace") as fh:
        reader = csv.DictReader(fh)
        if tuple(reader.fieldnames or ()) != TRACE_COLUMNS:
            raise FrenzyInputError(f"{path}:1: header", f"columns must be {','.join(TRACE_COLUMNS)}")
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row or None in row.values():
                raise FrenzyInputError(where, f"expected {len(TRACE_COLUMNS)} columns ({','.join(TRACE_COLUMNS)})")
            try:
                t, d = float(row["submission_time"]), float(row["duration"])
            except ValueError:
                raise FrenzyInputError(where, "submission_time and duration must be numbers") from None
            try:
                g = float(row["num_gpu"])           # '2.0' too (a pandas export)
                if not g.is_integer():
                    raise ValueError
            except ValueError:
                raise FrenzyInputError(f"{where}: num_gpu", f"must be a whole number of GPUs, got {row['num_gpu']!r}") from None
            if d == 0 or g == 0:
                if skipped is not None:
                    skipped.append(row["job_id"])
                continue
            check_number(f"{where}: submission_time", t, low_open=False, high=MAX_SUBMIT_S)
            check_number(f"{where}: duration", d, high=MAX_SUBMIT_S)
            n = int(check_number(f"{where}: num_gpu", g, integer=True, high=MAX_CLUSTER_GPUS))
            if row["job_id"] in seen:
                raise FrenzyInputError(f"{where}: job_id", f"duplicate job_id {row['job_id']!r}")
            seen.add(row["job_id"])
            out.append(TraceJob(row["job_id"], t, d, n))
    out.sort(key=lambda j: j.submission_time)
    return out


# step time of the fastest plan of exactly `gpus` GPUs of `gpu_type` that fits, or None
RefStepFn = Callable[[str, int, int, str, int, int], "float | None"]


def estimator_ref_step(model: str, seq_len: int, global_batch: int, gpu_type: str, gpus: int,
                       gpus_per_node: int) -> float | None:
    """The estimator's answer (same plan enumeration and throughput model as live runs)."""
    from scheduler.sim.jobs import fastest_plan_at
    plan = fastest_plan_at(model, seq_len, global_batch, gpu_type, gpus, gpus_per_node)
    return None if plan is None else plan.step_time_s


def _draw(rng: random.Random, weights: dict):
    keys = list(weights)
    return rng.choices(keys, weights=[weights[k] for k in keys], k=1)[0]


def map_trace(trace: list[TraceJob], mix: Mix, seed: int, *, ref_step: RefStepFn | None = None,
              progress: Callable[[int], None] | None = None) -> list[WorkloadJob]:
    """Map trace jobs to LLM training jobs (see the module docstring for the rules)."""
    ref_step = ref_step or estimator_ref_step
    jobs = [j for j in trace
            if (mix.start_s is None or j.submission_time >= mix.start_s)
            and (mix.end_s is None or j.submission_time < mix.end_s)]
    if mix.max_jobs:
        jobs = jobs[: int(mix.max_jobs)]
    if not jobs:
        raise FrenzyInputError("trace", "no trace jobs in the selected window")
    t0 = jobs[0].submission_time
    out: list[WorkloadJob] = []
    for i, tj in enumerate(jobs):
        rng = random.Random(f"{seed}:{i}")
        num_gpu = min(tj.num_gpu, mix.max_gpus) if mix.max_gpus else tj.num_gpu
        cls = mix.class_for(num_gpu)
        for _ in range(MAX_DRAWS):
            model = _draw(rng, cls.models)
            seq = _draw(rng, mix.seq_len)
            gb = _draw(rng, mix.global_batch)
            step = ref_step(model, seq, gb, mix.reference_gpu, num_gpu, mix.gpus_per_node)
            if step:
                break
        else:
            raise FrenzyInputError(
                "mix", f"no model of the class max_gpus={cls.max_gpus} fits on {num_gpu} x "
                       f"{mix.reference_gpu} after {MAX_DRAWS} draws (trace job {tj.job_id}); "
                       "widen the class or the batch/sequence choices")
        steps = max(1, round(tj.duration * mix.duration_scale / step))
        job = WorkloadJob(
            job_id=f"j{i:05d}", submit_s=round((tj.submission_time - t0) / mix.time_scale, 3),
            model=model, seq_len=seq, global_batch=gb, train_tokens=steps * gb * seq,
            requested_gpu_type=mix.reference_gpu, requested_gpus=num_gpu)
        _check_work(f"trace job {tj.job_id} (duration {tj.duration:g} s x duration_scale {mix.duration_scale:g})", job)
        out.append(job)
        if progress:
            progress(i + 1)
    return out
