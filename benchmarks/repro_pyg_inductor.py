"""Plain torch.compile (Inductor, no cgcompile) against eager on torch_geometric's GNNs.

Standalone: it imports torch and torch_geometric only. Each model (GCN, GAT, GraphSAGE,
GIN: 16 features in, hidden 32, 2 layers, 8 out, seeded random weights) is compiled once
with `torch.compile(model)` and called on batches of 1, 3, 8 and 1 random graphs (6 to 12
nodes, two edges a node, Batch.from_data_list), each call with new graphs, as
benchmarks/model_zoo_beyond.py does. It prints max |compiled - eager| / max |eager| per
call and exits 1 when one is above 1e-4 (float32), which is the upstream symptom listed in
docs/upstream.md: wrong outputs at a batch of one graph.

    python benchmarks/repro_pyg_inductor.py --device cuda
    python benchmarks/repro_pyg_inductor.py --device cuda --models GCN --sequence 1,3,1
"""

import argparse
import sys

import torch
from torch_geometric.data import Batch, Data
from torch_geometric.nn import models

TOLERANCE = 1e-4


def random_batch(size: int, seed: int, device: str) -> Batch:
    g = torch.Generator().manual_seed(seed)
    graphs = []
    for _ in range(size):
        nodes = int(torch.randint(6, 13, (), generator=g))
        edge_index = torch.randint(0, nodes, (2, 2 * nodes), generator=g)
        graphs.append(Data(x=torch.randn(nodes, 16, generator=g), edge_index=edge_index))
    return Batch.from_data_list(graphs).to(device)


def build(name: str, device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    extra = {"heads": 2} if name == "GAT" else {}
    model = getattr(models, name)(in_channels=16, hidden_channels=32, num_layers=2, out_channels=8, **extra)
    return model.to(device).eval()


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


def check(name: str, sequence: list[int], device: str) -> bool:
    """The model's sequence on one compiled model; True when every call is within the tolerance."""
    torch._dynamo.reset()
    model = build(name, device)
    compiled = torch.compile(model)
    ok = True
    for call, size in enumerate(sequence):
        batch = random_batch(size, seed=call, device=device)
        with torch.inference_mode():
            expected = model(batch.x, batch.edge_index)
            got = compiled(batch.x, batch.edge_index)
        err = relative_error(got, expected)
        ok &= err <= TOLERANCE
        print(f"{name:<10} call {call} graphs {size}: nodes {batch.num_nodes:3d} max err {err:.2e}"
              f"{'' if err <= TOLERANCE else '  WRONG'}", flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="GCN,GAT,GraphSAGE,GIN")
    parser.add_argument("--sequence", default="1,3,8,1")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # eager and compiled float32 matmuls round alike
    sequence = [int(s) for s in args.sequence.split(",")]
    print(f"torch {torch.__version__}, device {args.device}")
    results = [check(name, sequence, args.device) for name in args.models.split(",")]
    print("reproduced: plain torch.compile differs from eager" if not all(results) else "not reproduced")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
