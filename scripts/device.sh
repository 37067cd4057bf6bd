#!/usr/bin/env bash
# Build, test and benchmark the CUDA backend on a GPU machine in one go:
#   scripts/device.sh [all|test|bench]      (default all), on the GPU machine
#   scripts/device.sh deps                  here, before the call: fills .devdeps/ (carry it)
# Builds with the machine's own toolchain (nvcc, cmake, g++), runs `ctest -L gpu`, a
# compute-sanitizer memcheck / racecheck on small cases, then dcpmla_bench; logs and the
# bench JSON go to $OUT (default build-device/out) and the bench table is printed last.
# Missing build dependencies (the GPU image has no libfmt-dev / googletest) are taken from
# .devdeps/ when present: fmt headers (used header-only) and googletest sources.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE="${1:-all}"
BUILD="${BUILD_DIR:-$ROOT/build-device}"
OUT="${OUT:-$BUILD/out}"
JOBS="${JOBS:-$(nproc)}"
BENCH_ARGS="${BENCH_ARGS:-}"
SANITIZE="${SANITIZE:-1}"   # 0 skips compute-sanitizer
NCU="${NCU:-0}"             # 1 profiles the attention kernel at a few shapes (Nsight Compute)
export NCCL_NVLS_ENABLE=0
say() { echo "[device.sh] $*"; }

if [[ "$MODE" == deps ]]; then
  # What the GPU image lacks, from this machine's Debian packages (libfmt-dev, googletest).
  rm -rf .devdeps && mkdir -p .devdeps/fmt/include .devdeps/fmt/lib/cmake/fmt
  cp -r /usr/include/fmt .devdeps/fmt/include/ && cp -r /usr/src/googletest .devdeps/googletest || exit 1
  cat >.devdeps/fmt/lib/cmake/fmt/fmt-config.cmake <<'CFG'
# Header-only {fmt} carried to the GPU machine (its image has no libfmt-dev).
if(NOT TARGET fmt::fmt)
  add_library(fmt::fmt INTERFACE IMPORTED)
  get_filename_component(_fmt_root "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
  set_target_properties(fmt::fmt PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${_fmt_root}/include"
    INTERFACE_COMPILE_DEFINITIONS "FMT_HEADER_ONLY=1")
endif()
set(fmt_FOUND TRUE)
set(fmt_VERSION 9.1.0)
CFG
  grep -qx '/.devdeps/' .git/info/exclude 2>/dev/null || echo '/.devdeps/' >>.git/info/exclude
  say ".devdeps ready ($(du -sh .devdeps | cut -f1)); pass carry=[\".devdeps\"] to the device call"
  exit 0
fi
mkdir -p "$OUT"
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total --format=csv \
  >"$OUT/gpu.txt" 2>&1 || true
say "$(tail -n 1 "$OUT/gpu.txt")"
say "nvcc: $(nvcc --version | tail -n 1); cmake: $(cmake --version | head -n 1); $(g++ --version | head -n 1)"

# ---- dependencies -------------------------------------------------------------------------
PREFIXES=()
has_cmake_pkg() {  # name: is a CMake package config findable in the usual places?
  ls /usr/lib/x86_64-linux-gnu/cmake/"$1" /usr/lib/cmake/"$1" /usr/local/lib/cmake/"$1" \
     /usr/share/cmake/"$1" /usr/local/lib64/cmake/"$1" >/dev/null 2>&1
}
if has_cmake_pkg fmt; then
  say "fmt: system"
elif [[ -d .devdeps/fmt ]]; then
  say "fmt: carried header-only copy"
  PREFIXES+=("$ROOT/.devdeps/fmt")
else
  say "fmt: MISSING (no system package and no .devdeps/fmt)"
fi
if has_cmake_pkg GTest; then
  say "googletest: system"
elif [[ -d .devdeps/googletest ]]; then
  say "googletest: building the carried sources"
  if [[ ! -f /tmp/dcpmla-gtest/lib/cmake/GTest/GTestConfig.cmake && ! -f /tmp/dcpmla-gtest/lib64/cmake/GTest/GTestConfig.cmake ]]; then
    cmake -S .devdeps/googletest -B /tmp/dcpmla-gtest-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON -DCMAKE_INSTALL_PREFIX=/tmp/dcpmla-gtest >"$OUT/build.log" 2>&1 &&
      cmake --build /tmp/dcpmla-gtest-build -j "$JOBS" >>"$OUT/build.log" 2>&1 &&
      cmake --install /tmp/dcpmla-gtest-build >>"$OUT/build.log" 2>&1 || say "googletest build FAILED"
  fi
  PREFIXES+=("/tmp/dcpmla-gtest")
else
  say "googletest: MISSING"
fi
prefix_path="$(IFS=';'; echo "${PREFIXES[*]:-}")"

# ---- build ----------------------------------------------------------------------------------
t0=$(date +%s)
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix_path" \
  -DDCPMLA_CUDA=ON -DDCPMLA_CUDA_TESTS=ON -DDCPMLA_BENCH=ON -DDCPMLA_TESTS=OFF -DDCPMLA_CLI=OFF \
  -DDCPMLA_PYTHON=OFF -DDCPMLA_MPI=OFF -DDCPMLA_INSTALL=OFF >>"$OUT/build.log" 2>&1 &&
  cmake --build "$BUILD" -j "$JOBS" --target test_cuda_attention test_cuda_graph test_cuda_kernels dcpmla_bench \
    >>"$OUT/build.log" 2>&1
if [[ $? -ne 0 ]]; then
  say "BUILD FAILED ($(( $(date +%s) - t0 )) s); last lines of build.log:"
  grep -E "error|Error" "$OUT/build.log" | head -n 30
  tail -n 30 "$OUT/build.log"
  exit 1
fi
say "built in $(( $(date +%s) - t0 )) s"

# ---- tests ----------------------------------------------------------------------------------
if [[ "$MODE" == all || "$MODE" == test ]]; then
  t0=$(date +%s)
  # Four test processes share the GPU; each CPU reference gets a quarter of the cores.
  OMP_NUM_THREADS=$(( JOBS / 4 > 0 ? JOBS / 4 : 1 )) timeout 300 \
    ctest --test-dir "$BUILD" -L gpu -j 4 --output-on-failure --timeout 200 \
      --output-junit "$OUT/ctest_junit.xml" >"$OUT/ctest.log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=1
  say "ctest -L gpu: rc $rc in $(( $(date +%s) - t0 )) s: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -n 1)"
  grep -E "^\s*[0-9]+ - .*(Failed|Timeout|Exception|SEGFAULT|Not Run)" "$OUT/ctest.log" | head -n 40
  grep -E "Failure|Expected|Which is|worst|rel_l2" "$OUT/ctest.log" | head -n 40

  # compute-sanitizer on small cases (memcheck: out-of-bounds / misaligned; racecheck: shared memory).
  if [[ "$SANITIZE" == 0 ]]; then
    say "compute-sanitizer skipped (SANITIZE=0)"
  elif command -v compute-sanitizer >/dev/null 2>&1; then
    t0=$(date +%s)
    small='Scenarios/*heads5_verify:Scenarios/*all_padding_split:Scenarios/*block1_world8_draft:Scenarios/*heads40_qlen2_two_groups'
    timeout 60 compute-sanitizer --tool memcheck --error-exitcode 3 \
      "$BUILD/tests/cuda/test_cuda_attention" --gtest_filter="$small" >"$OUT/sanitizer.log" 2>&1
    mc=$?
    timeout 30 compute-sanitizer --tool memcheck --error-exitcode 3 \
      "$BUILD/tests/cuda/test_cuda_kernels" >>"$OUT/sanitizer.log" 2>&1
    mc2=$?
    timeout 60 compute-sanitizer --tool racecheck --error-exitcode 3 \
      "$BUILD/tests/cuda/test_cuda_attention" --gtest_filter='Scenarios/*heads5_verify:Scenarios/*heads40_qlen2_two_groups' >>"$OUT/sanitizer.log" 2>&1
    rcheck=$?
    [[ $mc -ne 0 || $mc2 -ne 0 || $rcheck -ne 0 ]] && status=1
    say "compute-sanitizer: memcheck rc $mc/$mc2, racecheck rc $rcheck ($(( $(date +%s) - t0 )) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tr '\n' ' ')"
  else
    say "compute-sanitizer not found"
  fi
fi

# ---- profile (optional) -----------------------------------------------------------------------
if [[ "$NCU" == 1 ]] && command -v ncu >/dev/null 2>&1; then
  t0=$(date +%s)
  : >"$OUT/ncu.txt"
  for shape in decode16 decode16_e4m3 decode128; do
    echo "=== $shape" >>"$OUT/ncu.txt"
    timeout 45 ncu --clock-control none -k regex:attention_kernel -c 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section LaunchStats --section Occupancy \
      "$BUILD/bench/dcpmla_bench" --only "$shape" --runs 3 --no-baseline --no-ceilings >>"$OUT/ncu.txt" 2>&1
  done
  say "ncu: $(( $(date +%s) - t0 )) s; summary:"
  grep -E "^=== |Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy" \
    "$OUT/ncu.txt" | head -n 60
  grep -E "stalled|stall" "$OUT/ncu.txt" | cut -c1-300 | head -n 16
fi

# ---- bench (its table is the last thing printed) ---------------------------------------------
if [[ "$MODE" == all || "$MODE" == bench ]]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout 180 "$BUILD/bench/dcpmla_bench" --json "$OUT/bench.json" $BENCH_ARGS >"$OUT/bench.log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=1
  say "bench: rc $rc in $(( $(date +%s) - t0 )) s"
  cat "$OUT/bench.log"
fi
exit $status
