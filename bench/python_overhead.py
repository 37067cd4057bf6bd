"""Host time of the Python engine API per call: what an engine pays on its own thread for each
plan() (once a step) and each run() / write_kv() (once a layer), beside the GPU's time.

Each call is timed alone on the host (time.perf_counter around it). On CUDA the calls go in
batches of 100 behind a spin kernel longer than the batch (nothing waits for the GPU or for a
full launch queue), so the figures are the Python layer, the native checks and the launches.
For comparison: the native call alone with the same prepared arguments (what the Python layer
adds is the difference), the pieces the Python layer runs per call, the torch custom op
(``dcpmla.torch_ops``) and a CUDA graph's replay.

    PYTHONPATH=python python3 bench/python_overhead.py [--device cuda|cpu] [--calls N] [--json F]

Prints a table; --json writes the rows with the run's metadata (strict JSON, bench/results).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

import dcpmla
from dcpmla import _engine


def per_call_us(fn, calls, hold=None, warmup=50, batch=100):
    """Median and 10th percentile of `calls` host times of fn(), in µs. hold(), when given, runs
    before each batch of calls: on CUDA it waits for the GPU and queues a spin kernel longer than
    the batch, so that no call waits for a full launch queue (the time is the host's alone)."""
    for _ in range(warmup):
        fn()
    times = []
    clock = time.perf_counter
    for i in range(calls):
        if hold is not None and i % batch == 0:
            hold()
        t0 = clock()
        fn()
        times.append(clock() - t0)
    times.sort()
    return statistics.median(times) * 1e6, times[len(times) // 10] * 1e6


def cpu_model():
    """The host CPU's model name (what these times depend on), from /proc/cpuinfo where it exists."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def package_where():
    """Which dcpmla layer ran (the A/B runs put another tree's on PYTHONPATH): its folder relative
    to this checkout, or "installed" outside it, so that a record names no path of the machine."""
    package = os.path.dirname(os.path.abspath(dcpmla.__file__))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.relpath(package, root) if os.path.commonpath([package, root]) == root else "installed"


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per row (default 2000)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--json", help="write the rows and their metadata here")
    args = ap.parse_args()
    if args.calls < 10:
        ap.error("--calls must be at least 10")
    cuda = args.device == "cuda"
    try:
        import torch  # the CUDA rows take torch tensors, as engines pass them; on the CPU, the torch rows
    except ImportError:
        if cuda:
            raise
        torch = None  # the CPU rows alone
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: nothing to time (use --device cpu)")
        return 77

    H, D, R, bs = args.heads, 576, 512, 64
    rng = np.random.default_rng(20261207)
    rows = []

    hold = None
    if cuda:
        def hold():
            torch.cuda.synchronize()
            torch.cuda._sleep(40_000_000)  # about 20 ms at 2 GHz, past any 100 calls' host time

    def row(name, fn, what, calls=args.calls, queued=True):
        med, p10 = per_call_us(fn, calls, hold if queued else None)
        rows.append({"name": name, "us": med, "us_p10": p10, "calls": calls, "what": what})
        print(f"  {name:34s} {med:8.2f} µs  (p10 {p10:7.2f})  {what}")

    # plan(): host work over the batch and its tables, at a few batch sizes (the step's cost).
    print(f"dcpmla {args.device}: host µs per call (median of {args.calls})")
    for B, ctx in ((1, 4096), (32, 4096), (128, 4096), (256, 16384)):
        att = dcpmla.Attention(heads=H, block_size=bs, max_batch=B, max_qlen=4, max_local_len=ctx,
                               device=args.device)
        width = ctx // bs
        tables = rng.permutation(B * width).astype(np.int32).reshape(B, width)
        lens = np.full(B, ctx, np.int32)
        row(f"plan_b{B}_c{ctx}", lambda: att.plan(lens, tables, 1, mode="decode"),
            f"Attention.plan, {B} requests of {ctx} tokens, decode", calls=min(args.calls, 500), queued=False)

    # run() and the rest over a small step (4 requests of 256 tokens): the GPU keeps up.
    B, ctx, blocks = 4, 256, 64
    att = dcpmla.Attention(heads=H, block_size=bs, max_batch=B, max_qlen=1, max_local_len=ctx, device=args.device)
    tables = rng.permutation(blocks)[: B * (ctx // bs)].astype(np.int32).reshape(B, ctx // bs)
    att.plan(np.full(B, ctx, np.int32), tables, 1, mode="decode")
    if cuda:
        dev = torch.device("cuda")
        q = torch.randn(B, 1, H, D, device=dev).to(torch.bfloat16)
        cache = torch.randn(blocks, bs, D, device=dev).to(torch.bfloat16)
        out = torch.empty(B, 1, H, R, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(B, 1, H, device=dev, dtype=torch.float32)
        latent = torch.randn(B, D, device=dev).to(torch.bfloat16)
        slots = torch.arange(B, device=dev, dtype=torch.int64) * 7
        parts = torch.randn(2, B, 1, H, R, device=dev).to(torch.bfloat16)
        lse_parts = torch.randn(2, B, 1, H, device=dev)
        stream = torch.cuda.current_stream().cuda_stream
        sync = torch.cuda.synchronize
    else:
        q = rng.standard_normal((B, 1, H, D), dtype=np.float32)
        cache = (rng.standard_normal((blocks, bs, D), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        out = np.empty((B, 1, H, R), np.float32)
        lse = np.empty((B, 1, H), np.float32)
        latent = rng.standard_normal((B, D), dtype=np.float32)
        slots = np.arange(B, dtype=np.int64) * 7
        parts = rng.standard_normal((2, B, 1, H, R), dtype=np.float32)
        lse_parts = rng.standard_normal((2, B, 1, H), dtype=np.float32)
        stream = 0
        sync = lambda: None  # noqa: E731

    row("run", lambda: att.run(q, cache, out=out, lse=lse), "Attention.run, out and lse given")
    row("run_alloc", lambda: att.run(q, cache), "Attention.run, out and lse allocated")
    native = att._native
    row("run_native", lambda: native.run(q, cache, 1.0, None, out, lse, stream),
        "the native run alone (no Python checks), same arguments")
    row("write_kv", lambda: dcpmla.write_kv(cache, latent, slots), f"write_kv of {B} tokens")
    row("merge_states", lambda: dcpmla.merge_states(parts, lse_parts), "merge_states of 2 partials (allocating)")
    # The Python layer's pieces, per call.
    row("piece_stream", lambda: _engine._stream(None, q, att._cuda_index), "the stream a call runs on")
    row("piece_tensor_q", lambda: _engine._tensor("q", q, stream if cuda else None, _engine._VALUES),
        "one tensor argument's checks (q)")
    if torch is not None:
        # The torch ops (dcpmla.torch_ops) beside the plain calls on the same torch tensors (on
        # the CPU: views of the numpy arrays above): the difference is torch's dispatch.
        from dcpmla import torch_ops
        as_torch = (lambda a: a) if cuda else torch.from_numpy
        t_cache, t_latent, t_slots, t_parts, t_lse_parts = map(as_torch, (cache, latent, slots, parts, lse_parts))
        if not cuda:  # on CUDA the write_kv and merge_states rows above take torch tensors already
            row("torch_write_kv", lambda: dcpmla.write_kv(t_cache, t_latent, t_slots),
                f"write_kv of {B} tokens, torch tensors")
            row("torch_merge_states", lambda: dcpmla.merge_states(t_parts, t_lse_parts),
                "merge_states of 2 partials, torch tensors")
        row("torch_op_write_kv", lambda: torch_ops.write_kv(t_cache, t_latent, t_slots),
            f"torch.ops.dcpmla.write_kv (custom op) of {B} tokens")
        row("torch_op_merge_states", lambda: torch_ops.merge_states(t_parts, t_lse_parts),
            "torch.ops.dcpmla.merge_states (custom op) of 2 partials")
    if cuda:
        row("torch_op_run", lambda: torch_ops.run(att, q, cache, out=out, lse=lse),
            "torch.ops.dcpmla.run (custom op), out and lse given")
        row("piece_cuda_index", lambda: _engine._cuda_index("kv_cache", cache),
            "the device of a torch tensor argument (write_kv, merge_states)")
        row("torch_dlpack_q", lambda: q.__dlpack__(), "a torch tensor's __dlpack__() alone")
        row("piece_import_q", lambda: dcpmla._dcpmla._imports(q), "the native import of one torch tensor (q)")
        to_dlpack = getattr(torch._C, "_to_dlpack", None)
        if to_dlpack is not None:
            row("torch_c_to_dlpack", lambda: to_dlpack(q), "torch._C._to_dlpack alone")
            row("piece_import_capsule", lambda: dcpmla._dcpmla._imports(to_dlpack(q)),
                "the native import of q's capsule from torch._C._to_dlpack")
        raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw_stream is not None:
            row("torch_raw_stream", lambda: raw_stream(0), "torch._C._cuda_getCurrentRawStream alone")
        # A CUDA graph of one run (plan outside, replay per step).
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            att.run(q, cache, out=out, lse=lse)  # warm up on the capture stream
            s.synchronize()
            with torch.cuda.graph(g, stream=s):
                att.run(q, cache, out=out, lse=lse)
        torch.cuda.current_stream().wait_stream(s)
        row("graph_replay", g.replay, "CUDAGraph.replay of one captured run")
        # Back to back: the wall time per run, the larger of its host time and its GPU time.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync()
        start.record()
        for _ in range(200):
            att.run(q, cache, out=out, lse=lse)
        end.record()
        sync()
        rows.append({"name": "run_loop_wall", "us": start.elapsed_time(end) * 1e3 / 200, "us_p10": None,
                     "calls": 200, "what": "200 runs back to back: wall per call (max of host and GPU)"})
        print(f"  {'run_loop_wall':34s} {rows[-1]['us']:8.2f} µs  200 runs back to back (max of host and GPU)")
    sync()

    if args.json:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit(),
            "command": " ".join(["python_overhead.py"] + [a if not a.endswith(".json") else os.path.basename(a)
                                                          for a in sys.argv[1:]]),
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "clocks": {},  # host times: the GPU's clocks do not enter them
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "torch": torch.__version__ if torch is not None else None,
            "torch_dlpack_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__") if torch is not None else None,
            "dcpmla_package": package_where(),
            "shape": {"heads": H, "run_batch": B, "run_context": ctx, "block_size": bs},
        }
        for r in rows:  # strict JSON: no inf or nan
            for k, v in r.items():
                if isinstance(v, float) and not math.isfinite(v):
                    r[k] = None
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1, allow_nan=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
