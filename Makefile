# trainyard: `make demo` runs the demo pipeline end to end; `make test` lints, type-checks, then runs every test.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
export TRAINYARD_HOME ?= $(CURDIR)/.trainyard
export AIRFLOW_HOME ?= $(CURDIR)/.airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__PLUGINS_FOLDER := $(CURDIR)/plugins
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW__CORE__UNIT_TEST_MODE := False
export AIRFLOW__API__HOST := 127.0.0.1
export AIRFLOW__API__PORT := 8080
export PATH := $(BIN):$(PATH)
DEMO_DATE ?= 2026-11-28
# `make airflow`'s PostgreSQL cluster (metadata DB); delete the folder to start from an empty DB.
PGDATA_DIR := $(CURDIR)/.pgdata

.PHONY: help venv airflow-db demo demo-s3 lint test test-rgw test-unit airflow bench bench-peers clean clean-pg browser postgres rclone newcomer

help:
	@echo "make demo     - install, set up Airflow, run the demo pipeline on 2 local nodes"
	@echo "make demo-s3  - the same with the S3 example spec, its cold tier in a local SeaweedFS (started and stopped)"
	@echo "make test     - lint, then the whole test suite (what CI runs)"
	@echo "make test-rgw - the S3 staging, publish and upload tests against Ceph RGW instead of SeaweedFS"
	@echo "make lint     - ruff (lint and format check), mypy and the import layers (config in pyproject.toml)"
	@echo "make airflow  - Airflow UI on http://127.0.0.1:8080 with the project's DAGs"
	@echo "make bench    - benchmarks, results in bench/results/"
	@echo "make newcomer - a clean clone's first day: demo, summary -o json, check of a bad folder, report screenshot"

# The venv is rebuilt when the pinned requirements change. uv (pinned in requirements-dev.txt, bootstrapped with the
# venv's pip) installs them: it downloads in parallel and compiles every installed module on every core. A clean
# build took 135-152 s with pip and compileall, 63-91 s with uv. Compiled up front because where
# PYTHONDONTWRITEBYTECODE is set (as on this project's machines) nothing compiled later is kept, and each process
# would compile Airflow and torch again (compiling on first import was measured on a clean CI run and lost: processes
# that start together each compile torch and Airflow before any of them has written the cache). uv does not read
# pip's configuration: a machine whose pip finds wheels in a local folder (PIP_FIND_LINKS: here, torch's CPU build)
# hands the folder on. Without such a folder, torch comes from PyTorch's own index for this machine
# (--torch-backend auto: the CUDA build its driver supports, else the CPU build): PyPI's torch is the multi-GB CUDA
# build everywhere. UV_TORCH_BACKEND=cpu (or cu128, ...) chooses instead.
UV = $(BIN)/uv pip install --python $(BIN)/python
TORCH_SOURCE = $(if $(PIP_FIND_LINKS),--find-links "$(PIP_FIND_LINKS)",--torch-backend $(or $(UV_TORCH_BACKEND),auto))
$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing pinned requirements into $(VENV) (log: $(VENV)/pip.log)"
	($(BIN)/pip install --no-compile "$$(grep -x 'uv==[0-9.]*' requirements-dev.txt)" \
	  && $(UV) --compile-bytecode $(TORCH_SOURCE) \
	       -r requirements.txt -r requirements-dev.txt -c constraints.txt \
	  && $(UV) --no-deps -e .) > $(VENV)/pip.log 2>&1 || (tail -30 $(VENV)/pip.log; exit 1)
	touch $@

venv: $(VENV)/.installed

# Idempotent: migrate the metadata DB and load connections, pools and variables.
airflow-db: venv
	mkdir -p $(AIRFLOW_HOME)
	airflow db migrate > $(AIRFLOW_HOME)/migrate.log 2>&1 || (tail -20 $(AIRFLOW_HOME)/migrate.log; exit 1)
	$(BIN)/python -m trainyard.airflow.settings airflow_settings.yaml

demo: airflow-db
	$(BIN)/trainyard demo-data --date $(DEMO_DATE)
	airflow dags test nightly_pretrain $(DEMO_DATE) > $(TRAINYARD_HOME)/demo-dags-test.log 2>&1 \
	  || (tail -60 $(TRAINYARD_HOME)/demo-dags-test.log; exit 1)
	$(BIN)/trainyard summary --dag-id nightly_pretrain --latest

# examples/specs/s3_pretrain.yaml end to end, its cold tier (data and published checkpoints) in a SeaweedFS
# that tools/demo_s3.py starts on free ports of 127.0.0.1 and deletes after; the keys travel in its environment.
demo-s3: airflow-db
	$(BIN)/python -m tools.demo_s3 --date $(DEMO_DATE)

# Headless Chromium for tests/integration/test_ui_view.py (Debian package; needs root, as in CI).
# Where it cannot be installed the rest of the suite still runs and that test says why it skipped.
browser: venv
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium > $(VENV)/apt.log 2>&1) \
	  || (tail -5 $(VENV)/apt.log; echo "chromium not installed: tests/integration/test_ui_view.py will skip")

# PostgreSQL (Debian's package) for Airflow's metadata DB in `make airflow` and the service tests
# (tests/integration/test_backfill.py, test_ui_view.py). Needs root, as in CI. Where it cannot be
# installed, those fall back to SQLite and say so.
postgres: venv
	$(BIN)/python -m tools.localpg check >/dev/null 2>&1 \
	  || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql > $(VENV)/apt-postgresql.log 2>&1) \
	  || (tail -5 $(VENV)/apt-postgresql.log; echo "postgresql not installed: make airflow and the service tests fall back to SQLite")

# rclone (Debian's package): the peer bench/staging.py measures staging against. Needs root, as in CI.
# Where it cannot be installed, the staging bench still runs its other sides and says why rclone's are missing.
rclone: venv
	command -v rclone >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rclone > $(VENV)/apt-rclone.log 2>&1) \
	  || (tail -5 $(VENV)/apt-rclone.log; echo "rclone not installed: bench/staging.py reports no rclone ratios")

# torchft and nvidia-resiliency-ext (requirements-bench.txt): the peers bench/recovery.py measures recovery against.
# Where they cannot be installed, the recovery bench still runs and reports each missing peer as {"ran": false, "why": ...}.
bench-peers: venv
	$(BIN)/pip install -r requirements-bench.txt -c constraints.txt > $(VENV)/pip-bench.log 2>&1 \
	  || (tail -5 $(VENV)/pip-bench.log; echo "bench peers not installed: bench/recovery.py reports them as not run")

# Fails on any lint finding, unformatted file, type error or import across the layers (docs/architecture.md); mypy's cache (.mypy_cache) makes a rerun take seconds.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache

# Lint first: a type error fails CI in a minute, not after the suite.
# Two workers, a test file each at a time, then the tests marked `alone` (they measure the machine) by themselves.
# Files go in their order (--no-loadscope-reorder): the long integration files start first and the many short unit
# files fill in at the end; xdist's default starts the files with the most tests first, which left the longest
# single test (backfill, ~3.5 min) for last, beside an idle worker.
# The second phase collects only the files that mark a test alone (tests/conftest.py fails a run where a test is
# marked some other way): collecting all of them imports every test module, ~20 s.
ALONE_FILES = $(shell grep -rl --include='test_*.py' 'mark\.alone' tests | sort)
# Between the phases tools.quiet ends whatever the first left running (each named: a leak to fix), writes the disk's
# dirty pages back and waits, bounded, for an idle machine: CI once failed four burn-in tests right after the first
# phase that passed a minute later.
test: venv lint browser postgres
	$(BIN)/python -m tools.quiet -- $(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 -n 2 --dist loadfile --no-loadscope-reorder -m "not alone" tests
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=5 -m alone $(ALONE_FILES)

# The staging, publish and upload S3 tests against Ceph RGW (tools/rgw.py) instead of SeaweedFS: a second S3
# implementation, one without flexible checksums. Needs Debian's radosgw, ceph-mon and ceph-osd (installed here
# as root); about 12 s to start the cluster. CI does not run it.
S3_TESTS := tests/integration/test_rgw.py tests/integration/test_s3_foreign.py tests/integration/test_s3_tiers.py tests/integration/test_s3_pipeline.py tests/integration/test_upload_cli.py
test-rgw: venv
	command -v radosgw >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq radosgw ceph-mon ceph-osd > $(VENV)/apt-ceph.log 2>&1) \
	  || (tail -5 $(VENV)/apt-ceph.log; exit 1)
	TRAINYARD_TEST_S3=rgw $(BIN)/python -m pytest -q -p no:cacheprovider -rs $(S3_TESTS)

test-unit: venv
	$(BIN)/python -m pytest -q tests/unit

# Airflow on PostgreSQL in $(PGDATA_DIR) with the LocalExecutor, as the compose stack runs it
# (without PostgreSQL: SQLite, and it says so). The server starts first and stops last. Airflow runs
# in a process group of its own (set -m: a job, whose SIGINT is not ignored): Ctrl-C asks it to stop, and whatever of it is left after 60 s
# is killed (a scheduler stopped twice, by Ctrl-C and by standalone, can wait forever on its workers).
airflow: venv postgres
	@mkdir -p $(AIRFLOW_HOME); \
	if url=$$($(BIN)/python -m tools.localpg start $(PGDATA_DIR)); then \
	  trap '$(BIN)/python -m tools.localpg stop $(PGDATA_DIR)' EXIT; \
	  export AIRFLOW__DATABASE__SQL_ALCHEMY_CONN="$$url" AIRFLOW__CORE__EXECUTOR=LocalExecutor; \
	  echo "metadata DB: PostgreSQL in $(PGDATA_DIR) (an empty one: make clean-pg)"; \
	else echo "PostgreSQL unavailable (see above): the metadata DB is SQLite in $(AIRFLOW_HOME)"; fi; \
	airflow db migrate > $(AIRFLOW_HOME)/migrate.log 2>&1 || { tail -20 $(AIRFLOW_HOME)/migrate.log; exit 1; }; \
	$(BIN)/python -m trainyard.airflow.settings airflow_settings.yaml || exit 1; \
	echo "Airflow UI: http://127.0.0.1:8080  user: admin  password: see $(AIRFLOW_HOME)/simple_auth_manager_passwords.json.generated"; \
	set -m; airflow standalone & af=$$!; set +m; \
	trap 'kill -INT $$af 2>/dev/null' INT TERM HUP; \
	wait $$af; \
	for i in $$(seq 60); do kill -0 $$af 2>/dev/null || break; sleep 1; done; \
	kill -KILL -- -$$af 2>/dev/null; true

# Each bench prints one JSON line last; it becomes bench/results/<name>.json only if the bench succeeded.
bench: venv rclone bench-peers
	mkdir -p bench/results
	set -e; for b in bench/*.py; do name=$$(basename $$b .py); \
	  $(BIN)/python $$b 2>bench/results/$$name.err | tee bench/results/$$name.log; \
	  tail -n 1 bench/results/$$name.log | $(BIN)/python -m tools.bench_stamp > bench/results/$$name.json.new; \
	  mv bench/results/$$name.json.new bench/results/$$name.json; rm bench/results/$$name.log bench/results/$$name.err; done

# A newcomer's first day on a clean clone of HEAD (minutes: a venv and the demo): tools/newcomer.sh says each step.
newcomer:
	bash tools/newcomer.sh $(NEWCOMER_DIR)

clean: clean-pg
	rm -rf $(AIRFLOW_HOME) $(TRAINYARD_HOME)

# An empty metadata DB for `make airflow` next time: stop its PostgreSQL, delete the cluster.
clean-pg:
	test ! -d $(PGDATA_DIR) || $(BIN)/python -m tools.localpg stop $(PGDATA_DIR)
	rm -rf $(PGDATA_DIR)
