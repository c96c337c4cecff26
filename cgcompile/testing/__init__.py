"""Test tools, apart from the engine, one module per concern:

- `models`: toy models and split ops; `decode_model`: the decode benchmark's Llama, and
  `parallel_model` its sharded forms;
- `fake_graphs`: CUDA graphs faked on CPU through the capture seam (`capture.CudaGraphs`);
- `fx`: the FX graph Dynamo captures for a function, for pass tests;
- `hf_models`: tiny random Hugging Face models and generate() around them (the one module
  here that imports transformers);
- `gpu`: private pools, captures in a process of their own, a ToyLlama on CUDA;
- `numerics`: exact fp32 matmuls (no TF32) for comparisons with eager;
- `fuzz`: the differential fuzzer (`python -m cgcompile.fuzz`), its program grammar in `grammar`.
"""
