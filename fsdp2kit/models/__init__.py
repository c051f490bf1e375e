"""Models: resolving a model source, meta-device build, seeded init or sharded safetensors load, the sharded model
of a run, HF export."""
