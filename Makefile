# dcpmla: one entry point for a fresh Debian 12 machine.
#   make demo    install what is missing, build, run the CLI demo
#   make test    install what is missing, build, run C++ tests, Python tests, install check
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

.PHONY: all setup configure build test ctest pytest demo bench install-check clean distclean

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

demo: build
	./$(BUILD_DIR)/apps/dcpmla demo

# On a GPU machine: ceilings, baseline and dcpmla at the issue's shapes (docs/perf.md);
# the table is printed last and the rows are written as JSON.
BENCH_JSON ?= bench/results/latest.json
bench: build
	@test -x $(BUILD_DIR)/bench/dcpmla_bench || { echo "make bench: the CUDA backend is not built (nvcc not found?)"; exit 1; }
	./$(BUILD_DIR)/bench/dcpmla_bench --json $(BENCH_JSON)

# Install into a scratch prefix and build a separate project against it with
# find_package(dcpmla): proves the exported targets and dependencies are complete.
install-check: build
	rm -rf $(INSTALL_PREFIX) $(BUILD_DIR)/install-check
	cmake --install $(BUILD_DIR) --prefix $(INSTALL_PREFIX)
	cmake -S tests/install -B $(BUILD_DIR)/install-check -DCMAKE_PREFIX_PATH=$(INSTALL_PREFIX)
	cmake --build $(BUILD_DIR)/install-check -j$(JOBS)
	./$(BUILD_DIR)/install-check/install_check

clean:
	rm -rf $(BUILD_DIR)
	rm -f python/dcpmla/_dcpmla*.so

# Also drops the virtual environment (setup rebuilds it).
distclean: clean
	rm -rf $(VENV)
