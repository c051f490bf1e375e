"""Models: resolving a model source, meta-device build, seeded init or sharded safetensors load, HF export."""
