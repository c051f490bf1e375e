"""A training step reads device values on the host once: the loss, the gradient norm and the token count, fetched
together (and, before its first forward, the ranks' micro-batch counts: a host tensor). On CUDA every read of a
device value (`.item()`, `.tolist()`, `.cpu()`, `int(t)`...) waits for the GPU to drain its queue, so the step must
not do one per micro-batch. Counted here on CPU, where the same calls are made."""

from __future__ import annotations

import pytest
import torch
from conftest import process_group, sharded_model, token_batch
from torch.overrides import TorchFunctionMode

from fsdp2kit.config.schema import JobConfig, TrainingConfig
from fsdp2kit.train.grads import LossScaler, NonFiniteGuard
from fsdp2kit.train.optim import build_optimizer, build_scheduler
from fsdp2kit.train.step import train_step

HOST_READS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}


class HostReads(TorchFunctionMode):
    """Every host read of a tensor's value made by the step's own code. Not counted: the optimizer step (AdamW's
    step counters live on the host on CUDA, and the fused CUDA AdamW reads none) and the model's forward, where
    transformers' mask builder reads one boolean per call (is the batch packed, is the padding mask all ones)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__()
        self.calls: list[str] = []
        self.paused = False
        for start, end in (
            (optimizer.register_step_pre_hook, optimizer.register_step_post_hook),
            (model.register_forward_pre_hook, model.register_forward_hook),
        ):
            start(lambda *_: setattr(self, "paused", True))
            end(lambda *_: setattr(self, "paused", False))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not self.paused:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_one_host_read_per_step_whatever_the_accumulation(micro_batches):
    cfg = JobConfig.model_validate({"model": {"config": {"num_hidden_layers": 2}}})
    training = TrainingConfig(learning_rate=1e-3)
    with process_group() as runtime:
        model = sharded_model(cfg, runtime, training=True).model
        optimizer = build_optimizer(model, training)
        scheduler = build_scheduler(optimizer, training, 10)
        guard = NonFiniteGuard(training.max_nonfinite_steps, LossScaler(False, training.fp16_initial_scale))
        batches = [token_batch(2, 16) for _ in range(micro_batches)]
        train_step(model, batches, optimizer, scheduler, guard, training.max_grad_norm)  # optimizer states exist
        reads = HostReads(model, optimizer)
        with reads:
            result = train_step(model, batches, optimizer, scheduler, guard, training.max_grad_norm)
    assert result.applied and result.input_tokens == 2 * 16 * micro_batches
    # The micro-batch count agreement's host tensor (exchanged over gloo, no wait for the device), then the device
    # values: loss, gradient norm and token count together.
    assert reads.calls == ["tolist", "tolist"]
