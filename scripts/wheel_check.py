# The installed wheel on torch CUDA tensors against a dense torch reference (run it from outside
# the checkout, so that the installed package is the one imported): one plan and run of the
# engine API over a paged bf16 cache, write_kv included; prints the worst relative L2 error.
import torch

import dcpmla

print("dcpmla", dcpmla.__version__, "cuda", dcpmla.cuda_available, dcpmla.cuda_architectures, "from", dcpmla.__file__)
H, D, R, L, QLEN = 16, 576, 512, 300, 2
att = dcpmla.Attention(heads=H, kv_dtype="bf16", block_size=64, max_batch=2, max_qlen=QLEN, max_local_len=1024,
                       device="cuda")
cache = torch.full((8, 64, D), float("nan"), dtype=torch.bfloat16, device="cuda")
lat = torch.randn(L, D, device="cuda").to(torch.bfloat16)
table = [[5, 2, 7, 0, 1], [3, 4, 6, 0, 0]]
slots = torch.tensor([table[0][p // 64] * 64 + p % 64 for p in range(L)], dtype=torch.int64, device="cuda")
dcpmla.write_kv(cache, lat, slots)
att.plan([L, 0], table, QLEN, mode="verify")
q = torch.randn(2, QLEN, H, D, device="cuda").to(torch.bfloat16)
out, lse = att.run(q, cache)
torch.cuda.synchronize()
k = lat.double()
worst = 0.0
for t in range(QLEN):
    w = L - QLEN + t + 1
    s = (q[0, t].double() @ k[:w].T) * D ** -0.5
    ref = torch.softmax(s, dim=-1) @ k[:w, :R]
    worst = max(worst, float((out[0, t].double() - ref).norm() / ref.norm()))
assert worst < 1e-2, worst
assert torch.all(torch.isneginf(lse[1])) and torch.all(out[1] == 0)
print("wheel engine check: worst rel L2", worst)
