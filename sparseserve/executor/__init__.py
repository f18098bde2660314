"""One worker process per rank of a parallel layout, driven from the engine (docs/parallelism.md)."""
