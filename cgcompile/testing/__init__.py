"""Test tools, apart from the engine: toy models and split ops (`models`) and the
differential fuzzer (`fuzz`, its program grammar in `grammar`; `python -m cgcompile.fuzz`)."""
