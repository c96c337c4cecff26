"""Per call: the runtime and what it runs (graph pieces, full graphs, replay plans), the capture
session, static buffers, watched weights and capture recovery. Nothing here compiles."""
