"""Parallelism, one concern per module: mesh, sharding plan, apply_fsdp, recompute, TiledMLP, Ulysses, MoE."""
