#!/usr/bin/env bash
# Build, test and benchmark the CUDA backend on a GPU machine in one call:
#   scripts/device.sh [all|test|dcp|python|bench]   (default all: every phase below)
#   scripts/device.sh deps                           here, before the call: fills .devdeps/ (carry it)
# One configure and build with the machine's own toolchain (nvcc, cmake, g++), then:
#   test    ctest -L gpu (without the DCP group), compute-sanitizer memcheck / racecheck / synccheck
#   dcp     the GPU DCP step, the device and NCCL communicators (also under mpirun), DCP bench
#   python  the pytest conformance grid with device="cuda" (the machine's python3 and nanobind)
#   bench   dcpmla_bench: ceilings, baseline and dcpmla at the issue shapes; its table is printed last
# Logs and JSON go to $OUT (default ./device-out). What the GPU image lacks (libfmt-dev,
# googletest, nccl.h) is taken from .devdeps/.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE="${1:-all}"
BUILD="${BUILD_DIR:-$ROOT/build-device}"
OUT="${OUT:-$BUILD/out}"
JOBS="${JOBS:-$(nproc)}"
BENCH_ARGS="${BENCH_ARGS:-}"
SANITIZE="${SANITIZE:-1}"   # 0 skips compute-sanitizer
NCU="${NCU:-0}"             # 1 profiles the attention kernels at NCU_SHAPES (Nsight Compute)
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
  # The image has libnccl.so.2 but no nccl.h; the toolkit here ships the header.
  mkdir -p .devdeps/nccl/include && cp /usr/local/cuda/include/nccl.h .devdeps/nccl/include/ || exit 1
  mkdir -p .devdeps/vectors && cp ../shared/vectors/* .devdeps/vectors/ 2>/dev/null || true
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
EXTRA=()
[[ -f /usr/local/cuda/include/nccl.h || ! -d .devdeps/nccl ]] || EXTRA+=("-DNCCL_ROOT=$ROOT/.devdeps/nccl")
if NB_DIR="$(python3 -m nanobind --cmake_dir 2>/dev/null)"; then
  EXTRA+=(-DDCPMLA_PYTHON=ON "-Dnanobind_DIR=$NB_DIR" "-DPython_EXECUTABLE=$(command -v python3)")
fi
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix_path" \
  -DDCPMLA_CUDA=ON -DDCPMLA_CUDA_TESTS=ON -DDCPMLA_BENCH=ON -DDCPMLA_TESTS=OFF -DDCPMLA_CLI=OFF \
  -DDCPMLA_INSTALL=OFF "${EXTRA[@]}" >>"$OUT/build.log" 2>&1 &&
  cmake --build "$BUILD" -j "$JOBS" >>"$OUT/build.log" 2>&1
if [[ $? -ne 0 ]]; then
  say "BUILD FAILED ($(( $(date +%s) - t0 )) s); last lines of build.log:"
  grep -E "error|Error" "$OUT/build.log" | head -n 30
  tail -n 30 "$OUT/build.log"
  exit 1
fi
say "built in $(( $(date +%s) - t0 )) s ($(grep -E 'dcpmla: (NCCL|MPI)' "$OUT/build.log" | tr '\n' ' '))"

# ---- tests ----------------------------------------------------------------------------------
if [[ "$MODE" == all || "$MODE" == test ]]; then
  t0=$(date +%s)
  # Four test processes share the GPU; each CPU reference gets a quarter of the cores.
  OMP_NUM_THREADS=$(( JOBS / 4 > 0 ? JOBS / 4 : 1 )) timeout 300 \
    ctest --test-dir "$BUILD" -L gpu -LE dcp -j 4 --output-on-failure --timeout 200 \
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
    timeout 60 compute-sanitizer --tool synccheck --error-exitcode 3 \
      "$BUILD/tests/cuda/test_cuda_attention" --gtest_filter='Scenarios/*heads5_verify:Scenarios/*heads40_qlen2_two_groups' >>"$OUT/sanitizer.log" 2>&1
    scheck=$?
    # The fp8 swap kernel: memcheck, racecheck and synccheck on two fp8 scenarios.
    f8='Scenarios/*block1_world8_draft:Scenarios/*heads40_qlen2_two_groups'
    f8rc=0
    for tool in memcheck racecheck synccheck; do
      DCPMLA_TEST_TUNING=fp8swap timeout 60 compute-sanitizer --tool $tool --error-exitcode 3 \
        "$BUILD/tests/cuda/test_cuda_attention" --gtest_filter="$f8" >>"$OUT/sanitizer.log" 2>&1 || f8rc=$?
    done
    [[ $mc -ne 0 || $mc2 -ne 0 || $rcheck -ne 0 || $scheck -ne 0 || $f8rc -ne 0 ]] && status=1
    say "compute-sanitizer: memcheck rc $mc/$mc2, racecheck rc $rcheck, synccheck rc $scheck, fp8 swap rc $f8rc ($(( $(date +%s) - t0 )) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer.log" | tr '\n' ' ')"
  else
    say "compute-sanitizer not found"
  fi
fi

# ---- dcp: the GPU DCP step, device communicators and NCCL (issue 4) --------------------------
# Runs test_cuda_dcp and test_cuda_nccl in parallel groups, then the single-GPU DCP
# benchmark alone. Logs: $OUT/dcp_tests.log,
# $OUT/dcp_bench.log, $OUT/dcp_bench.json, $OUT/dcp_env.txt (NCCL, MPI and loader findings).
if [[ "$MODE" == all || "$MODE" == dcp ]]; then
  BIN="$BUILD"
  find_bin() { for p in "$BIN/$1" "$BIN/tests/cuda/$1" "$BIN/bench/$1"; do [[ -x "$p" ]] && { echo "$p"; return 0; }; done; return 1; }
  {
    echo "nccl.h: $(ls /usr/local/cuda/include/nccl.h 2>&1)"
    echo "loader: $(ldconfig -p | grep -E 'libnccl|libgomp|libmpi' | tr '\n' ';')"
    echo "mpirun: $(command -v mpirun mpiexec 2>&1 | tr '\n' ' ')"
    ls -d /usr/lib/x86_64-linux-gnu/openmpi /opt/hpcx /usr/mpi 2>&1 | tr '\n' ';'; echo
    python3 -c "import mpi4py; print('mpi4py', mpi4py.__version__, mpi4py.get_config())" 2>&1 | tail -n 1
  } >"$OUT/dcp_env.txt"
  # libnccl.so.2 and libgomp.so.1 for carried binaries, when the loader lacks them.
  if ! ldconfig -p | grep -q 'libnccl.so.2 '; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib \
             "$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"; do
      [[ -n "$d" && -e "$d/libnccl.so.2" ]] && { export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; }
    done
  fi
  ldconfig -p | grep -q 'libgomp.so.1 ' || export LD_LIBRARY_PATH="$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}" >>"$OUT/dcp_env.txt"
  say "env: $(tr '\n' ' ' <"$OUT/dcp_env.txt")"
  t0=$(date +%s)
  dcp="$(find_bin test_cuda_dcp)"; nccl="$(find_bin test_cuda_nccl)"
  logs=()
  run_group() {  # name, timeout, command...
    local name=$1 limit=$2; shift 2
    ( OMP_NUM_THREADS=2 timeout "$limit" "$@" >"/tmp/dcp_$name.log" 2>&1; echo "exit $?" >>"/tmp/dcp_$name.log" ) &
    logs+=("$name")
  }
  for n in 2 4 8; do
    for form in reduce_scatter all_to_all; do
      run_group "grid${n}_$form" 200 "$dcp" --gtest_filter="Worlds/*/N${n}_$form"
    done
  done
  run_group rest 200 "$dcp" --gtest_filter='-Worlds/*'
  [[ -n "$nccl" ]] && run_group nccl 100 env NCCL_NVLS_ENABLE=0 "$nccl"
  # The library must not depend on eager module loading (the tests set EAGER for themselves).
  run_group lazy 100 env CUDA_MODULE_LOADING=LAZY "$dcp" \
    --gtest_filter='DcpStep.ShortRequestsAndEmptyRanksAreExact:Worlds/*/N2_all_to_all'
  # The mpirun start-up of NCCL, when this machine has MPI and the binary was built with it.
  mpi="$(find_bin test_nccl_mpi)"
  if [[ -n "$mpi" ]] && command -v mpirun >/dev/null 2>&1; then
    for np in 1 2; do
      run_group "mpi_np$np" 90 env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 \
        mpirun -np "$np" --oversubscribe -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH "$mpi"
    done
  fi
  if [[ "$SANITIZE" != 0 ]] && command -v compute-sanitizer >/dev/null 2>&1; then
    # One rank only: a tool that serialises kernels would stall the device-side barriers.
    run_group memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$dcp" \
      --gtest_filter='DcpStep.OneRankEveryKernel'
  fi
  wait
  : >"$OUT/dcp_tests.log"
  for n in "${logs[@]}"; do { echo "===== $n"; cat "/tmp/dcp_$n.log"; } >>"$OUT/dcp_tests.log"; done
  for n in "${logs[@]}"; do
    rc=$(tail -n 1 "/tmp/dcp_$n.log")
    say "tests $n: $rc; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) |^nccl mpi:|^rank [0-9]+:' "/tmp/dcp_$n.log" | tr '\n' ' ' | cut -c1-300) $(grep -E 'ERROR SUMMARY' "/tmp/dcp_$n.log")"
    [[ "$rc" != "exit 0" ]] && status=1
  done
  say "tests: $(( $(date +%s) - t0 )) s"
  grep -E "Failure|error:|Expected|Which is|actual|worst|rel_l2|Trace|dcp_harness|test_cuda_(dcp|nccl).cpp:[0-9]+" "$OUT/dcp_tests.log" | grep -v Skipped | head -n 60
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout 180 "$(find_bin dcpmla_dcp_bench)" --json "$OUT/dcp_bench.json" $BENCH_ARGS >"$OUT/dcp_bench.log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=1
  say "dcp bench: rc $rc in $(( $(date +%s) - t0 )) s"
  DCP_TABLE="$(cat "$OUT/dcp_bench.log")"
fi

# ---- python: the conformance grid on the GPU ----------------------------------------------------
if [[ "$MODE" == all || "$MODE" == python ]]; then
  t0=$(date +%s)
  if ls python/dcpmla/_dcpmla*.so >/dev/null 2>&1; then
    DCPMLA_VECTORS="$ROOT/.devdeps/vectors" PYTHONPATH="$ROOT/python" OMP_NUM_THREADS=4 timeout 240 \
      python3 -m pytest -q -x -p no:cacheprovider tests/python/test_conformance.py tests/python/test_vectors.py \
      -k cuda >"$OUT/pytest_cuda.log" 2>&1
    rc=$?
    [[ $rc -ne 0 ]] && status=1
    say "pytest device=cuda: rc $rc in $(( $(date +%s) - t0 )) s: $(tail -n 1 "$OUT/pytest_cuda.log")"
    grep -E "Error|assert|FAILED" "$OUT/pytest_cuda.log" | head -n 20
  else
    say "python module not built (no nanobind for python3?)"
  fi
fi

# ---- profile (optional) -----------------------------------------------------------------------
if [[ "$NCU" == 1 ]] && command -v ncu >/dev/null 2>&1; then
  t0=$(date +%s)
  : >"$OUT/ncu.txt"
  for shape in ${NCU_SHAPES:-decode16 decode16_e4m3 decode128 verify16_q4}; do
    echo "=== $shape" >>"$OUT/ncu.txt"
    timeout 60 ncu --clock-control none -k regex:'attention_(wgmma_|fp8_swap_)?kernel' -c 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
      "$BUILD/bench/dcpmla_bench" --only "$shape" --runs 3 --no-baseline --no-ceilings >>"$OUT/ncu.txt" 2>&1
  done
  say "ncu: $(( $(date +%s) - t0 )) s; summary:"
  grep -E "^=== |Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Shared Memory|Tensor|Pipe" \
    "$OUT/ncu.txt" | head -n 100
  grep -E "stalled|stall" "$OUT/ncu.txt" | cut -c1-300 | head -n 16
  # Stall reasons per issued instruction, all warps of the kernel (NCU_STALLS=1).
  if [[ "${NCU_STALLS:-0}" == 1 ]]; then
    for shape in ${NCU_SHAPES:-decode16_e4m3}; do
      timeout 60 ncu --clock-control none -k regex:'attention_(wgmma_|fp8_swap_)?kernel' -c 1 \
        --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        "$BUILD/bench/dcpmla_bench" --only "$shape" --runs 3 --no-baseline --no-ceilings >"$OUT/ncu_stalls_$shape.txt" 2>&1
      say "stalls $shape: $(grep -E 'stalled_' "$OUT/ncu_stalls_$shape.txt" | awk '{print $1, $NF}' | sort -k2 -g -r | head -n 8 |
        sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | tr '\n' ' ')"
    done
  fi
fi

# ---- bench (its table is the last thing printed) ---------------------------------------------
if [[ "$MODE" == all || "$MODE" == bench ]]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout 180 "$BUILD/bench/dcpmla_bench" --json "$OUT/bench.json" $BENCH_ARGS >"$OUT/bench.log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=1
  say "bench: rc $rc in $(( $(date +%s) - t0 )) s"
fi
[[ -n "${DCP_TABLE:-}" ]] && echo "$DCP_TABLE"
[[ -f "$OUT/bench.log" ]] && cat "$OUT/bench.log"
exit $status
