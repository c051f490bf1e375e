"""The chunked training loss (parallel/linear_cross_entropy.py): loss and gradients equal the whole logits' cross-
entropy in float32 at any chunking, chunks are sized by memory, and a bf16 head accumulates its gradient without one
float32 [vocab, hidden] tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fsdp2kit.parallel import linear_cross_entropy as module
from fsdp2kit.parallel.linear_cross_entropy import (
    LOGITS_BUDGET_BYTES,
    Cap,
    budget_chunk_tokens,
    linear_cross_entropy,
)

TOKENS, HIDDEN, VOCAB = 70, 24, 300


def head_case(dtype: torch.dtype = torch.float32, bias: bool = True) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=generator).to(dtype).requires_grad_()
    head_bias = torch.randn(VOCAB, generator=generator).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=generator)
    targets[::5] = -100  # some positions are no target
    return hidden, weight, head_bias, targets


def plain_linear(weight: torch.Tensor, bias: torch.Tensor | None, scale: float = 1.0):
    return lambda part: ((F.linear(part, weight, bias).float() * scale), scale if scale != 1 else None)


def reference(hidden, weight, bias, targets, scale: float = 1.0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' way: the whole logits in float32, F.cross_entropy summed, autograd's gradients."""
    inputs = [t for t in (hidden, weight, bias) if t is not None]
    loss = F.cross_entropy(F.linear(hidden, weight, bias).float() * scale, targets, reduction="sum")
    return loss.detach(), list(torch.autograd.grad(loss * 0.37, inputs))


@pytest.mark.parametrize("chunk", [7, 32, TOKENS])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_loss_and_gradients_equal_the_whole_logits(chunk, scale):
    hidden, weight, bias, targets = head_case()
    expected_loss, expected_grads = reference(hidden, weight, bias, targets, scale)
    loss = linear_cross_entropy(hidden, weight, bias, targets, chunk, plain_linear(weight, bias, scale))
    grads = torch.autograd.grad(loss * 0.37, [hidden, weight, bias])
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-5)
    for got, expected, name in zip(grads, expected_grads, ("hidden", "weight", "bias"), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_gradients_stay_within_bf16_rounding_of_float32():
    """A bf16 head accumulates its weight gradient in bf16 over the chunks: within bf16 tolerance of float32."""
    case = head_case(torch.bfloat16, bias=False)
    loss = linear_cross_entropy(case[0], case[1], None, case[3], 16, plain_linear(case[1], None))
    grads = torch.autograd.grad(loss * 0.37, [case[0], case[1]])
    as_float = [t.detach().float().requires_grad_() for t in case[:2]]
    expected_loss, expected_grads = reference(as_float[0], as_float[1], None, case[3])
    torch.testing.assert_close(loss, expected_loss, rtol=1e-3, atol=1e-2)
    for got, expected in zip(grads, expected_grads, strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)


class _Allocations(TorchDispatchMode):
    """The dtype and element count of every tensor an op allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):  # new storage only: views and in-place results allocate nothing
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in given:
                self.made.append((tensor.dtype, tensor.numel()))
        return out


def test_a_bf16_head_makes_no_float32_weight_sized_tensor():
    """The old chunked loss kept a float32 [vocab, hidden] gradient and made a float32 copy of each chunk's: the
    head's own weight-sized tensors are now in its dtype; the float32 ones are a chunk's logits."""
    hidden, weight, _, targets = head_case(torch.bfloat16, bias=False)
    with _Allocations() as seen:
        loss = linear_cross_entropy(hidden, weight, None, targets, 8, plain_linear(weight, None))
        loss.backward()
    float32_sizes = [n for dtype, n in seen.made if dtype == torch.float32]
    assert max(float32_sizes) <= 8 * VOCAB, f"float32 tensors of {max(float32_sizes)} elements"
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16


def test_without_autograd_no_gradient_is_computed():
    hidden, weight, bias, targets = head_case()
    with torch.no_grad(), _Allocations() as seen:
        loss = linear_cross_entropy(hidden, weight, bias, targets, 16, plain_linear(weight, bias))
    assert loss == pytest.approx(float(reference(hidden, weight, bias, targets)[0]), rel=1e-6)
    assert not [n for _, n in seen.made if n == VOCAB * HIDDEN or n == TOKENS * HIDDEN]


def test_chunks_are_sized_by_memory():
    assert budget_chunk_tokens(128256) == 2048 and budget_chunk_tokens(151936) == 1536
    assert budget_chunk_tokens(256000) == 1024
    for vocab in (40000, 128256, 262144):
        assert 4 * vocab * budget_chunk_tokens(vocab) <= LOGITS_BUDGET_BYTES
    assert budget_chunk_tokens(10**9) == 1


def test_a_cpu_keeps_the_exact_chunks_where_a_fused_kernel_is_installed(monkeypatch):
    """liger's kernel (the `cuda` extra) is for CUDA tensors only: here the chunks run even when it is importable."""
    calls = []
    monkeypatch.setattr(module, "_liger_kernel", lambda: lambda *a, **k: calls.append(a))
    hidden, weight, bias, targets = head_case()
    loss = linear_cross_entropy(hidden, weight, bias, targets, 16, plain_linear(weight, bias), Cap())
    assert not calls and float(loss) == pytest.approx(float(reference(hidden, weight, bias, targets)[0]), rel=1e-6)


def softcapped_linear(weight: torch.Tensor, cap: float):
    def logits_of(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        squashed = torch.tanh(F.linear(part, weight).float() / cap)
        return squashed * cap, 1 - squashed.square()

    return logits_of


@pytest.mark.cuda
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_bf16_on_cuda_is_the_float32_loss_within_bf16(fused, softcap):
    """bf16 on CUDA, a 128k-vocabulary head: the chunks (no Cap) and liger's fused kernel (a Cap; skipped where
    liger-kernel is not installed) give the float32 whole-logits loss and gradients within bf16 rounding."""
    if fused:
        pytest.importorskip("liger_kernel")
    generator = torch.Generator().manual_seed(0)
    hidden32 = torch.randn(4096, 512, generator=generator).cuda()
    weight32 = (torch.randn(128256, 512, generator=generator) * 512**-0.5).cuda()
    targets = torch.randint(0, 128256, (4096,), generator=generator).cuda()
    targets[::7] = -100
    hidden, weight = (t.bfloat16().requires_grad_() for t in (hidden32, weight32))
    logits_of = plain_linear(weight, None) if softcap is None else softcapped_linear(weight, softcap)
    cap = Cap(softcap) if fused else None
    loss = linear_cross_entropy(hidden, weight, None, targets, budget_chunk_tokens(128256), logits_of, cap)
    loss.backward()
    reference32 = [t.clone().requires_grad_() for t in (hidden32, weight32)]
    logits = F.linear(*reference32).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    expected = F.cross_entropy(logits, targets, reduction="sum")
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=2e-3, atol=1.0)
    for got, want in ((hidden.grad, reference32[0].grad), (weight.grad, reference32[1].grad)):
        scale = float(want.abs().max())
        torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2 * scale)


def test_dynamo_traces_the_loss_in_one_graph():
    """Compile-friendly: torch.compile(fullgraph=True) traces the chunks, forward and backward, without a graph break
    (dynamo's tracing alone, backend eager, to keep this fast), and gives what eager gives to float32 rounding (the
    graph runs the head over every row, eager over the targeted rows alone: no data-dependent shape in a graph)."""
    hidden, weight, bias, targets = head_case()

    def loss_of(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(h, w, b, targets, 16, plain_linear(w, b))

    compiled = torch.compile(loss_of, backend="eager", fullgraph=True)
    got = compiled(hidden, weight, bias)
    got_grads = torch.autograd.grad(got, [hidden, weight, bias])
    expected = loss_of(hidden, weight, bias)
    torch.testing.assert_close(got, expected)  # float32's default tolerances: rtol 1.3e-6, atol 1e-5
    for a, b in zip(got_grads, torch.autograd.grad(expected, [hidden, weight, bias]), strict=True):
        torch.testing.assert_close(a, b)
