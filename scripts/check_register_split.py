#!/usr/bin/env python3
"""Checks the register split of the warp-specialised kernels in their SASS, and that their
warpgroup MMAs are pipelined.

A kernel that gives its producer warpgroup fewer registers (setmaxnreg.dec) and its
consumers more (setmaxnreg.inc) only runs as designed when ptxas kept the split. When a
region needs more registers than its share, ptxas drops the split without a word and the
whole kernel runs on the launch allocation (168 per thread at 384 threads): the consumers
then spill, or worse, run slowly without spilling. `fits_launch_registers` (wgmma.cuh)
checks the arithmetic of the shares; this checks what ptxas made of them:

  - every cubin given has a USETMAXREG.DEALLOC and a USETMAXREG.TRY_ALLOC (the split is
    there), and
  - in each region (the code reachable from a USETMAXREG up to the next one or an exit),
    no live register has an index at or past the region's share, and
  - ptxas did not serialise the kernel's wgmma: when it cannot prove a pipeline stage safe
    (an accumulator touched between issue and wait, an mbarrier spin inside a commit group,
    a wgmma on a data-dependent branch), it waits after every MMA, each behind its own
    WARPGROUP.ARRIVE, sometimes without a warning. A pipelined kernel has a few arrives per
    chain of MMAs; a serialised one about one per MMA.
  - in the swap kernels' cubins (a file name with "swap": S^T = K Q^T, a row's scores
    spread over the four warps), no
    shared-memory load follows a shared-memory store between a named barrier and the next
    async-proxy fence: that stretch is the softmax after the tile maxima's exchange, which
    reads every row's maxima and stores P^T for the next wgmma. The compiler must assume
    the stores may alias the maxima, so a maximum read after a store waits for it, and the
    rows' steps run one after another (1 340 of a 32-row fp8 tile's 3 140 cycles on the
    H100, bench/NOTES.md, forty-ninth session). Never-executed padding (@!PT) is skipped.

Liveness comes from nvdisasm's register life ranges (-lrm narrow: one column per
register), so wide operands (a 128-register wgmma accumulator, 16-byte loads) count whole.
nvdisasm is the CUDA toolkit's, or the pip package nvidia-cuda-nvdisasm (requirements.txt).

A kernel with one consumer warpgroup needs no split (the launch allocation holds it): the
cubins after --unsplit are checked for the serialisation only.

    check_register_split.py CUBIN... [--unsplit CUBIN...]
                                          exit 0: all kept and within; 1: not, or a cubin nvdisasm
                                          cannot read or with no kernel; 2: no cubins; 77: no nvdisasm
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

SKIP = 77
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
SETMAXREG = re.compile(r"USETMAXREG\.(TRY_ALLOC|DEALLOC)\.CTAPOOL.*?(0x[0-9a-f]+)\s*$")
TARGET = re.compile(r"`\(([^)]+)\)")
LABEL = re.compile(r"^(\.L_x_\d+):")


def find_nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    nvcc = shutil.which("nvcc")
    candidates = [os.path.join(os.path.dirname(nvcc), "nvdisasm")] if nvcc else []
    candidates += glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu*", "bin", "nvdisasm"))
    return next((c for c in candidates if os.access(c, os.X_OK)), None)


class Unreadable(Exception):
    """nvdisasm refused a cubin (missing, truncated, not an ELF): its message, for the FAIL line."""


def functions(nvdisasm, cubin):
    """Per kernel: its instructions as (address, text, highest live register index, labels)."""
    run = subprocess.run([nvdisasm, "-c", "-lrm", "narrow", cubin], capture_output=True, text=True)
    if run.returncode != 0:
        raise Unreadable(run.stderr.strip() or f"nvdisasm exited {run.returncode}")
    text = run.stdout.splitlines()
    result, name, col0, pending = {}, None, None, []
    for line in text:
        if line.startswith("//---") and ".text." in line:
            name = line.split(".text.", 1)[1].split()[0]
            result[name], col0 = [], None
            continue
        if name is None:
            continue
        if "# 0123" in line:  # the life-range table's header: column of R0
            col0 = line.index("# 0123") + 2
            continue
        label = LABEL.match(line)
        if label:
            pending.append(label.group(1))
        m = INSTRUCTION.search(line)
        if not m or col0 is None:
            continue
        gprs = line[col0:line.index("|", col0)] if "|" in line[col0:] else ""
        live = max((i for i, ch in enumerate(gprs) if ch != " "), default=-1)
        result[name].append((int(m.group(1), 16), m.group(2), live, pending))
        pending = []
    return result


def region_live(instrs, start):
    """Highest live register index over the code reachable from instrs[start + 1]."""
    at_label = {lab: i for i, (_, _, _, labels) in enumerate(instrs) for lab in labels}
    seen, stack, highest = set(), [start + 1], -1
    while stack:
        i = stack.pop()
        while i < len(instrs) and i not in seen:
            seen.add(i)
            _, ins, live, _ = instrs[i]
            if "USETMAXREG" in ins:
                break
            highest = max(highest, live)
            guarded = ins.startswith("@")
            op = ins.split()[1 if guarded else 0]
            target = TARGET.search(ins)
            if op.startswith(("BRA", "BRX", "JMP", "CALL")) and target and target.group(1) in at_label:
                stack.append(at_label[target.group(1)])
            if not guarded and op.startswith(("BRA", "BRX", "JMP", "EXIT", "RET")):
                break
            i += 1
    return highest


def serialised(instrs):
    """True when the kernel issues about one WARPGROUP.ARRIVE per warpgroup MMA."""
    mmas = sum(1 for _, ins, _, _ in instrs if re.search(r"\b[HQ]GMMA\.", ins))
    arrives = sum(1 for _, ins, _, _ in instrs if "WARPGROUP.ARRIVE" in ins)
    return mmas >= 8 and 2 * arrives > mmas


def loads_behind_stores(instrs):
    """Shared-memory loads issued after a shared-memory store between a named barrier
    (BAR.SYNC) and the next async-proxy fence (FENCE.VIEW.ASYNC.S), in address order."""
    count, inside, stored = 0, False, False
    for _, ins, _, _ in instrs:
        if ins.startswith("@!PT"):
            continue
        op = ins.split()[1 if ins.startswith("@") else 0]
        if op.startswith("BAR.SYNC"):
            inside, stored = True, False
        elif op.startswith("FENCE.VIEW.ASYNC"):
            inside = False
        elif inside and op.startswith("STS"):
            stored = True
        elif inside and stored and op.startswith("LDS"):
            count += 1
    return count


def check_softmax_order(cubin, short, instrs):
    """The swap kernels' softmax reads every row's maxima before its first P^T store. Chosen by
    the cubin's name, which CMake's list of instantiations fixes, so that renaming a kernel
    cannot turn the check off."""
    if "swap" not in os.path.basename(cubin):
        return True
    behind = loads_behind_stores(instrs)
    if behind:
        print(f"FAIL {os.path.basename(cubin)} {short}: {behind} shared-memory loads after a store between "
              "a named barrier and the P^T fence (the softmax's rows wait on each other's stores: read "
              "every row's maxima first)")
        return False
    print(f"ok   {os.path.basename(cubin)} {short}: the softmax's loads before its stores")
    return True


def check(nvdisasm, cubin, split=True):
    try:
        kernels = functions(nvdisasm, cubin)
    except Unreadable as e:
        print(f"FAIL {cubin}: nvdisasm cannot read it: {e}")
        return False
    if not kernels:  # a kernel gone from its instantiation file must not pass for want of anything to check
        print(f"FAIL {cubin}: no kernel functions in the SASS")
        return False
    ok = True
    for name, instrs in kernels.items():
        splits = [(i, SETMAXREG.search(ins)) for i, (_, ins, _, _) in enumerate(instrs) if "USETMAXREG" in ins]
        kinds = {m.group(1) for _, m in splits if m}
        short = name if len(name) < 70 else name[:67] + "..."
        ok &= check_softmax_order(cubin, short, instrs)
        if not split:
            if serialised(instrs):
                print(f"FAIL {os.path.basename(cubin)} {short}: ptxas serialised its wgmma "
                      "(a WARPGROUP.ARRIVE before about every MMA)")
                ok = False
            else:
                print(f"ok   {os.path.basename(cubin)} {short}: wgmma pipelined (no register split to check)")
            continue
        if kinds != {"TRY_ALLOC", "DEALLOC"}:
            print(f"FAIL {os.path.basename(cubin)} {short}: no register split in the SASS "
                  f"(found {sorted(kinds) or 'none'}): ptxas dropped setmaxnreg, a region needs more than its share")
            ok = False
            continue
        if serialised(instrs):
            print(f"FAIL {os.path.basename(cubin)} {short}: ptxas serialised its wgmma "
                  "(a WARPGROUP.ARRIVE before about every MMA)")
            ok = False
        for i, m in splits:
            limit, live = int(m.group(2), 16), region_live(instrs, i)
            verdict = "ok  " if live < limit else "FAIL"
            ok &= live < limit
            print(f"{verdict} {os.path.basename(cubin)} {short}: {m.group(1)} {limit} registers, "
                  f"highest live R{live}")
    return ok


def main(argv):
    if len(argv) < 2:
        print(__doc__)
        return 2
    args = argv[1:]
    cut = args.index("--unsplit") if "--unsplit" in args else len(args)
    split, unsplit = args[:cut], args[cut + 1:]
    if not split and not unsplit:  # checking nothing must not pass (an empty cubin list in the ctest)
        print("check_register_split.py: no cubins given", file=sys.stderr)
        return 2
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        print("skipped: no nvdisasm (CUDA toolkit, or pip install nvidia-cuda-nvdisasm)")
        return SKIP
    results = [check(nvdisasm, cubin) for cubin in split]
    results += [check(nvdisasm, cubin, split=False) for cubin in unsplit]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
