"""Decode attention over a static cache: which formulation is fastest inside a CUDA graph.

q [B, KV, G, D] (G query heads per kv head), k/v [B, KV, L, D], a [1, 1, 1, L] bool mask.
Each form is compiled by Inductor (static shapes), 16 calls captured in one CUDA graph
(16 layers), the graph replayed and timed with CUDA events; error against fp64 math.
"""

import sys

import torch
import torch.nn.functional as F


def sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def bmm_fp32_softmax(q, k, v, mask):
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)


def reduction_fp32(q, k, v, mask):
    scores = (q.float().unsqueeze(-2) * k.float().unsqueeze(-3)).sum(-1) * q.shape[-1] ** -0.5  # [B, KV, G, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs.unsqueeze(-1) * v.float().unsqueeze(-3)).sum(-2).to(v.dtype)


def math_backend(q, k, v, mask):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def reference(q, k, v, mask):
    s = (q.double() @ k.double().transpose(-2, -1)) * q.shape[-1] ** -0.5
    return (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v.double())


def time_graph(fn, args, layers=16, reps=50):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(layers):
            out = fn(*args)
    for _ in range(5):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / layers * 1000, out


def main():
    torch.backends.cuda.enable_cudnn_sdp(False)
    for name, kv, g, d in (("1b", 8, 2, 128), ("8b", 8, 4, 128)):
        for b in (1, 8):
            for length in (384, 1024):
                q = torch.randn(b, kv, g, d, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(b, kv, length, d, device="cuda", dtype=torch.bfloat16)
                v = torch.randn(b, kv, length, d, device="cuda", dtype=torch.bfloat16)
                mask = (torch.arange(length, device="cuda") <= length * 2 // 3).view(1, 1, 1, -1)
                ref = reference(q, k, v, mask)
                row = []
                for form in (sdpa, bmm_fp32_softmax, reduction_fp32, math_backend):
                    fn = torch.compile(form, dynamic=False) if form is not sdpa else form
                    try:
                        us, out = time_graph(fn, (q, k, v, mask))
                        err = (out.double() - ref).abs().max().item()
                        row.append(f"{form.__name__} {us:6.1f}us err {err:.1e}")
                    except Exception as e:
                        row.append(f"{form.__name__} failed {type(e).__name__}: {str(e)[:80]}")
                print(f"{name} B={b} L={length}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())
