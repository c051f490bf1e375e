"""Training: the step (loss, gradients, clipping, update), optimizer and schedule, metrics, loggers, the loop."""
