# vitscale — every target wraps one `python -m <package>.<verb>` entry point.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# PyTorch's CPU wheel index for a machine whose pip has no CPU wheel of its own: PyPI's Linux torch is the CUDA build
# (GBs of nvidia-* packages). e.g. make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=
STAMP := $(VENV)/.vitscale-installed

CLUSTER ?= local
RECIPE ?=
SET ?=
DRY_RUN ?=
EXPERIMENT ?=
RUNS ?=
PYTEST_ARGS ?=
TEST_WORKERS ?= 3
SEED ?=
SMOKE ?=
# DRY_RUN / SMOKE: 1 (true, yes) turns the flag on, 0 (false, no) or nothing leaves it off; anything else stops make
# before the command runs (`DRY_RUN=ture` must not submit a 64-GPU job)
flag = $(if $(filter-out 0 1 true false yes no,$($(1))),$(error $(1)=$($(1)): give $(1)=1 or $(1)=0),$(filter 1 true yes,$($(1))))
checked_flags := $(foreach v,DRY_RUN SMOKE,$(call flag,$(v)))

# DeepSpeed on the CPU unless this machine has an NVIDIA GPU (nvidia-smi lists one); DS_ACCELERATOR=... chooses.
ifeq ($(origin DS_ACCELERATOR),undefined)
ifeq ($(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU'),0)
export DS_ACCELERATOR := cpu
endif
endif

.PHONY: help setup test test-fast test-shuffled lint launch preflight elastic-demo status logs stop env ui compare shards bench bench-train bench-data bench-scaling bench-scale bench-precision bench-gpu clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-16s %s\n", $$1, $$2}'

setup: $(STAMP)  ## create .venv: torch first (CPU wheel), then DeepSpeed from source, then vitscale[dev]

# Re-runs only when pyproject.toml or constraints-dev.txt changes; each step also skips itself when its package is
# already present. constraints-dev.txt spares pip's resolver its backtracking through the object-storage stack.
$(STAMP): pyproject.toml constraints-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null \
		|| $(PY) -m pip install "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@$(PY) -c "import deepspeed" 2>/dev/null \
		|| DS_BUILD_OPS=0 $(PY) -m pip install "deepspeed>=0.16,<0.20" --no-build-isolation
	$(PY) -m pip install -e ".[dev]" -c constraints-dev.txt
	@# DeepSpeed's CPU communication op, built once here (about 35 s on 2 cores; torch keeps it in
	@# ~/.cache/torch_extensions) rather than by the first training process, which would make every rank wait.
	@$(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()" >/dev/null
	@touch $@

# pytest exits 5 when it collected no tests: that is a failure, said in words. TEST_WORKERS pytest-xdist workers
# share the tests: 3 on 2 cores, because the end-to-end tests wait on process start-up and Ray much of their time.
# `--dist load --maxschedchunk 1` hands each worker the next test as it frees up, in the suite's order: longest
# first (tests/durations.json, tests/conftest.py), so no long test starts late and becomes the run's tail.
# The suite writes Python's bytecode cache even where PYTHONDONTWRITEBYTECODE is set (container images set it): its
# hundreds of processes (ranks, Ray workers, CLIs) import the project, and without the cache each compiles it again
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n $(TEST_WORKERS) --dist load --maxschedchunk 1
define run_pytest
	@$(PYTEST) $(1) $(PYTEST_ARGS); rc=$$?; \
		if [ $$rc -eq 5 ]; then echo "make: pytest collected no tests" >&2; exit 1; fi; exit $$rc
endef

test: setup  ## the whole suite on CPU (real DeepSpeed, Ray, MLflow): before a change lands
	$(call run_pytest,)

test-fast: setup  ## the inner loop: the suite without the slow end-to-end tests (about 5 min on 2 cores)
	$(call run_pytest,-m "not slow")

test-shuffled: setup  ## the whole suite in a random order (SEED=n repeats an order): before a change lands
	$(call run_pytest,--shuffle $(or $(SEED),$(shell echo $$RANDOM)))

lint: setup  ## ruff, and mypy over pretrain/ and data_pipeline/
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

launch: setup  ## plan and run RECIPE (default: the profile's) on CLUSTER (default: local, the CPU demo); DRY_RUN=1: plan only; RUN_NAME=n: the run's name (a used one resumes)
	$(PY) -m cluster.launch --cluster $(CLUSTER) $(if $(RECIPE),--recipe $(RECIPE)) $(foreach s,$(SET),--set $(s)) $(if $(RUN_NAME),--run-name $(RUN_NAME)) $(if $(call flag,DRY_RUN),--dry-run)

preflight: setup  ## measure CLUSTER's nodes (GPUs, busbw, shard reads, loader, disk, MLflow, clocks) against RECIPE's plan
	$(PY) -m cluster.preflight --cluster $(CLUSTER) $(if $(RECIPE),--recipe $(RECIPE)) $(foreach s,$(SET),--set $(s))

elastic-demo: setup  ## elastic job on a simulated 2-node Ray cluster: a node is removed mid-run and added back
	$(PY) -m cluster.elastic_demo

status: setup  ## Ray jobs of the local/profile cluster
	$(PY) -m cluster.jobs status --cluster $(CLUSTER)

logs: setup  ## logs of the newest job
	$(PY) -m cluster.jobs logs --cluster $(CLUSTER)

stop: setup  ## stop the running job (on a cluster: the one; several are named), and the local head we started
	$(PY) -m cluster.jobs stop --cluster $(CLUSTER)

env: setup  ## exports for Ray's own CLI (ray job list/logs) on CLUSTER: eval "$(make -s env)"
	@$(PY) -m cluster.env --cluster $(CLUSTER)

ui: setup  ## MLflow UI on 127.0.0.1 over the embedded store
	$(PY) -m tracking.ui

compare: setup  ## side-by-side report of MLflow runs: reports/<name>/index.html
	$(PY) -m tracking.compare $(if $(EXPERIMENT),--experiment $(EXPERIMENT)) $(if $(RUNS),--runs $(RUNS))

shards: setup  ## write the built-in datasets as shards under data/
	$(PY) -m data_pipeline.builtin all --out data

# one at a time, whatever -j says (MAKEFLAGS too): each times this machine, and would time the others' load (GNU Make
# before 4.4 reads this as: every target one at a time)
.NOTPARALLEL: bench
bench: bench-data bench-train bench-scaling bench-scale  ## the four CPU benchmarks (data, train, scaling, scale), results in bench-results/

bench-data: setup  ## decode+augment images/s vs bare PIL, shard read MiB/s
	$(PY) -m bench.data

bench-train: setup  ## ViT-S/16 and B/16 training steps (fp32, bf16) vs Hugging Face transformers and the GEMM rate
	$(PY) -m bench.train

bench-scaling: setup  ## images/s of the real training loop (DeepSpeed ZeRO-2, gloo) at world size 1 and 2, one core per rank
	$(PY) -m bench.scaling

bench-precision: setup  ## bf16 vs fp32 step per model shape on this CPU, beside what precision auto's rule picks
	$(PY) -m bench.precision

bench-gpu: setup  ## the GPU campaign on one GPU (docs/benchmarks/gpu.md) -> bench-results/gpu.json; SMOKE=1: tiny, on the CPU (gpu-smoke.json)
	$(PY) -m bench.gpu $(if $(call flag,SMOKE),--smoke)

bench-scale: setup  ## ImageNet-21k-scale rehearsal: 14.2M-row manifests, 512-rank planning, near-dup index, writer
	$(PY) -m bench.scale

# bench-results/gpu*.json are committed GPU campaigns (docs/benchmarks/gpu.md): only what the CPU benchmarks wrote goes
# The local head first: its folder removed under it, Ray's GCS and raylet outlive SIGTERM and `make stop` no longer
# finds them (head.json went with it): an orphaned head holding port 8265 and its CPUs.
clean:  ## stop the local Ray head we started, then remove generated data, runs and reports (keeps .venv, GPU results)
	@test ! -e .ray-local/head.json || test ! -x $(PY) || $(PY) -m cluster.jobs stop --cluster local
	rm -rf data runs reports mlflow.db mlartifacts .ray-local
	rm -f $(addprefix bench-results/,data.json train.json scaling.json scale.json precision.json gpu-smoke.json)
	rm -rf bench-results/device
