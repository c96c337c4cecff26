"""Test tools, apart from the engine: toy models and split ops (`models`), the decode
benchmark's Llama (`decode_model`) and its sharded forms (`parallel_model`), and the
differential fuzzer (`fuzz`, its program grammar in `grammar`; `python -m cgcompile.fuzz`)."""
