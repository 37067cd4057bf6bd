"""Speculative decoding on a DeepSeek-V3-shaped MLA stack with DCP, through dcpmla's engine API.

A few MLA layers with random weights (128 heads; q/k nope 128 + rope 64 per head, latent
kv_lora_rank 512 + rope 64; the absorbed form: q_nope is folded through W_UK into the latent
space and the latent output through W_UV), a greedy decode loop that verifies k = 3 draft tokens
per step (qlen = 4, mode "verify"), and decode context parallelism over N ranks: N
dcpmla.Attention objects, each holding its own cache shard per layer, their partials merged with
dcpmla.merge_states. The ranks share one device here (a real deployment puts one per GPU and
all-gathers the partials). Every step is checked against a plain dense PyTorch implementation of
the same model (no cache, no absorption, the whole sequence recomputed in float32), and both
report tokens/s.

    python examples/speculative_decode.py                  # CPU, small sizes
    python examples/speculative_decode.py --device cuda    # GPU, larger sizes

Positions carry no rotary embedding (random weights; RoPE changes nothing the library sees).
Exits 1 if any step's logits differ from the dense model's by more than --tolerance.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
import torch

import dcpmla

R, P, NOPE, V = 512, 64, 128, 128  # kv_lora_rank, rope dim, q/k nope dim, v head dim (DeepSeek-V3)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--layers", type=int, help="MLA layers (default 2 on cpu, 4 on cuda)")
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--hidden", type=int, help="model width (default 256 on cpu, 2048 on cuda)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--ranks", type=int, help="DCP world size N (default 2 on cpu, 4 on cuda)")
    p.add_argument("--batch", type=int, help="requests (default 2 on cpu, 8 on cuda)")
    p.add_argument("--prompt", type=int, help="prompt length (default 96 on cpu, 1024 on cuda)")
    p.add_argument("--steps", type=int, default=6, help="decode steps")
    p.add_argument("--k", type=int, default=3, help="draft tokens verified per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=3e-2, help="max relative L2 error of each step's logits")
    a = p.parse_args(argv)
    gpu = a.device == "cuda"
    for name, cpu, cuda in [("layers", 2, 4), ("hidden", 256, 2048), ("ranks", 2, 4), ("batch", 2, 8),
                            ("prompt", 96, 1024)]:
        if getattr(a, name) is None:
            setattr(a, name, cuda if gpu else cpu)
    return a


class Model:
    """Random DeepSeek-V3-shaped MLA weights (float32) and the two ways to run them."""

    def __init__(self, a, device):
        g = torch.Generator().manual_seed(a.seed)
        w = lambda *shape, fan: (torch.randn(*shape, generator=g) / math.sqrt(fan)).to(device)  # noqa: E731
        H, d = a.heads, a.hidden
        self.a, self.device = a, device
        self.embed = w(a.vocab, d, fan=1)
        self.layers = [dict(wq=w(d, H * (NOPE + P), fan=d), wkv=w(d, R, fan=d), wkr=w(d, P, fan=d),
                            wuk=w(H, NOPE, R, fan=R), wuv=w(H, R, V, fan=R), wo=w(H * V, d, fan=H * V))
                       for _ in range(a.layers)]
        self.head = w(d, a.vocab, fan=d)
        self.scale = (NOPE + P) ** -0.5  # DeepSeek-V3's softmax scale (q/k head dim 192)

    @staticmethod
    def norm(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def project(self, layer, x):
        """x [..., d] -> queries (nope [..., H, 128], rope [..., H, 64]) and the latent [..., 576]."""
        h = self.norm(x)
        q = (h @ layer["wq"]).unflatten(-1, (self.a.heads, NOPE + P))
        latent = torch.cat([h @ layer["wkv"], h @ layer["wkr"]], -1)
        return q[..., :NOPE], q[..., NOPE:], latent.to(torch.bfloat16).float()  # the cache holds bf16

    def dense(self, tokens, latents=None):
        """The plain model over whole sequences: tokens [B, L] (equal lengths) -> logits [B, L, vocab].
        Each layer's latents [B, L, 576] are appended to `latents` when given (prefill)."""
        x = self.embed[tokens]
        L = tokens.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=self.device).tril()
        for layer in self.layers:
            q_nope, q_pe, latent = self.project(layer, x)
            if latents is not None:
                latents.append(latent)
            c, k_pe = latent[..., :R], latent[..., R:]
            k_nope = torch.einsum("blr,hnr->blhn", c, layer["wuk"])          # keys per head [B, L, H, 128]
            v = torch.einsum("blr,hrv->blhv", c, layer["wuv"])               # values per head
            s = (torch.einsum("bthn,blhn->bhtl", q_nope, k_nope) +
                 torch.einsum("bthp,blp->bhtl", q_pe, k_pe)) * self.scale
            p = s.masked_fill(~causal, float("-inf")).softmax(-1)
            o = torch.einsum("bhtl,blhv->bthv", p, v)
            x = x + o.flatten(-2) @ layer["wo"]
        return self.norm(x) @ self.head


class DcpEngine:
    """The serving side: per rank an Attention, per (rank, layer) a cache shard; shared block tables."""

    def __init__(self, model, a, device, max_len):
        self.model, self.a, self.device = model, a, device
        N, bs = a.ranks, a.block_size
        local = dcpmla.local_length(max_len, N, 0)  # rank 0 holds the most of any window
        self.width = -(-local // bs)
        self.num_blocks = a.batch * self.width
        rng = np.random.default_rng(a.seed)
        self.tables = rng.permutation(self.num_blocks).reshape(a.batch, self.width).astype(np.int32)
        self.atts = [dcpmla.Attention(heads=a.heads, block_size=bs, world_size=N, rank=r, max_batch=a.batch,
                                      max_qlen=a.k + 1, max_local_len=local, softmax_scale=model.scale,
                                      device=device) for r in range(N)]
        self.caches = [[torch.empty((self.num_blocks, bs, R + P), dtype=torch.bfloat16, device=device)
                        for _ in model.layers] for _ in range(N)]

    def slots(self, starts, count):
        """Each rank's slots for positions [start_b, start_b + count) of every request: [N, B * count]."""
        out = []
        for r in range(self.a.ranks):
            s = [dcpmla.slot_mapping(np.arange(st, st + count), self.tables[b], self.a.block_size, self.num_blocks,
                                     self.a.ranks, r) for b, st in enumerate(starts)]
            out.append(torch.from_numpy(np.concatenate(s)).to(self.device))
        return out

    def prefill(self, prompts):
        """Writes every prompt's latents, layer by layer, as the dense model computes them (prefill
        is not this library's job); prompts [B, L0] of equal length."""
        slots = self.slots([0] * prompts.shape[0], prompts.shape[1])
        latents = []
        self.model.dense(prompts, latents)
        for li, latent in enumerate(latents):
            for r in range(self.a.ranks):
                dcpmla.write_kv(self.caches[r][li], latent.flatten(0, 1).to(torch.bfloat16), slots[r])

    def verify(self, block, lengths):
        """One step: block [B, qlen] tokens at positions [L_b, L_b + qlen); returns logits [B, qlen, vocab]."""
        m, qlen = self.model, block.shape[1]
        seq_lens = np.array(lengths, dtype=np.int32) + qlen  # incl. the query block
        for att in self.atts:
            att.plan(seq_lens, self.tables, qlen, mode="verify")  # once per step, for every layer
        slots = self.slots(lengths, qlen)
        x = m.embed[block]
        for li, layer in enumerate(m.layers):
            q_nope, q_pe, latent = m.project(layer, x)
            q = torch.cat([torch.einsum("bthn,hnr->bthr", q_nope, layer["wuk"]), q_pe], -1).to(torch.bfloat16)
            parts, lses = [], []
            for r, att in enumerate(self.atts):
                dcpmla.write_kv(self.caches[r][li], latent.flatten(0, 1).to(torch.bfloat16), slots[r])
                o, lse = att.run(q, self.caches[r][li])  # this rank's partial
                parts.append(o)
                lses.append(lse)
            o, _ = dcpmla.merge_states(torch.stack(parts), torch.stack(lses))  # [B, qlen, H, 512]
            x = x + torch.einsum("bthr,hrv->bthv", o.float(), layer["wuv"]).flatten(-2) @ layer["wo"]
        return m.norm(x) @ m.head


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv=None):
    a = parse_args(argv)
    if a.device == "cuda" and not (dcpmla.cuda_available and torch.cuda.is_available()):
        print("speculative_decode: --device cuda needs the CUDA backend (dcpmla.cuda_available) and a GPU")
        return 3
    torch.manual_seed(a.seed)
    device = a.device
    model = Model(a, device)
    max_len = a.prompt + a.steps * (a.k + 1) + a.k + 1
    engine = DcpEngine(model, a, device, max_len)
    # Equal prompt lengths keep the dense reference a plain batched forward; requests then advance
    # by their own accepted counts, so their lengths diverge.
    seqs = torch.randint(0, a.vocab, (a.batch, a.prompt), device=device)
    engine.prefill(seqs)
    history = [list(s) for s in seqs.tolist()]
    draft_next = torch.randint(0, a.vocab, (a.vocab,), generator=torch.Generator().manual_seed(a.seed + 1))
    # Each request's next verify block starts with its last sampled token (not yet in the cache).
    pending = [int(model.dense(seqs[b:b + 1])[0, -1].argmax()) for b in range(a.batch)]
    t_dcp = t_dense = 0.0
    tokens = 0
    worst = 0.0
    for step in range(a.steps):
        lengths = [len(h) for h in history]  # tokens in the cache
        block = []
        for b in range(a.batch):  # the draft: k tokens from a bigram table of seen transitions
            toks = [pending[b]]
            for _ in range(a.k):
                toks.append(int(draft_next[toks[-1]]))
            block.append(toks)
        block = torch.tensor(block, device=device)
        sync(device)
        t0 = time.perf_counter()
        logits = engine.verify(block, lengths)
        sync(device)
        t_dcp += time.perf_counter() - t0
        t0 = time.perf_counter()
        for b in range(a.batch):  # the dense model on each request's whole sequence
            full = torch.tensor(history[b] + block[b].tolist(), device=device)[None]
            want = model.dense(full)[0, -(a.k + 1):]
            err = float((logits[b] - want).norm() / want.norm())
            worst = max(worst, err)
        sync(device)
        t_dense += time.perf_counter() - t0
        target = logits.argmax(-1).tolist()  # greedy target token after each row
        accepted = []
        for b in range(a.batch):
            n = 0
            while n < a.k and block[b, n + 1].item() == target[b][n]:
                n += 1
            history[b] += block[b, :n + 1].tolist()  # the pending token and the accepted drafts
            pending[b] = target[b][n]                # the bonus token starts the next block
            for i in range(n + 1):                   # the draft learns the transitions it saw
                draft_next[block[b, i]] = target[b][i]
            accepted.append(n)
            tokens += n + 1
        print(f"step {step}: lengths {lengths}, accepted drafts {accepted}, worst logits rel err {worst:.2e}")
    print(f"dcpmla ({a.ranks} ranks, {a.layers} layers, {a.heads} heads, {a.device}): "
          f"{tokens / t_dcp:.1f} tokens/s")
    print(f"dense PyTorch reference: {tokens / t_dense:.1f} tokens/s")
    if not worst <= a.tolerance:
        print(f"FAILED: logits differ from the dense model by {worst:.3g} > {a.tolerance}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
