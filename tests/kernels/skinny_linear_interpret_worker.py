"""The skinny linear kernel under Triton's interpreter, on the CPU (run by
tests/kernels/test_skinny_linear.py with TRITON_INTERPRET=1): small shapes, every path of the
kernel (masked and unmasked K, a partial last block of features, bias or none), against a
float32 product."""

import os

import torch
import torch.nn.functional as F

from cgcompile.kernels.skinny_linear import Launch, choose_launch, skinny_linear_kernel_call


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        # tall blocks (choose_launch's from 4096 features) with a cut last block, even and uneven K
        for n, k, launch in ((40, 64, Launch(4, 32)), (33, 96, Launch(8, 64)), (5, 48, Launch(1, 64)),
                             (20, 128, None), (50, 96, Launch(32, 32)), (70, 100, Launch(16, 32, num_warps=8))):
            x = torch.randn(1, k, dtype=dtype)
            w = torch.randn(n, k, dtype=dtype)
            b = torch.randn(n, dtype=dtype)
            for bias in (b, None):
                want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
                got = skinny_linear_kernel_call(x, w, bias, launch)
                assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
                torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    print("skinny_linear interpreted: ok")


if __name__ == "__main__":
    main()
