"""scripts/ncu_hot.py reads Nsight Compute's source page as ncu prints it: ==PROF== lines, a
"Kernel Name" line before each launch's table (the first device run of 2026-12-02 failed on
it), and only the first launch's table counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed"\n')


def page(tables):
    lines = ["==PROF== Connected to process 1\n"]
    for kernel, rows in tables:
        lines.append(f'"Kernel Name","{kernel}",\n')
        lines.append(HEADER)
        lines += [f'"{addr}","{src}","{allsamples}","{notissued}","65536"\n' for addr, src, allsamples, notissued in rows]
    lines.append("==PROF== Disconnected from process 1\n")
    return "".join(lines)


def run(tmp_path, text, *args):
    path = tmp_path / "page.csv"
    path.write_text(text)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_hot.py"), str(path), *args],
                          capture_output=True, text=True)


def test_hottest_of_the_first_launch(tmp_path):
    first = [("0x10", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR20], R152", "30", "5"),
             ("0x20", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13+0x38438], R2", "1,200", "1,100"),
             ("0x30", "BAR.SYNC.DEFER_BLOCKING 0x1, 0x100", "770", "700")]
    second = [("0x10", "FFMA R1, R2, R3, R4", "9,999", "0")]  # a later launch: not read
    out = run(tmp_path, page([("attention_wgmma_kernel<0>", first), ("attention_wgmma_kernel<0>", second)]),
              "--top", "2")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "3 instructions, 2000 samples; the 2 hottest:"
    assert "60.0%" in lines[1] and "TRYWAIT" in lines[1] and "1100" in lines[1]
    assert "38.5%" in lines[2] and "BAR.SYNC" in lines[2]
    assert "FFMA" not in out.stdout


def test_refuses_a_page_without_a_source_table(tmp_path):
    out = run(tmp_path, "==PROF== Connected to process 1\n==PROF== No kernels were profiled.\n")
    assert out.returncode != 0 and "no source table" in out.stderr


def test_refuses_a_top_that_is_not_a_positive_count(tmp_path):
    """--top -1 once printed all but the last row (a slice from the end); 0 prints nothing."""
    text = page([("attention_wgmma_kernel<0>", [("0x10", "FFMA R1, R2, R3, R4", "5", "0")])])
    for top in ("-1", "0"):
        out = run(tmp_path, text, "--top", top)
        assert out.returncode == 2 and f"argument --top: {top} is not a positive count" in out.stderr, out.stderr


def test_refuses_a_missing_page_naming_it(tmp_path):
    path = tmp_path / "missing.csv"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "ncu_hot.py"), str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 1 and out.stderr.strip() == f"{path}: cannot be read (No such file or directory)"
