"""A vision encoder beside a decoder, each with its own CUDA graphs and memory budget.

A ViT from transformers (built from a config, random weights) is compiled with
cgcompile; the capture dimension is the number of images. A toy decoder is compiled
beside it with a Backend of its own, as a serving engine runs an encoder next to its
language model. Before any capture, each model's plan says how many graphs each size
makes; on a GPU the plan also measures the bytes, each model captures under its own
budget, and the two are called interleaved against eager.

    .venv/bin/python examples/vision_encoder.py                     # GPU if there is one, else CPU
    .venv/bin/python examples/vision_encoder.py --encoder-budget-mib 64 --decoder-budget-mib 8
"""

from __future__ import annotations

import argparse

import torch
from transformers import ViTConfig, ViTModel

import cgcompile
from cgcompile.testing.models import SILLY_OP, ToyLlama

MIB = 1024 * 1024
IMAGE_SIZES = (1, 2, 4, 8, 16, 32)  # capture sizes of the encoder: images per call
TOKEN_SIZES = (2, 4, 8, 16, 32, 64)  # capture sizes of the decoder: tokens per step


def vit(device: str) -> ViTModel:
    """A small ViT on CPU (a smoke test), ViT-Base's shape on a GPU; random weights."""
    small = dict(image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128)
    base = dict(image_size=224, patch_size=16, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                intermediate_size=3072)
    config = ViTConfig(**(base if device == "cuda" else small), attn_implementation="sdpa")
    return ViTModel(config, add_pooling_layer=False).to(device).eval()


def images(model: ViTModel, n: int, device: str) -> torch.Tensor:
    c = model.config
    pixels = torch.randn(n, c.num_channels, c.image_size, c.image_size, generator=torch.Generator().manual_seed(n))
    return pixels.to(device)  # pixel_values: [N, 3, H, W]


def tokens(n: int, device: str) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).to(device)  # ids: [T]


def compiled_pair(device: str):
    """Each model its own Backend: its own pool, capture session and compile cache."""
    compiler = "inductor" if device == "cuda" else "eager"
    encoder, decoder = vit(device), ToyLlama(4, hidden=256, vocab=64).to(device).eval()
    enc_backend = cgcompile.Backend(cgcompile.Config(compiler=compiler, capture_sizes=IMAGE_SIZES))
    dec_backend = cgcompile.Backend(cgcompile.Config(compiler=compiler, capture_sizes=TOKEN_SIZES,
                                                     splitting_ops=(SILLY_OP,)))
    return (encoder, enc_backend, torch.compile(encoder, backend=enc_backend),
            decoder, dec_backend, torch.compile(decoder, backend=dec_backend))


def first_calls(enc, dec, device: str) -> None:
    """Trace each model once at a size that is not 1 (the capture dimension stays dynamic)."""
    pixels, ids = images(enc[0], 3, device), tokens(5, device)
    torch._dynamo.mark_dynamic(pixels, 0)
    torch._dynamo.mark_dynamic(ids, 0)
    enc[1](pixels)
    dec[1](ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--encoder-budget-mib", type=int, default=512)
    parser.add_argument("--decoder-budget-mib", type=int, default=64)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    encoder, enc_backend, enc, decoder, dec_backend, dec = compiled_pair(device)
    with torch.inference_mode():
        first_calls((encoder, enc), (decoder, dec), device)
        print(enc_backend.plan_memory(name="vision").format())
        print(dec_backend.plan_memory(name="decoder").format())
        if device == "cuda":
            enc_backend.capture(enc, lambda n, warmup: (images(encoder, n, device),),
                                memory_budget=args.encoder_budget_mib * MIB, name="vision", progress=False)
            dec_backend.capture(dec, lambda n, warmup: (tokens(n, device),),
                                memory_budget=args.decoder_budget_mib * MIB, name="decoder", progress=False)
            print(enc_backend.memory_plan.format())
            print(dec_backend.memory_plan.format())
        worst = 0.0
        for n_images, n_tokens in [(3, 5), (32, 64), (1, 2), (20, 37), (40, 70), (8, 16)]:  # interleaved
            pixels, ids = images(encoder, n_images, device), tokens(n_tokens, device)
            got, want = enc(pixels).last_hidden_state, encoder(pixels).last_hidden_state
            worst = max(worst, float((got - want).abs().max()))
            worst = max(worst, float((dec(ids) - decoder(ids)).abs().max()))
    tolerance = 2e-2 if device == "cuda" else 1e-4  # Inductor and TF32-free fp32 rounding
    assert worst <= tolerance, f"outputs differ from eager by {worst:.2e} (tolerance {tolerance:.0e})"
    print(f"encoder and decoder interleaved on {device}: outputs match eager (max abs diff {worst:.1e}); "
          + captures(enc_backend, dec_backend, device))


def captures(enc_backend, dec_backend, device: str) -> str:
    if device != "cuda":
        return "no CUDA graphs on CPU: the plans above count what a capture on a GPU would make; nothing was captured"
    graphs = (enc_backend.stats.graphs_captured, dec_backend.stats.graphs_captured)
    return (f"graphs captured {graphs[0]} + {graphs[1]}, pools {enc_backend.graph_memory() / MIB:.1f} + "
            f"{dec_backend.graph_memory() / MIB:.1f} MiB")


if __name__ == "__main__":
    main()
