"""Parallelism, one concern per module: mesh, sharding plan, apply_fsdp, apply_recompute."""
