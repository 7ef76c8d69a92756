# Two commands on a fresh machine: `make demo` (set up + run the main job), `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.frenzy-installed
# torch: the CPU build on machines without an NVIDIA GPU (never the multi-GB CUDA build there).
TORCH_CPU := torch==2.13.0
JOB       ?= examples/tiny-job.yaml
# The tiny pretrained model the fine-tune examples start from (made locally, never in git).
TINY_MODEL := examples/.models/tiny-llama/model.safetensors

.PHONY: setup demo test test-fast clean

setup: $(STAMP) $(TINY_MODEL)

$(TINY_MODEL): examples/make_tiny_model.py $(STAMP)
	$(BIN)/python examples/make_tiny_model.py

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	    $(BIN)/python -m pip install -q torch; \
	else \
	    $(BIN)/python -m pip install -q $(TORCH_CPU); \
	fi
	# DeepSpeed's sdist imports torch while building: build it against the torch above.
	$(BIN)/python -m pip install -q --no-build-isolation "deepspeed>=0.15"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(BIN)/frenzy run $(JOB)

# What the suite's tests would otherwise build on their first run on a machine (DeepSpeed's CPU
# ops, the Airflow test's environment) is built first, outside the timed test command. Then two
# test processes (pytest-xdist, in the dev extra): a heavy test is mostly one process starting up
# (imports, a Prefect server), so two of them keep the 2 cores busy; `--dist loadfile` keeps each
# file's tests, and the weights and reference runs its fixtures make once, in one process. Each
# process gets its own FRENZY_HOME and PREFECT_HOME (tests/conftest.py); rendezvous ports are drawn
# where no other process takes them (trainer/ports.py). `pytest -q` alone runs one process.
test: setup
	$(BIN)/python scripts/prepare_tests.py
	$(BIN)/python -m pytest -q -ra --durations=15 -n 2 --dist loadfile

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow and not prefect"

clean:
	rm -rf $(VENV) .frenzy .pytest_cache examples/.models/tiny-llama
