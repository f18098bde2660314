"""Collectives and process groups for tensor and expert parallelism (docs/parallelism.md)."""
