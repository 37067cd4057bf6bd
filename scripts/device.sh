#!/usr/bin/env bash
# Build, test and benchmark the CUDA backend on a GPU machine in one call:
#   scripts/device.sh [all|test|bench|ab]   (default all)
#   scripts/device.sh deps                  here, before the call: fills .devdeps/ (carry it);
#                                           AB_REV="<rev> [<rev>...]" also puts those commits'
#                                           trees in it; it records this tree's sources, and
#                                           the other modes refuse to run on a different one
# One configure and build with the machine's own toolchain (nvcc, cmake, g++; mode ab also
# builds each other tree's bench), then:
#   test    ctest -L "${LABELS:-gpu}": every GPU test is a CTest test with labels: gpu (all of
#           them), dcp (the DCP step, device and NCCL communicators, mpirun), sanitize (the
#           compute-sanitizer runs); the Python grid with device="cuda" is the test pytest_cuda;
#           TESTS=<regex> keeps only the tests whose names match (ctest -R); TEST_TIMEOUT=<s>
#           ends each test after that many seconds (a kernel that hangs then costs one
#           test's time, not the call's)
#   bench   dcpmla_dcp_bench, dcpmla_bench and dcpmla_wgmma_probe (--json, with their metadata);
#           tables printed last
#   ab      dcpmla_bench of this tree and of each AB_REV's (carried) in one call, alternating
#           this, the others, this, the others with AB_BENCH_ARGS: experiments against their
#           base on the same warm card, without a second machine start (two rounds of every
#           tree: pass --only <shapes> in AB_BENCH_ARGS to stay inside a device call's limit)
# NCU=1 also profiles the attention kernels (NCU_KERNELS, a regex; NCU_COUNT launches) at
# NCU_SHAPES (Nsight Compute; any bench shape, the serving batches included); NCU_SOURCE=1
# adds the stall samples per SASS instruction of the first matching launch at each of
# NCU_SHAPES (default decode128; scripts/ncu_hot.py prints the hottest: which wait the warps
# sit in). NCU_CACHE=none keeps the caches between the profiled kernels (Nsight flushes them
# by default: a kernel that reads what the one before wrote, such as the combine, is then
# timed from DRAM).
# NOFILL=1 builds with DCPMLA_PROBE_NO_FILL (bench and ab only; build-device-nofill): the bf16
# tile streams load nothing, so the times are the consumers' alone (wrong results).
# Logs and JSON go to $OUT (default build-device/out). When the caller sets $OUT (the device
# tool does, and brings back 8 files of it at most), more than 7 files there are packed into
# $OUT/device_out.tgz at exit, so a command that calls this script keeps its own logs outside
# $OUT; the default folder is left as written. What the GPU image lacks (libfmt-dev,
# googletest, CLI11, nlohmann-json, nccl.h) is taken from .devdeps/.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
MODE="${1:-all}"
case "$MODE" in
  all | test | bench | ab | deps) ;;
  *) echo "usage: scripts/device.sh [all|test|bench|ab|deps] (got '$MODE')" >&2; exit 2 ;;
esac
BUILD="${BUILD_DIR:-$ROOT/build-device$([[ "${NOFILL:-0}" == 1 ]] && echo -nofill)}"
PACK_OUT="${OUT:+1}"  # $OUT from the caller (the device tool sets it): pack it at exit (below)
OUT="${OUT:-$BUILD/out}"
JOBS="${JOBS:-$(nproc)}"
BENCH_ARGS="${BENCH_ARGS:-}"
DCP_BENCH_ARGS="${DCP_BENCH_ARGS:-}"
NCU="${NCU:-0}"             # 1 profiles the attention kernels at NCU_SHAPES (Nsight Compute)
# The kernels NCU=1 profiles (a regex) and how many launches of them per shape.
NCU_KERNELS="${NCU_KERNELS:-attention_(wgmma_|fp8_swap_)?kernel}"
NCU_COUNT="${NCU_COUNT:-1}"
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
  # CLI11 and nlohmann-json (header-only) for the bench binaries and the CLI.
  mkdir -p .devdeps/headers/include .devdeps/headers/lib/cmake/CLI11 .devdeps/headers/lib/cmake/nlohmann_json
  cp -r /usr/include/CLI /usr/include/nlohmann .devdeps/headers/include/ || exit 1
  for pkg in CLI11:CLI11::CLI11 nlohmann_json:nlohmann_json::nlohmann_json; do
    name=${pkg%%:*} target=${pkg#*:}
    cat >".devdeps/headers/lib/cmake/$name/${name}Config.cmake" <<CFG
# Header-only $name carried to the GPU machine.
if(NOT TARGET $target)
  add_library($target INTERFACE IMPORTED)
  set_target_properties($target PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "\${CMAKE_CURRENT_LIST_DIR}/../../../include")
endif()
set(${name}_FOUND TRUE)
CFG
  done
  # The image has libnccl.so.2 but no nccl.h; the toolkit here ships the header.
  mkdir -p .devdeps/nccl/include && cp /usr/local/cuda/include/nccl.h .devdeps/nccl/include/ || exit 1
  # The commit the copy is of (the GPU machine's copy of .git is not this checkout's).
  git describe --always --dirty --abbrev=12 >.devdeps/commit
  # And what it builds and runs (what the GPU machine copies: tracked and untracked files
  # outside .gitignore; records and notes left out, so writing them does not void a deps),
  # checked there before anything is built: a call made after a checkout without a new deps
  # would label another tree with this commit. (A file added after the deps is not listed,
  # so it escapes the check: run deps again after adding one.)
  git ls-files -z --cached --others --exclude-standard -- CMakeLists.txt cmake include src bench tests python scripts \
    ':(exclude)bench/results' ':(exclude)*.md' | xargs -0 sha1sum >.devdeps/tree.sha1 || exit 1
  mkdir -p .devdeps/vectors && cp ../shared/vectors/* .devdeps/vectors/ 2>/dev/null || true
  i=0
  for rev in ${AB_REV:-}; do
    i=$((i + 1))
    # Without its records (bench/results): the call carries 64 MiB at most.
    mkdir -p ".devdeps/ab/$i" && git archive "$rev" | tar -x -C ".devdeps/ab/$i" --exclude=bench/results || exit 1
    echo "$rev $(git rev-parse --short=12 "$rev")" >".devdeps/ab/$i/.commit"
    say "other tree $i of mode ab: $(cat ".devdeps/ab/$i/.commit")"
  done
  say ".devdeps ready ($(du -sh .devdeps | cut -f1)); pass carry=[\".devdeps\"] to the device call"
  exit 0
fi
mkdir -p "$OUT"
status=0
# The device tool brings back at most 8 files of $OUT: with more (a test run's logs beside an
# ab of three trees), everything is packed into one archive at exit, so that none is dropped.
# shellcheck disable=SC2317  # (called by the trap)
bundle_out() {
  local n tgz="${TMPDIR:-/tmp}/device_out.$$.tgz"
  n=$(find "$OUT" -type f | wc -l)
  if (( n > 7 )) && tar -czf "$tgz" -C "$OUT" .; then
    find "$OUT" -mindepth 1 -delete && mv "$tgz" "$OUT/device_out.tgz"
    say "$n files in \$OUT packed into device_out.tgz (tar -xzf it where the files come back)"
  fi
}
[[ -n "$PACK_OUT" ]] && trap bundle_out EXIT
if [[ -f .devdeps/tree.sha1 ]] && ! sha1sum --check --quiet .devdeps/tree.sha1 >"$OUT/tree_check.txt" 2>&1; then
  say "this tree is not the one .devdeps was made from ($(cat .devdeps/commit)): run scripts/device.sh deps again"
  head -n 5 "$OUT/tree_check.txt"
  exit 2
fi

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
header_only() {  # label, carried prefix, CMake packages: the system's when all are found, else the carried copy
  local label=$1 carried=$2 pkg
  shift 2
  for pkg in "$@"; do
    has_cmake_pkg "$pkg" && continue
    if [[ -d "$carried" ]]; then
      say "$label: carried header-only copy"
      PREFIXES+=("$ROOT/$carried")
    else
      say "$label: MISSING (no system package and no $carried)"
    fi
    return
  done
  say "$label: system"
}
header_only fmt .devdeps/fmt fmt
header_only "CLI11, nlohmann-json" .devdeps/headers CLI11 nlohmann_json
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
# A warm machine keeps $BUILD, and a copied-back source can be older than an object built
# from an edit made here in an earlier call: ninja would keep that object. So the build
# follows content, not times: sources whose content changed since this script's last build
# are touched, and everything is when some object is newer than that build (something was
# built here outside this script, e.g. an experiment on an edited source).
SOURCES=(src include tests bench python apps cmake CMakeLists.txt)
mkdir -p "$BUILD"
find "${SOURCES[@]}" -type f -print0 | xargs -0 sha1sum | sort >"$BUILD/.sources.new"
if [[ -f "$BUILD/.sources" ]]; then
  if [[ -n "$(find "$BUILD" -name '*.o' -newer "$BUILD/.sources" -print -quit)" ]]; then
    say "objects built outside device.sh since its last build: rebuilding everything"
    find "${SOURCES[@]}" -type f -exec touch {} +
  else
    diff "$BUILD/.sources" "$BUILD/.sources.new" | awk '/^> /{print $3}' | xargs -r touch
  fi
fi
EXTRA=()
# NOFILL=1: a measuring build (DCPMLA_PROBE_NO_FILL, cmake/cuda.cmake) of every tree, in its own
# build directories: the bf16 tile streams load nothing, so bench and ab time the consumers
# alone. Its results are wrong: mode test refuses it, and mode ab refuses a tree older than the
# option (it would build normally and be compared with the measuring build).
if [[ "${NOFILL:-0}" == 1 ]]; then
  [[ "$MODE" == test || "$MODE" == all ]] && { say "NOFILL=1 builds give wrong results: bench or ab only"; exit 2; }
  if [[ "$MODE" == ab ]]; then
    for d in .devdeps/ab/*/; do
      grep -q DCPMLA_PROBE_NO_FILL "$d/cmake/cuda.cmake" 2>/dev/null ||
        { say "NOFILL=1: other tree $(cat "$d/.commit" 2>/dev/null) has no DCPMLA_PROBE_NO_FILL"; exit 2; }
    done
  fi
  EXTRA+=(-DDCPMLA_PROBE_NO_FILL=ON)
fi
[[ -f /usr/local/cuda/include/nccl.h || ! -d .devdeps/nccl ]] || EXTRA+=("-DNCCL_ROOT=$ROOT/.devdeps/nccl")
if NB_DIR="$(python3 -m nanobind --cmake_dir 2>/dev/null)"; then
  EXTRA+=(-DDCPMLA_PYTHON=ON "-Dnanobind_DIR=$NB_DIR" "-DPython_EXECUTABLE=$(command -v python3)")
fi
build_tree() {  # source dir, build dir, [targets...]
  local src=$1 dir=$2
  shift 2
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix_path" \
    -DDCPMLA_CUDA=ON -DDCPMLA_CUDA_TESTS=ON -DDCPMLA_BENCH=ON -DDCPMLA_TESTS=OFF -DDCPMLA_CLI=ON \
    -DDCPMLA_INSTALL=OFF "${EXTRA[@]}" >>"$OUT/build.log" 2>&1 &&
    cmake --build "$dir" -j "$JOBS" ${1:+--target "$@"} >>"$OUT/build.log" 2>&1
}
[[ -f .devdeps/commit ]] && export DCPMLA_COMMIT="$(cat .devdeps/commit)"
build_tree . "$BUILD"
built=$?
# What this build was made from, timed after its objects, also when it failed: the objects it
# did make are then not mistaken for objects built outside this script.
mv "$BUILD/.sources.new" "$BUILD/.sources" && touch "$BUILD/.sources"
if [[ $built -ne 0 ]]; then
  say "BUILD FAILED ($(( $(date +%s) - t0 )) s); last lines of build.log:"
  grep -E "error|Error" "$OUT/build.log" | head -n 30
  tail -n 30 "$OUT/build.log"
  exit 1
fi
say "built in $(( $(date +%s) - t0 )) s ($(grep -E 'dcpmla: (NCCL|MPI)' "$OUT/build.log" | tr '\n' ' '))"

# ---- tests: one ctest run over the labels --------------------------------------------------
if [[ "$MODE" == all || "$MODE" == test ]]; then
  t0=$(date +%s)
  # libnccl.so.2 for carried binaries, when the loader lacks it.
  if ! ldconfig -p | grep -q 'libnccl.so.2 '; then
    for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do
      [[ -e "$d/libnccl.so.2" ]] && { export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; break; }
    done
  fi
  # Four test processes share the GPU; each CPU reference gets a quarter of the cores.
  DCPMLA_VECTORS="$ROOT/.devdeps/vectors" OMP_NUM_THREADS=$(( JOBS / 4 > 0 ? JOBS / 4 : 1 )) \
    ctest --test-dir "$BUILD" -L "${LABELS:-gpu}" ${TESTS:+-R "$TESTS"} ${TEST_TIMEOUT:+--timeout "$TEST_TIMEOUT"} \
      -j 4 --output-on-failure \
      --output-junit "$OUT/ctest_junit.xml" >"$OUT/ctest.log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=1
  say "ctest -L ${LABELS:-gpu}${TESTS:+ -R $TESTS}: rc $rc in $(( $(date +%s) - t0 )) s: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -n 1)"
  grep -E "^\s*[0-9]+ - .*(Failed|Timeout|Exception|SEGFAULT|Not Run)" "$OUT/ctest.log" | head -n 40
  grep -E "Failure|Expected|Which is|worst|rel_l2|ERROR SUMMARY: [1-9]" "$OUT/ctest.log" | head -n 40
fi

# ---- profile (optional) -----------------------------------------------------------------------
if [[ "$NCU" == 1 ]] && command -v ncu >/dev/null 2>&1; then
  t0=$(date +%s)
  : >"$OUT/ncu.txt"
  for shape in ${NCU_SHAPES:-decode16 decode16_e4m3 decode128 verify16_q4}; do
    echo "=== $shape" >>"$OUT/ncu.txt"
    timeout 60 ncu --clock-control none --cache-control "${NCU_CACHE:-all}" -k regex:"$NCU_KERNELS" -c "$NCU_COUNT" \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
      --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
      "$BUILD/bench/dcpmla_bench" --serving --only "$shape" --runs 3 --no-baseline --no-ceilings >>"$OUT/ncu.txt" 2>&1
  done
  say "ncu: $(( $(date +%s) - t0 )) s; summary:"
  grep -E "^=== |Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Shared Memory|Tensor|Pipe" \
    "$OUT/ncu.txt" | head -n 100
  grep -E "stalled|stall" "$OUT/ncu.txt" | cut -c1-300 | head -n 16
  # The stall samples per SASS instruction (NCU_SOURCE=1): the instruction each warp waits in.
  if [[ "${NCU_SOURCE:-0}" == 1 ]]; then
    for shape in ${NCU_SHAPES:-decode128}; do
      rep="$OUT/ncu_src_$shape"
      timeout 90 ncu --clock-control none --cache-control "${NCU_CACHE:-all}" -k regex:"$NCU_KERNELS" -c 1 --section SourceCounters \
        --section WarpStateStats -f -o "$rep" \
        "$BUILD/bench/dcpmla_bench" --serving --only "$shape" --runs 3 --no-baseline --no-ceilings >"$rep.log" 2>&1
      ncu --import "$rep.ncu-rep" --page source --csv --print-source sass >"$rep.csv" 2>>"$rep.log"
      say "hottest instructions at $shape:"
      python3 scripts/ncu_hot.py "$rep.csv" --top 30 || tail -n 5 "$rep.log"
    done
  fi
  # Stall reasons per issued instruction, all warps of the kernel (NCU_STALLS=1).
  if [[ "${NCU_STALLS:-0}" == 1 ]]; then
    for shape in ${NCU_SHAPES:-decode16_e4m3}; do
      timeout 60 ncu --clock-control none --cache-control "${NCU_CACHE:-all}" -k regex:"$NCU_KERNELS" -c "$NCU_COUNT" \
        --metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
        "$BUILD/bench/dcpmla_bench" --serving --only "$shape" --runs 3 --no-baseline --no-ceilings >"$OUT/ncu_stalls_$shape.txt" 2>&1
      say "stalls $shape: $(grep -E 'stalled_' "$OUT/ncu_stalls_$shape.txt" | awk '{print $1, $NF}' | sort -k2 -g -r | head -n 8 |
        sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | tr '\n' ' ')"
    done
  fi
fi

# ---- ab: this tree against each AB_REV's, alternating on the same card -----------------------
if [[ "$MODE" == ab ]]; then
  others=()
  # In AB_REV's order (the directories are numbered from 1; a glob would put 10 before 2).
  for ((i = 1; i <= 64; ++i)); do [[ -f ".devdeps/ab/$i/.commit" ]] && others+=(".devdeps/ab/$i"); done
  [[ ${#others[@]} -gt 0 ]] || { say "mode ab: no .devdeps/ab (run AB_REV=<rev> scripts/device.sh deps)"; exit 1; }
  for d in "${others[@]}"; do
    t0=$(date +%s)
    b="$BUILD-ab-$(basename "$d")"
    # git archive stamps a tree with its commit's time, older than any object of an earlier
    # commit built here on a warm machine: a build of another commit starts from scratch.
    cmp -s "$d/.commit" "$b/.commit" || rm -rf "$b"
    mkdir -p "$b" && cp "$d/.commit" "$b/.commit"
    DCPMLA_COMMIT="$(cut -d' ' -f2 "$d/.commit")" build_tree "$d" "$b" dcpmla_bench ||
      { say "BUILD FAILED (other tree $(cat "$d/.commit"))"; tail -n 30 "$OUT/build.log"; exit 1; }
    say "other tree $(cat "$d/.commit") built in $(( $(date +%s) - t0 )) s"
  done
  for round in 1 2; do
    for side in this "${others[@]}"; do
      if [[ $side == this ]]; then
        bin="$BUILD/bench/dcpmla_bench" name=this label="this $(cat .devdeps/commit)"
      else
        bin="$BUILD-ab-$(basename "$side")/bench/dcpmla_bench" name="other$(basename "$side")"
        label="$(cat "$side/.commit")"
      fi
      # shellcheck disable=SC2086
      timeout 240 "$bin" --json "$OUT/ab_${name}_$round.json" ${AB_BENCH_ARGS:---no-baseline} \
        >"$OUT/ab_${name}_$round.log" 2>&1 || status=1
      echo "=== $label, round $round"
      grep -E '^ ' "$OUT/ab_${name}_$round.log"
    done
  done
fi

# ---- bench (the tables are the last thing printed) ----------------------------------------------
if [[ "$MODE" == all || "$MODE" == bench ]]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  timeout 180 "$BUILD/bench/dcpmla_dcp_bench" --json "$OUT/dcp_bench.json" $DCP_BENCH_ARGS >"$OUT/dcp_bench.log" 2>&1 || status=1
  # shellcheck disable=SC2086
  timeout 420 "$BUILD/bench/dcpmla_bench" --json "$OUT/bench.json" $BENCH_ARGS >"$OUT/bench.log" 2>&1 || status=1
  # The wgmma forms' own rates on this card (a second or two): what the kernels could reach.
  timeout 60 "$BUILD/bench/dcpmla_wgmma_probe" --json "$OUT/wgmma_probe.json" >"$OUT/wgmma_probe.log" 2>&1 || status=1
  say "bench: $(( $(date +%s) - t0 )) s"
  cat "$OUT/dcp_bench.log" "$OUT/bench.log" "$OUT/wgmma_probe.log"
fi
exit $status
