"""Host time of one eager decode attention call: what the piecewise path pays per layer.

Between piecewise graphs the attention runs eagerly, once per layer per decode step, so
its host time (the call, from entry to return, the GPU left running) adds up on a
host-bound decode step. This times the forms cgcompile could call for the grouped-query
decode attention of `passes.sdpa.grouped_query_attention` (q [B, KV, G, D] over k/v
[B, KV, L, D], no mask) and, for scale, the cache append a DynamicCache makes per layer:

    sdpa            F.scaled_dot_product_attention (backend chosen per call), cuDNN off,
                    as cgcompile runs its eager pieces
    sdpa_gqa        the same attention as transformers' sdpa_attention_forward calls it:
                    q [B, KV*G, 1, D], enable_gqa=True (what the breakable path runs)
    flash_op        torch.ops.aten._scaled_dot_product_flash_attention: the kernel SDPA
                    picks here, without the choosing
    efficient_op    torch.ops.aten._scaled_dot_product_efficient_attention
    cat             torch.cat of a [B, KV, L, D] cache and one new position

Each form: 200 calls timed on the host after a synchronise (the launch queue never fills),
median of 15 repeats, microseconds per call; outputs compared with sdpa's.

    python benchmarks/sdpa_host_probe.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import harness


def forms(q, k, v):
    def sdpa():
        return F.scaled_dot_product_attention(q, k, v)

    heads = q.view(q.shape[0], -1, 1, q.shape[-1])  # [B, KV*G, 1, D]: one row per query head

    def sdpa_gqa():
        return F.scaled_dot_product_attention(heads, k, v, enable_gqa=True).view(q.shape)

    def flash_op():
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[0]

    def efficient_op():
        return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, False)[0]

    new = k[:, :, :1]

    def cat():
        return torch.cat([k, new], dim=-2)

    return {"sdpa": sdpa, "sdpa_gqa": sdpa_gqa, "flash_op": flash_op, "efficient_op": efficient_op, "cat": cat}


def host_us(fn, calls: int = 200, repeats: int = 15) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)
    print(harness.environment("cuda"))
    names = ("sdpa", "sdpa_gqa", "flash_op", "efficient_op", "cat")
    print(f"{'B':>3} {'L':>5} " + " ".join(f"{name:>13}" for name in names))
    for batch in (1, 8):
        for length in (256, 1024):
            q = torch.randn(batch, 8, 4, 64, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(batch, 8, length, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            calls = forms(q, k, v)
            reference = calls["sdpa"]()
            for name in ("sdpa_gqa", "flash_op", "efficient_op"):
                torch.testing.assert_close(calls[name](), reference, rtol=2e-2, atol=2e-2)
            times = {name: host_us(fn) for name, fn in calls.items()}
            print(f"{batch:>3} {length:>5} " + " ".join(f"{times[n]:>13.1f}" for n in times))


if __name__ == "__main__":
    main()
