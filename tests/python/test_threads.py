"""Calls racing another Python thread that writes their arrays or replans their object. The
native calls release the GIL while they compute, so a second thread can change what they read:
what was checked must be what is used (never a write past the cache or the tables), and a
shared Attention names only arguments the caller passed. Each race runs in a child process, so
that a crash fails its test instead of the session."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SECONDS = 1.5


def race(body):
    script = textwrap.dedent("""
        import threading, time
        import numpy as np
        import dcpmla
        stop = False
        def forever(step):
            def loop():
                while not stop:
                    step()
            t = threading.Thread(target=loop)
            t.start()
            return t
        def until(seconds, call):
            global stop
            t0 = time.time()
            try:
                while time.time() - t0 < seconds:
                    call()
            finally:
                stop = True
        counts = {"ok": 0, "refused": 0}
        # step(), counted as ok, or as refused where it raises a ValueError whose message
        # refused(message) accepts (any other refusal fails the race).
        def counted(step, refused):
            def call():
                try:
                    step()
                    counts["ok"] += 1
                except ValueError as e:
                    assert refused(str(e)), e
                    counts["refused"] += 1
            return call
    """) + textwrap.dedent(body).replace("SECONDS", str(SECONDS))
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_write_kv_never_writes_past_the_cache_when_a_slot_changes_under_it():
    """A slot flipped between a valid one and 2^40 while write_kv runs: each call is refused by
    name or writes within the cache (it segfaulted: the slots were checked, then read again)."""
    out = race("""
        cache = np.zeros((4096, 16, 576), np.uint16)
        latent = np.ones((60000, 576), np.uint16)
        slots = np.arange(60000, dtype=np.int64)
        def flip():
            slots[-1] = 1 << 40
            slots[-1] = 59999
        t = forever(flip)
        until(SECONDS, counted(lambda: dcpmla.write_kv(cache, latent, slots), lambda m: "slot_mapping[59999]" in m))
        t.join()
        assert counts["ok"] + counts["refused"] > 0
        print(counts)
    """)
    assert "ok" in out


def test_mla_attention_uses_the_lengths_it_checked():
    """seq_lens[3] flipped between 64 and 256 (both valid) during mla_attention: every answer is
    the answer of one of the two (it corrupted the heap: the lengths were checked, then read
    again to size and fill the tables)."""
    out = race("""
        rng = np.random.default_rng(0)
        q = rng.standard_normal((4, 1, 4, 576)).astype(np.float32)
        kv = rng.standard_normal((4, 256, 576)).astype(np.float32)
        run = lambda lens: dcpmla.mla_attention(q, kv, lens, mode="decode", world_size=2, block_size=16)
        refs = [run(np.array([200, 200, 200, n], np.int32)) for n in (64, 256)]
        seq = np.array([200, 200, 200, 64], np.int32)
        def flip():
            seq[3] = 256
            seq[3] = 64
        t = forever(flip)
        calls = [0]
        def call():
            o, l = run(seq)
            assert any(np.array_equal(o, r[0]) and np.array_equal(l, r[1]) for r in refs), "a mix of two batches"
            calls[0] += 1
        until(SECONDS, call)
        t.join()
        print("calls", calls[0])
    """)
    assert "calls" in out


def test_a_shared_attention_names_only_arguments_the_caller_passed():
    """One Attention replanned by another thread between two batch shapes while run(q, cache)
    allocates its outputs: a refusal may name q (it does not fit the plan current when the run
    takes it), never out or lse, which the caller did not pass (they were sized from a plan
    read before the run took the object)."""
    out = race("""
        att = dcpmla.Attention(heads=2, block_size=16, device="cpu", max_batch=16, max_qlen=4, max_local_len=1024)
        cache = np.zeros((64, 16, 576), np.uint16)
        plans = [(np.array([16], np.int32), np.zeros((1, 1), np.int32), 1),
                 (np.full(4, 16, np.int32), np.zeros((4, 1), np.int32), 4)]
        qs = [np.zeros((1, 1, 2, 576), np.float32), np.zeros((4, 4, 2, 576), np.float32)]
        def replan():
            att.plan(*plans[0])
            att.plan(*plans[1])
        att.plan(*plans[0])
        t = forever(replan)
        named = set()
        def call():
            for q in qs:
                try:
                    att.run(q, cache)
                except ValueError as e:
                    named.add(str(e).split("'")[1].split(".")[0])
        until(SECONDS, call)
        t.join()
        assert named <= {"q"}, named
        print("named", sorted(named))
    """)
    assert "named" in out



# The plan() races below: its arrays are the first row of a bf16 cache, viewed as int32, which
# another thread rewrites through write_kv (a call that releases the GIL) between a valid value
# and one far past the limits, K rows written elsewhere between each flip.
PLAN_RACE = """
    D = 576
    shared = np.zeros((64, 16, D), np.uint16)
    def flips(good, bad, K=20):
        rows, slots = [], []
        for _ in range(200):
            rows += [good] + [good] * K + [bad] + [good] * K
            slots += [0] + list(range(16, 16 + K)) + [0] + list(range(16, 16 + K))
        rows.append(good)
        slots.append(0)
        return np.stack(rows), np.array(slots, np.int64)
    att = dcpmla.Attention(heads=1, block_size=16, device="cpu", max_batch=512, max_qlen=1, max_local_len=4096)
"""


def plan_race(body):
    return textwrap.dedent(PLAN_RACE) + textwrap.dedent(body)


def test_plan_uses_the_block_ids_it_checked():
    """A table entry flipped between block 0 and 2^20 while plan() runs: every plan holds the ids
    it checked, so run() on a one-block cache either runs or is refused by name (run() read
    2^20 blocks past the cache: the planner checked the table, then read it again to copy it)."""
    out = race(plan_race("""
        tables = shared.reshape(-1)[:D].view(np.int32).reshape(D // 2, 1)
        good = np.zeros(D, np.uint16)
        bad = np.tile(np.array([0, 0x0010], np.uint16), D // 2)  # int32 entries 2^20
        latent, slots = flips(good, bad)
        t = forever(lambda: dcpmla.write_kv(shared, latent, slots))
        cache = np.zeros((1, 16, D), np.uint16)
        q = np.ones((D // 2, 1, 1, D), np.float32)
        lens = np.full(D // 2, 16, np.int32)
        def step():
            att.plan(lens, tables, 1, "decode")
            att.run(q, cache)
        until(SECONDS, counted(step, lambda m: "block_tables[" in m or "'kv_cache num_blocks' = 1" in m))
        t.join()
        assert counts["ok"] + counts["refused"] > 0
        print(counts)
    """))
    assert "ok" in out


def test_plan_uses_the_lengths_it_checked():
    """seq_lens flipped between 16 and 2^20 + 16 while plan() runs: every plan is of lengths it
    checked (plan() read past the table row and wrote past its sub-page table: the lengths were
    checked, then read again to size the rows and the table copy)."""
    out = race(plan_race("""
        lens = shared.reshape(-1)[:D].view(np.int32)
        good = np.tile(np.array([16, 0], np.uint16), D // 2)
        bad = np.tile(np.array([16, 0x0010], np.uint16), D // 2)  # int32 lengths 2^20 + 16
        shared.reshape(-1, D)[0] = good
        latent, slots = flips(good, bad)
        t = forever(lambda: dcpmla.write_kv(shared, latent, slots))
        tables = np.zeros((D // 2, 1), np.int32)
        until(SECONDS, counted(lambda: att.plan(lens, tables, 1, "decode"), lambda m: "seq_lens[" in m))
        t.join()
        assert counts["ok"] + counts["refused"] > 0
        print(counts)
    """))
    assert "ok" in out


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
