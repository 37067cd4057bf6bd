# dcpmla: one entry point for a fresh Debian 12 machine.
#   make demo    install what is missing, build, run the CLI demo (also on the GPU, where there is one)
#   make test    install what is missing, build, run C++ tests, Python tests, install check
#   make sanitize / make fuzz / make fresh-check: the reliability checks (docs/reliability.md)
#   make perf-table / make plots: docs/perf.md's table and SVGs from bench/results/
# BUILD_DIR picks the CMake build folder (default build/). CMake cache variables such
# as DCPMLA_CUDA (AUTO/ON/OFF) can be passed through CMAKE_ARGS.

BUILD_DIR  ?= build
CMAKE_ARGS ?=
JOBS       ?= 2
VENV       := .venv
PY         := $(CURDIR)/$(VENV)/bin/python
INSTALL_PREFIX := $(abspath $(BUILD_DIR))/_install

# build runs cmake with -j itself; the steps of `test` must run one after another.
.NOTPARALLEL:

.PHONY: all setup configure build test ctest pytest demo bench bench-plan perf-table plots install-check sanitize fuzz fresh-check clean distclean

all: build

setup:
	bash scripts/setup.sh

configure: setup
	cmake -S . -B $(BUILD_DIR) \
	  -DDCPMLA_PYTHON=ON \
	  -DPython_EXECUTABLE=$(PY) \
	  -Dnanobind_DIR="$$($(PY) -m nanobind --cmake_dir)" \
	  $(CMAKE_ARGS)

# The extension module lands in python/dcpmla/; a .pth file in the venv puts
# python/ on sys.path, so `.venv/bin/python -c "import dcpmla"` works without pip.
build: configure
	cmake --build $(BUILD_DIR) -j$(JOBS)
	echo "$(CURDIR)/python" > "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/dcpmla-dev.pth"

ctest: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j$(JOBS)

pytest: build
	$(PY) -m pytest -q tests/python

test: ctest pytest install-check

# The GPU run is checked against the same references; exit 3 means no usable GPU (or no
# CUDA backend) and skips it.
demo: build
	$(BUILD_DIR)/apps/dcpmla demo
	@rc=0; $(BUILD_DIR)/apps/dcpmla demo --device cuda || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "make demo: no usable CUDA GPU here: the GPU demo (dcpmla demo --device cuda) is skipped"; \
	else exit $$rc; fi

# On a GPU machine: ceilings, baseline and dcpmla at the issue's shapes (docs/perf.md);
# the table is printed last and the rows are written as JSON.
BENCH_JSON ?= bench/results/latest.json
bench: build
	@test -x $(BUILD_DIR)/bench/dcpmla_bench || { echo "make bench: the CUDA backend is not built (nvcc not found?)"; exit 1; }
	$(BUILD_DIR)/bench/dcpmla_bench --json $(BENCH_JSON)

# Planner::plan per step on one core (CPU only; Google Benchmark): median of 10 repetitions
# per shape, targets in docs/perf.md. BENCH_PLAN_JSON=path also writes the run as JSON.
BENCH_PLAN_JSON ?=
bench-plan: configure
	cmake --build $(BUILD_DIR) --target dcpmla_plan_bench -j$(JOBS)
	$(BUILD_DIR)/bench/dcpmla_plan_bench --benchmark_repetitions=10 --benchmark_report_aggregates_only=true \
	  $(if $(BENCH_PLAN_JSON),--benchmark_out=$(BENCH_PLAN_JSON) --benchmark_out_format=json)

# docs/perf.md's current table and the SVG plots (docs/img/), from bench/results/*.json.
perf-table: setup
	$(PY) scripts/perf_record.py table

plots: setup
	$(PY) scripts/perf_record.py plots

# Install into a scratch prefix and build a separate project against it with
# find_package(dcpmla): proves the exported targets and dependencies are complete.
install-check: build
	rm -rf $(INSTALL_PREFIX) $(BUILD_DIR)/install-check
	cmake --install $(BUILD_DIR) --prefix $(INSTALL_PREFIX)
	cmake -S tests/install -B $(BUILD_DIR)/install-check -DCMAKE_PREFIX_PATH=$(INSTALL_PREFIX)
	cmake --build $(BUILD_DIR)/install-check -j$(JOBS)
	$(BUILD_DIR)/install-check/install_check

# ASan + UBSan + LSan build of the CPU library, the C++ tests and the CLI in build-sanitize/
# (no CUDA; no Python: the extension would need the ASan runtime preloaded into python).
# Reports go to files (log_path), so a test whose pass is decided by a regex over its output
# (the CLI and MPI tests) cannot hide one; any report fails the target. The MPI tests run
# with leak detection off: Open MPI leaks at exit by design (~120 KB in ~3,350 allocations
# per process, many from plugins already unloaded, which no suppression can name).
SANITIZE_DIR := build-sanitize
SAN_REPORTS  := $(CURDIR)/$(SANITIZE_DIR)/reports
SAN_MPI      := mpi_np|cli_demo_mpi
san_env = ASAN_OPTIONS=detect_leaks=$(1):detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1:log_path=$(SAN_REPORTS)/asan \
          UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$(SAN_REPORTS)/ubsan

sanitize: setup
	cmake -S . -B $(SANITIZE_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDCPMLA_SANITIZE=ON \
	  -DDCPMLA_CUDA=OFF -DDCPMLA_PYTHON=OFF -DDCPMLA_CLI=ON
	cmake --build $(SANITIZE_DIR) -j$(JOBS)
	rm -rf $(SAN_REPORTS) && mkdir -p $(SAN_REPORTS)
	rc=0; \
	env $(call san_env,1) ctest --test-dir $(SANITIZE_DIR) --output-on-failure -j$(JOBS) -E '$(SAN_MPI)' || rc=1; \
	env $(call san_env,0) ctest --test-dir $(SANITIZE_DIR) --output-on-failure -j$(JOBS) -R '$(SAN_MPI)' || rc=1; \
	if [ -n "$$(ls -A $(SAN_REPORTS))" ]; then cat $(SAN_REPORTS)/*; echo "make sanitize: sanitizer reports above"; rc=1; fi; \
	exit $$rc

# libFuzzer harnesses (tests/fuzz/, clang + ASan + UBSan) in build-fuzz/: each runs
# FUZZ_SECONDS from its committed seed corpus. New inputs go to build-fuzz/corpus/<harness>/,
# a failing input to build-fuzz/<harness>-crash-* (replay: ./build-fuzz/<harness> FILE).
FUZZ_DIR     := build-fuzz
FUZZ_SECONDS ?= 60
FUZZERS      := fuzz_planner fuzz_slot_mapping

fuzz: setup
	cmake -S tests/fuzz -B $(FUZZ_DIR) -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(FUZZ_DIR) -j$(JOBS)
	for f in $(FUZZERS); do \
	  mkdir -p $(FUZZ_DIR)/corpus/$$f; \
	  echo "fuzz: $$f for $(FUZZ_SECONDS) s (log: $(FUZZ_DIR)/$$f.log)"; \
	  if ./$(FUZZ_DIR)/$$f -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
	       -artifact_prefix=$(FUZZ_DIR)/$$f- $(FUZZ_DIR)/corpus/$$f tests/fuzz/corpus/$$f > $(FUZZ_DIR)/$$f.log 2>&1; \
	  then grep -E '^(#[0-9]+.*DONE|stat::number_of_executed_units|Done )' $(FUZZ_DIR)/$$f.log; \
	  else tail -n 60 $(FUZZ_DIR)/$$f.log; echo "make fuzz: $$f failed"; exit 1; fi; \
	done

# The README's two commands on a bare Debian 12: bootstraps one into build-fresh/ with
# debootstrap (root, network), copies the repository in, runs `make demo` and `make test`
# there under chroot. Slow (tens of minutes), so it runs on demand, not in CI.
fresh-check:
	bash scripts/fresh_check.sh

clean:
	rm -rf $(BUILD_DIR)
	rm -f python/dcpmla/_dcpmla*.so

# Also drops the virtual environment (setup rebuilds it).
distclean: clean
	rm -rf $(VENV)
