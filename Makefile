# A newcomer's commands: `make train` (the demo) and `make test` (the whole suite). Both install first if needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install train test test-floor test-roll test-verl lint bench bench-peers clean

install: $(STAMP)

# torch is pinned here to the CPU build that lies on this machine's disk; pyproject asks torch>=2.10, the oldest
# fsdp2kit accepts (fsdp2kit/distributed.py:OLDEST_TORCH).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,lint,float8]'
	touch $(STAMP)

train: install
	OMP_NUM_THREADS=1 $(BIN)/fsdp2kit train examples/demo.yaml --nproc 2

# Two pytest processes, a test file each at a time (module fixtures stay in one process): a multi-rank test leaves
# much of a second core idle while its ranks start, wait and checkpoint, so the other fills it.
test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

# The suite on the oldest releases fsdp2kit supports (ROLL's pins: transformers 5.2.0, peft 0.12.0), held by
# .ci/floor-constraints.txt through every install, in its own environment.
FLOOR := .venv-floor
FLOOR_STAMP := $(FLOOR)/.installed

$(FLOOR_STAMP): pyproject.toml .ci/floor-constraints.txt
	test -x $(FLOOR)/bin/python || $(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install --quiet --upgrade pip
	$(FLOOR)/bin/python -m pip install --quiet -c .ci/floor-constraints.txt torch==2.13.0
	$(FLOOR)/bin/python -m pip install --quiet -c .ci/floor-constraints.txt -e '.[test]'
	touch $(FLOOR_STAMP)

test-floor: $(FLOOR_STAMP)
	OMP_NUM_THREADS=1 $(FLOOR)/bin/python -m pytest -m "not slow" -q

# ROLL's own workers (the snapshot in ../shared/third_party/ROLL, not on the registry: on PYTHONPATH, never installed)
# driving fsdp2kit and ROLL's own FSDP2 strategy, on ROLL's pins, in their own environment (tests_roll/).
ROLL_ENV := .venv-roll
ROLL_STAMP := $(ROLL_ENV)/.installed
ROLL_SOURCE ?= $(abspath ../shared/third_party/ROLL)

$(ROLL_STAMP): pyproject.toml .ci/floor-constraints.txt tests_roll/requirements.txt
	test -x $(ROLL_ENV)/bin/python || $(PYTHON) -m venv $(ROLL_ENV)
	$(ROLL_ENV)/bin/python -m pip install --quiet --upgrade pip
	$(ROLL_ENV)/bin/python -m pip install --quiet -c .ci/floor-constraints.txt torch==2.13.0
	$(ROLL_ENV)/bin/python -m pip install --quiet -c .ci/floor-constraints.txt -e '.[test]' -r tests_roll/requirements.txt
	touch $(ROLL_STAMP)

# Without the snapshot (a checkout without ../shared) it says so in one line and runs nothing.
test-roll:
	@if test -d $(ROLL_SOURCE)/roll; then \
		$(MAKE) --no-print-directory $(ROLL_STAMP) && ROLL_SOURCE=$(ROLL_SOURCE) OMP_NUM_THREADS=1 \
		$(ROLL_ENV)/bin/python -m pytest -q -p no:cacheprovider tests_roll; \
	else echo "test-roll: no ROLL snapshot at $(ROLL_SOURCE) (set ROLL_SOURCE=...): ROLL's workers were NOT run"; fi

# verl's own code driving fsdp2kit (tests_verl/): verl 0.9.1 from the package registry with the versions it pins
# (.ci/verl-constraints.txt: transformers 5.10.4, tensordict 0.10.0) beside the CPU torch, in its own environment;
# fsdp2kit goes in without its `test` extra (its tensordict pin is the newest) and its dependencies under the same
# constraints. `pip check` proves nothing pulled another torch or broke a pin.
VERL := .venv-verl
VERL_STAMP := $(VERL)/.installed

$(VERL_STAMP): pyproject.toml .ci/verl-constraints.txt
	test -x $(VERL)/bin/python || $(PYTHON) -m venv $(VERL)
	$(VERL)/bin/python -m pip install --quiet --upgrade pip
	$(VERL)/bin/python -m pip install --quiet torch==2.13.0
	$(VERL)/bin/python -m pip install --quiet -c .ci/verl-constraints.txt verl transformers tensordict uvicorn fastapi
	$(VERL)/bin/python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" \
		> $(VERL)/fsdp2kit-requirements.txt
	$(VERL)/bin/python -m pip install --quiet -c .ci/verl-constraints.txt -r $(VERL)/fsdp2kit-requirements.txt \
		pytest pytest-timeout
	$(VERL)/bin/python -m pip install --quiet --no-deps -e .
	$(VERL)/bin/python -m pip check
	touch $(VERL_STAMP)

test-verl: $(VERL_STAMP)
	OMP_NUM_THREADS=1 $(VERL)/bin/python -m pytest -q -p no:cacheprovider tests_verl --durations=10

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The CPU benchmarks, each printing one JSON object, saved in docs/bench/ and drawn into docs/img/ (docs/PERFORMANCE.md);
# benchmarks/gpu_suite.sh is the GPU set.
bench: install
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	for b in memory_scaling vs_raw_fsdp2 vs_fsdp1 vs_accelerate mallopt_cost checkpoint_stall load_export_memory \
		context_parallel muon_step weight_sync; do \
		OMP_NUM_THREADS=1 $(BIN)/python benchmarks/$$b.py > docs/bench/$$b.json || exit 1; cat docs/bench/$$b.json; done
	$(BIN)/python benchmarks/plots.py

# fsdp2kit against verl's FSDP2 engine and ROLL's FSDP2 strategy, each behind its framework's own worker, in the
# environments test-verl / test-roll build (benchmarks/peers.py launches each side there), and against the HF Trainer
# and TRL's SFTTrainer (the `bench` extra, in the main environment); not part of `make test`.
# The JSON on stdout, a table on stderr: `make bench-peers > docs/bench/peers.json`; PEERS_ARGS=--quick for a smoke run.
# Without the ROLL snapshot only the verl, Trainer and TRL arms run, and it says so.
bench-peers: install $(VERL_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]' >&2
	@if test -d $(ROLL_SOURCE)/roll; then \
		$(MAKE) --no-print-directory $(ROLL_STAMP) >&2 && ROLL_SOURCE=$(ROLL_SOURCE) OMP_NUM_THREADS=1 \
		$(BIN)/python benchmarks/peers.py $(PEERS_ARGS); \
	else echo "bench-peers: no ROLL snapshot at $(ROLL_SOURCE) (set ROLL_SOURCE=...): ROLL's side NOT run" >&2; \
		OMP_NUM_THREADS=1 $(BIN)/python benchmarks/peers.py --frameworks verl trainer trl $(PEERS_ARGS); fi

clean:
	rm -rf runs .pytest_cache
