"""scripts/check_register_split.py flags a kernel whose wgmma ptxas serialised: the fp8 form
of the wgmma kernel was, without a warning, when its S was issued behind the P V's commit
group (2026-12-02, eighth session: 44 MMAs, 44 WARPGROUP.ARRIVE)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("check_register_split", ROOT / "scripts" / "check_register_split.py")
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)


def sass(*texts):
    return [(16 * i, text, 0, []) for i, text in enumerate(texts)]


def chain(n, mma="HGMMA.64x64x16.F32.BF16 R152, gdesc[UR24], R152"):
    return [mma] * (n - 1) + [mma + ", gsb0"]


def test_pipelined_chains_pass():
    code = ["WARPGROUP.ARRIVE", *chain(36), "WARPGROUP.DEPBAR.LE gsb0, 0x0",
            "WARPGROUP.ARRIVE", *chain(4, "HGMMA.64x256x16.F32.BF16 R24, R192, gdesc[UR20].tnspB, R24"),
            "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    assert not check.serialised(sass(*code))


def test_one_arrive_per_mma_fails():
    code = []
    for _ in range(44):
        code += ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR24], R152, gsb0"]
    assert check.serialised(sass(*code))


def test_fp8_mmas_count_and_kernels_without_mma_pass():
    code = []
    for _ in range(16):
        code += ["WARPGROUP.ARRIVE", "QGMMA.64x32x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24, gsb0"]
    assert check.serialised(sass(*code))
    assert not check.serialised(sass("WARPGROUP.ARRIVE", "FFMA R1, R2, R3, R4", "EXIT"))


def test_check_fails_a_serialised_kernel_with_a_kept_split(monkeypatch, capsys):
    split = ["USETMAXREG.DEALLOC.CTAPOOL 0x28", "EXIT", "USETMAXREG.TRY_ALLOC.CTAPOOL P0, 0xe8"]
    pipelined = split + ["WARPGROUP.ARRIVE", *chain(36), "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    serial = split + ["WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR24], R152, gsb0",
                      "WARPGROUP.DEPBAR.LE gsb0, 0x0"] * 36 + ["EXIT"]
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*pipelined)})
    assert check.check("nvdisasm", "k.cubin")
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*serial)})
    assert not check.check("nvdisasm", "k.cubin")
    assert "serialised its wgmma" in capsys.readouterr().out


def test_unsplit_kernels_are_checked_for_serialisation_only(monkeypatch, capsys):
    """--unsplit (the bf16 swap kernel: one consumer warpgroup, no setmaxnreg): a kernel
    without a split passes when its wgmma are pipelined and fails when they are serialised;
    the same kernel given as a split kernel fails for its missing split."""
    pipelined = ["WARPGROUP.ARRIVE", *chain(36), "WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]
    serial = ["WARPGROUP.ARRIVE", "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR24], R24, gsb0",
              "WARPGROUP.DEPBAR.LE gsb0, 0x0"] * 36 + ["EXIT"]
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*pipelined)})
    assert check.check("nvdisasm", "k.cubin", split=False)
    assert not check.check("nvdisasm", "k.cubin")
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*serial)})
    assert not check.check("nvdisasm", "k.cubin", split=False)
    assert "serialised its wgmma" in capsys.readouterr().out
    monkeypatch.setattr(check, "find_nvdisasm", lambda: "nvdisasm")
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*pipelined)})
    assert check.main(["x", "--unsplit", "a.cubin"]) == 0
    assert check.main(["x", "a.cubin", "--unsplit", "b.cubin"]) == 1  # a.cubin has no split


def test_no_cubins_fails(monkeypatch, capsys):
    """Checking nothing must not pass: `--unsplit` alone, or an empty list from the ctest."""
    monkeypatch.setattr(check, "find_nvdisasm", lambda: "nvdisasm")
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass("EXIT")})
    assert check.main(["x", "--unsplit"]) == 2
    assert "no cubins given" in capsys.readouterr().err


def test_a_cubin_without_kernels_fails(monkeypatch, capsys):
    """A kernel gone from its instantiation file leaves a cubin with no functions: not a pass."""
    monkeypatch.setattr(check, "find_nvdisasm", lambda: "nvdisasm")
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {})
    assert check.main(["x", "a.cubin"]) == 1
    assert check.main(["x", "--unsplit", "b.cubin"]) == 1
    out = capsys.readouterr().out
    assert "FAIL a.cubin: no kernel functions" in out and "FAIL b.cubin: no kernel functions" in out


def test_nvdisasm_errors_name_the_file(tmp_path, monkeypatch, capsys):
    """A missing or unreadable cubin: nvdisasm's own message with the file's name, not a traceback."""
    nvdisasm = tmp_path / "nvdisasm"
    nvdisasm.write_text('#!/bin/sh\necho "nvdisasm fatal   : Cannot open object file $4" >&2\nexit 1\n')
    nvdisasm.chmod(0o755)
    monkeypatch.setattr(check, "find_nvdisasm", lambda: str(nvdisasm))
    missing = str(tmp_path / "missing.cubin")
    assert check.main(["x", missing]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {missing}: nvdisasm cannot read it: nvdisasm fatal   : Cannot open object file {missing}" in out


# The swap kernels' softmax stretch: a named barrier after the tile maxima's exchange, then
# each row's maxima read (LDS) and its P^T stored (STS), then the fence that publishes P^T.
def softmax_stretch(rows, loads_first):
    loads = [f"LDS R{40 + r}, [R25+0x{0x36104 + 4 * r:x}]" for r in range(rows)]
    stores = [f"STS.U16 [R5+UR17+0x{0x32000 + 0x400 * r:x}], R{60 + r}" for r in range(rows)]
    body = loads + ["MUFU.EX2 R30, R30"] + stores if loads_first else [
        ins for r in range(rows) for ins in (loads[r], "MUFU.EX2 R30, R30", stores[r])]
    return ["BAR.SYNC.DEFER_BLOCKING 0x1, 0x80", *body, "@!PT LDS RZ, [RZ]", "MEMBAR.ALL.CTA",
            "FENCE.VIEW.ASYNC.S", "SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR14+0x36ac8], RZ"]


def test_softmax_loads_behind_stores_are_counted():
    """Main before fd1914f: each row's maxima read after the row before it stored its P^T
    (the 32-row fp8 kernel's SASS had 28 such loads of its 32); the never-executed padding
    (@!PT LDS) and loads outside the barrier-to-fence stretch do not count."""
    assert check.loads_behind_stores(sass(*softmax_stretch(8, loads_first=True))) == 0
    assert check.loads_behind_stores(sass(*softmax_stretch(8, loads_first=False))) == 7
    after_fence = softmax_stretch(8, loads_first=True) + ["STS [R1], R2", "LDS R3, [R1]"]
    assert check.loads_behind_stores(sass(*after_fence)) == 0


def test_swap_kernels_fail_with_the_softmax_behind_its_stores(monkeypatch, capsys):
    """Only the swap kernels' cubins (by file name) are held to the order: the wgmma kernel's
    fp8 form converts Q in place between a barrier and a fence and is not checked."""
    split = ["USETMAXREG.DEALLOC.CTAPOOL 0x20", "EXIT", "USETMAXREG.TRY_ALLOC.CTAPOOL P0, 0xd8"]
    pipelined = ["WARPGROUP.ARRIVE", *chain(18, "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], R24"),
                 "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    good = split + pipelined + softmax_stretch(8, loads_first=True) + ["EXIT"]
    bad = split + pipelined + softmax_stretch(8, loads_first=False) + ["EXIT"]
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*good)})
    assert check.check("nvdisasm", "build/cubins/fp8_swap32_e4m3.cubin")
    assert "the softmax's loads before its stores" in capsys.readouterr().out
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*bad)})
    assert not check.check("nvdisasm", "build/cubins/fp8_swap32_e4m3.cubin")
    assert "7 shared-memory loads after a store" in capsys.readouterr().out
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*bad[3:])})
    assert not check.check("nvdisasm", "bf16_swap_m16.cubin", split=False)  # the unsplit form too
    monkeypatch.setattr(check, "functions", lambda nvdisasm, cubin: {"kernel": sass(*bad)})
    assert check.check("nvdisasm", "build/cubins/wg64_fp8.cubin")
