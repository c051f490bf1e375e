"""Forward-only strategy (fsdp2_infer): per-sample log-probs."""
