"""Training: setup of the sharded model, optimizer and schedule, metrics, the loop."""
