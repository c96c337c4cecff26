"""FX graphs for pass tests: what Dynamo captures for a function."""

import torch


def traced(fn, *args) -> torch.fx.GraphModule:
    """The FX graph Dynamo captures for fn(*args), with fake-tensor metadata."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]
