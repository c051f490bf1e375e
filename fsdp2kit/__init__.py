"""fsdp2kit: train and serve transformer models with PyTorch FSDP2, driven by one YAML file."""

__version__ = "0.1.0"
