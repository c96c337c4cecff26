"""The SiLU-gated skinny linear kernel under Triton's interpreter, on the CPU (run by
tests/kernels/test_silu_mul_linear.py with TRITON_INTERPRET=1): masked and unmasked K, a
partial last block, bias or none, gate and up as two halves of one row, against eager."""

import os

import torch
import torch.nn.functional as F

from cgcompile.kernels.silu_mul_linear import silu_mul_kernel_call


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for n, k in ((40, 64), (33, 96), (5, 48), (20, 1000)):
            gate_up = torch.randn(1, 2 * k, dtype=dtype) * 3  # a gate/up projection's output, side by side
            gate, up = gate_up[:, :k], gate_up[:, k:]
            w = torch.randn(n, k, dtype=dtype) / k ** 0.5
            b = torch.randn(n, dtype=dtype)
            for bias in (b, None):
                # eager's rounding of silu and of the product, then a float32 sum
                x = (F.silu(gate) * up).float()
                want = F.linear(x, w.float(), None if bias is None else bias.float())
                got = silu_mul_kernel_call(gate, up, w, bias)
                assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
                # the output's own rounding: an ulp of its largest values
                torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    print("silu_mul_linear interpreted: ok")


if __name__ == "__main__":
    main()
