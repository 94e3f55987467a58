import torch, torch.nn.functional as F, triton.testing as tt
from torch.nn.attention import sdpa_kernel, SDPBackend
q = torch.randn(1, 16, 8649, 64, device="cuda", dtype=torch.bfloat16)
k, v = torch.randn_like(q), torch.randn_like(q)
base = torch.randn(8649, 3, 16, 64, device="cuda", dtype=torch.bfloat16)
qs, ks, vs = (base[:, i].transpose(0, 1)[None] for i in range(3))
for name, b in [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
    for lay, (a, bb, c) in [("contig", (q, k, v)), ("strided", (qs, ks, vs))]:
        try:
            with sdpa_kernel(b):
                ms = tt.do_bench(lambda: F.scaled_dot_product_attention(a, bb, c), rep=200)
            print(f"sdpa {name} {lay}: {ms:.3f} ms")
        except Exception as e:
            print(name, lay, "failed", str(e)[:100])
