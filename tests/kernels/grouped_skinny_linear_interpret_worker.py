"""The grouped skinny linear kernel under Triton's interpreter, on the CPU (run by
tests/kernels/test_grouped_skinny_linear.py with TRITON_INTERPRET=1): 2, 3 and 4 members of
uneven sizes (not multiples of the block, one smaller than a block), masked and unmasked K,
bias or none, each against its float32 product, into an output poisoned with NaN so that a
column no program writes shows."""

import os

import torch
import torch.nn.functional as F

from cgcompile.kernels.grouped_skinny_linear import grouped_kernel_call
from cgcompile.kernels.skinny_linear import Launch

CASES = [  # (features per member, K, launch)
    ((40, 9), 64, Launch(8, 32)),
    ((40, 9, 17), 96, Launch(8, 64)),
    ((5, 3, 12, 1), 48, Launch(4, 64)),
    ((20, 20), 128, None),
]


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for features, k, launch in CASES:
            x = torch.randn(1, k, dtype=dtype)
            ws = [torch.randn(n, k, dtype=dtype) for n in features]
            bs = [torch.randn(n, dtype=dtype) for n in features]
            for biases in (bs, []):
                want = torch.cat([F.linear(x.float(), w.float(), b.float() if biases else None)
                                  for w, b in zip(ws, bs)], dim=-1)
                out = torch.full((sum(features),), float("nan"), dtype=dtype)
                got = grouped_kernel_call(x, ws, biases, launch, out=out)
                assert got.shape == want.shape and got.dtype == dtype, (got.shape, got.dtype)
                torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    print("grouped_skinny_linear interpreted: ok")


if __name__ == "__main__":
    main()
