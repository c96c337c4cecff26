"""Compile a toy Llama with cgcompile, print how it was split, and check it against eager.

    .venv/bin/python examples/toy_llama.py                      # pieces run as FX code: a few seconds on CPU
    .venv/bin/python examples/toy_llama.py --compiler inductor  # each distinct capturable piece compiled once

The toy's attention is a custom op (`cgcompile.testing.SILLY_OP`), so it is named in
`splitting_ops`; real attention (scaled_dot_product_attention, flash-attn) splits by default.
"""

import argparse

import torch

import cgcompile
from cgcompile.tools.dump import format_summary, summarize
from cgcompile.testing.models import SILLY_OP, ToyLlama


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--compiler", choices=("eager", "inductor"), default="eager")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = ToyLlama(n_layers=args.layers)
    backend = cgcompile.Backend(cgcompile.Config(splitting_ops=[SILLY_OP], compiler=args.compiler))
    compiled = torch.compile(model, backend=backend)

    exact = {"rtol": 0, "atol": 0} if args.compiler == "eager" else {}  # Inductor reorders float math
    for tokens in (7, 3, 12):
        ids = torch.randint(0, 64, (tokens,))  # [T]
        torch._dynamo.mark_dynamic(ids, 0)  # one graph for every T
        torch.testing.assert_close(compiled(ids), model(ids), **exact)

    print(format_summary(summarize(0, backend.pieces)))
    print(backend.stats)
    print(f"{args.layers} layers: {backend.stats.pieces} pieces, {backend.stats.capturable_pieces} capturable; "
          f"outputs match eager")


if __name__ == "__main__":
    main()
