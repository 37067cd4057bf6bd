"""The GPU machine's build registers every GPU test this build does.

scripts/device.sh configures with its own DCPMLA_* options (the CPU tests off, the CUDA tests
on) and runs `ctest -L gpu` there. A test labelled gpu but registered only under DCPMLA_TESTS
is then never built where there is a GPU, and a CPU machine only ever skips it: the bench's
bench_columns_and_clocks and bench_block_size_one were in that state until the sixty-ninth
session (bench/NOTES.md). Both configurations are made here (no build), with nvcc.
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def device_options():
    """The DCPMLA_* options of device.sh's build_tree, as it passes them to cmake."""
    text = (REPO / "scripts" / "device.sh").read_text()
    start = text.index("build_tree() {")
    body = text[start : text.index("\n}\n", start)]
    options = re.findall(r"-D(DCPMLA_\w+=\w+)", body)
    assert options, "scripts/device.sh: build_tree passes no -DDCPMLA_ option to cmake"
    return [f"-D{o}" for o in options]


def gpu_tests(build: Path, options):
    """The names of the tests labelled gpu that a configuration with these options registers."""
    nanobind = subprocess.run([sys.executable, "-m", "nanobind", "--cmake_dir"], capture_output=True, text=True)
    python = [f"-Dnanobind_DIR={nanobind.stdout.strip()}", f"-DPython_EXECUTABLE={sys.executable}",
              "-DDCPMLA_PYTHON=ON"] if nanobind.returncode == 0 else []
    done = subprocess.run(["cmake", "-S", str(REPO), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *python, *options],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"cmake {' '.join(options)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    listed = subprocess.run(["ctest", "--test-dir", str(build), "-N", "-L", "gpu", "--show-only=json-v1"],
                            capture_output=True, text=True, check=True)
    return {t["name"] for t in json.loads(listed.stdout)["tests"]}


@pytest.mark.skipif(shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists(),
                    reason="no CUDA toolkit: no GPU test is registered anywhere")
def test_the_device_build_registers_every_gpu_test(tmp_path):
    here = gpu_tests(tmp_path / "here", ["-DDCPMLA_CUDA=ON"])
    device = gpu_tests(tmp_path / "device", ["-DDCPMLA_CUDA=ON", *device_options()])
    assert here, "this configuration registers no gpu-labelled test"
    missing = sorted(here - device)
    assert not missing, f"labelled gpu but not registered by scripts/device.sh's options: {missing}"
