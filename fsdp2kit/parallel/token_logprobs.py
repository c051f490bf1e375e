"""Per-token log-probabilities (and entropies) straight from the LM head, in chunks of tokens, so that no
[B, T, vocab] float32 tensor ever exists: for a 152k vocabulary at T=4096 that tensor alone is 2.5 GB per sample.

The head's forward is replaced in place (`replace_forward`), so it runs inside the model's forward where FSDP has
its weight gathered, and its hooks, names and checkpoints are unchanged. While a `TokenRequest` is set on the head,
the head returns the log-probabilities of the requested target tokens instead of logits. Where the request's float32
logits fit in what one chunk may take (`kept_logits_budget`), each chunk keeps its log-softmax from the forward for
the backward; beyond it, each chunk's logits are recomputed in backward, so backward holds one chunk's logits at a
time too (one more head matmul a chunk). Either way they are turned into their own gradient in place. Entropies come
with autograd too (an entropy bonus), both at a sampling temperature where one is asked.

What a family does to its logits after the head (Cohere's scale, Granite's divisor, Gemma's soft-cap: `AFTER_HEAD`)
the chunks do, and the model's own step is switched off during a request. `probe_token_head` proves it once per
built model: a family that transforms its logits in some other way is refused, never trained wrong."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass
from functools import partial
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel.forward_patch import Forward, replace_forward
from fsdp2kit.parallel.linear_cross_entropy import (
    LOGITS_BUDGET_BYTES,
    Cap,
    budget_chunk_tokens,
    linear_cross_entropy,
)
from fsdp2kit.parallel.module_paths import model_class_name
from fsdp2kit.parallel.vocab_parallel import (
    VocabShard,
    VocabShardLogProbs,
    gathered_logits,
    softmax_gradient_,
    vocab_shard,
)

_REQUEST = "_fsdp2kit_token_request"
_AFTER_HEAD = "_fsdp2kit_after_head"


def _text_config(model: nn.Module) -> Any:
    """The config a model reads its logit settings from (a VL model's text config)."""
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


@dataclass(frozen=True)
class LogitStep:
    """One thing a family's forward does to the logits after its LM head (from transformers' modeling files):
    multiply or divide them by, or soft-cap them at (cap x tanh(z / cap)), the value `attribute` has on what `holder`
    returns for the causal-LM module."""

    attribute: str
    kind: Literal["multiply", "divide", "softcap"]
    holder: Callable[[nn.Module], Any] = _text_config

    def value(self, model: nn.Module) -> float | None:
        value = getattr(self.holder(model), self.attribute, None)
        return None if value is None or (self.kind != "softcap" and value == 1) else float(value)

    @property
    def neutral(self) -> float | None:
        """The value under which the model's own step does nothing."""
        return None if self.kind == "softcap" else 1.0


# In the order the families apply them (every scale comes before the cap). Any other transform is caught by
# `probe_token_head` (hyperclovax multiplies by `logits_scaling`, which Granite divides by: it is refused).
AFTER_HEAD = (
    LogitStep("logit_scale", "multiply", holder=lambda model: model),  # cohere, cohere2: self.logit_scale
    LogitStep("logits_scaling", "divide"),  # granite, granitemoe*, granite4_vision
    LogitStep("lm_head_multiplier", "multiply", holder=lambda model: getattr(model, "model", None)),  # falcon_h1
    LogitStep("output_multiplier", "multiply"),  # muse_spark, muse_glimmer (before their soft-cap)
    LogitStep("final_logit_softcapping", "softcap"),  # gemma2, gemma3, gemma3n, vaultgemma, paligemma, ...
)


@dataclass(frozen=True)
class AfterHead:
    """What the chunks apply to their float32 logits: a scale, then a soft-cap."""

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, model: nn.Module) -> AfterHead:
        scale, softcap = 1.0, None
        for step in AFTER_HEAD:
            value = step.value(model)
            if value is None:
                continue
            if step.kind == "softcap":
                softcap = value
            else:
                scale = scale * value if step.kind == "multiply" else scale / value
        return cls(scale, softcap)


@dataclass
class TokenRequest:
    """What the head computes on its next call: log p(targets) per position (IGNORE_INDEX targets give 0)."""

    targets: torch.Tensor  # [B, T] int64, aligned with the head's input positions
    chunk_tokens: int  # tokens per chunk; 0 = all at once
    entropy: bool = False
    _: KW_ONLY  # the rest by name: `entropies` is the head's answer, never an argument
    entropies: torch.Tensor | None = None  # [B, T] float32, filled when `entropy` (with autograd where enabled)
    temperature: torch.Tensor | None = None  # float32, one [] or one per sample [B]: log-probs of logits / it
    summed: bool = False  # return the summed cross-entropy -sum(log p) instead (the training loss)
    kept_bytes: int = 0  # float32 logits the chunks may keep from forward to backward in all (`kept_logits_budget`)


def head_name(model: nn.Module) -> str:
    """The module path of the model's output embeddings (the LM head)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    return next(name for name, module in model.named_modules() if module is head)


def install_token_head(model: nn.Module) -> None:
    """Let the LM head answer `TokenRequest`s; without one it computes logits as before. The chunks apply what the
    model does to its logits after the head (`AFTER_HEAD`)."""
    name = head_name(model)
    setattr(model.get_submodule(name), _AFTER_HEAD, AfterHead.of(model))
    replace_forward(model, [name], _token_forward)


def _token_forward(head: nn.Module, original: Forward) -> Forward:
    def forward(hidden: torch.Tensor) -> object:
        request: TokenRequest | None = getattr(head, _REQUEST, None)
        weight, bias = cast(torch.Tensor, head.weight), getattr(head, "bias", None)
        if request is None:  # a head split by vocabulary (tensor parallel) gathers its logits
            return gathered_logits(hidden, weight, bias) if isinstance(weight, DTensor) else original(hidden)
        return _chunked(hidden, weight, bias, request, getattr(head, _AFTER_HEAD))

    return forward


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, after: AfterHead
) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """A chunk's float32 logits, scaled and soft-capped as the model does after its head, and the derivative of
    that (None where it does nothing), which their gradient is multiplied by."""
    logits = F.linear(hidden, weight, bias).float()
    if after.scale != 1:
        logits = logits * after.scale
    if not after.softcap:
        return logits, None if after.scale == 1 else after.scale
    squashed = torch.tanh(logits / after.softcap)
    return squashed * after.softcap, (1 - squashed.square()) * after.scale


def _tempered(
    logits: torch.Tensor, slope: torch.Tensor | float | None, temperature: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | float | None]:
    """Logits divided by each token's sampling temperature ([chunk], None: 1), and the slope with it."""
    if temperature is None:
        return logits, slope
    inverse = temperature.reciprocal().unsqueeze(-1)
    return logits / temperature.unsqueeze(-1), inverse if slope is None else slope * inverse


class _ChunkLogProbs(torch.autograd.Function):
    """log p(target) of one chunk of tokens at their temperature, and with `entropy` each token's entropy
    H = -sum p log p (else an empty tensor). Backward turns the chunk's log-softmax into its gradient in place:
    g_lp x (one-hot - p) - g_H x p x (log p + H); so it holds one [chunk, vocab] float32 tensor (two with entropy)
    where autograd's log-softmax and gather would hold four or five. With `keep` the forward's log-softmax (and a
    soft-cap's slope) is kept for it; else backward recomputes the chunk's logits."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        after: AfterHead,
        temperature: torch.Tensor | None,
        entropy: bool,
        keep: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, slope = _tempered(*_logits(hidden, weight, bias, after), temperature)
        normaliser = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        entropies = (normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)) if entropy else logits.new_empty(0)
        log_probs = (picked - normaliser).masked_fill(targets == IGNORE_INDEX, 0.0)
        kept: tuple[torch.Tensor | None, ...] = (None, None)
        if keep:
            # Backward turns it into the gradient in place: a second backward through the graph is refused by
            # autograd's version check, never computed from a spent tensor.
            kept = (logits.sub_(normaliser.unsqueeze(-1)), slope if isinstance(slope, torch.Tensor) else None)
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser, temperature, entropies, *kept)
        ctx.after, ctx.entropy, ctx.keep, ctx.slope = after, entropy, keep, slope if kept[1] is None else None
        return log_probs, entropies

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, normaliser, temperature, entropies, kept, kept_slope = ctx.saved_tensors
        grad = grad.float().masked_fill(targets == IGNORE_INDEX, 0.0)
        if ctx.keep:
            grad_logits, slope = kept, ctx.slope if kept_slope is None else kept_slope  # log p from the forward
        else:
            grad_logits, slope = _tempered(*_logits(hidden, weight, bias, ctx.after), temperature)
            grad_logits.sub_(normaliser.unsqueeze(-1))  # log p
        softmax_gradient_(grad_logits, grad, grad_entropy if ctx.entropy else None, entropies)
        grad_logits.scatter_add_(-1, targets.clamp(min=0).unsqueeze(-1), grad.unsqueeze(-1))  # + grad x one-hot
        if slope is not None:
            grad_logits.mul_(slope)
        grad_logits = grad_logits.to(hidden.dtype)
        grad_bias = grad_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_logits @ weight, grad_weight, grad_bias, None, None, None, None, None


def _chunked(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, request: TokenRequest, after: AfterHead
) -> torch.Tensor:
    """Log-probs [B, T] float32 of `request.targets` (or their negated sum), chunk by chunk over the tokens; on a
    head split by vocabulary, each chunk's from the rank's shard (`parallel/vocab_parallel.py`)."""
    batch, length = hidden.shape[:2]
    flat_hidden, flat_targets = hidden.reshape(batch * length, -1), request.targets.reshape(-1)
    step = max(1, request.chunk_tokens or flat_targets.numel())
    shard = vocab_shard(weight, bias)
    if shard is not None:
        return _chunked_on_shard(flat_hidden, flat_targets, shard, request, after, step, (batch, length))
    if request.summed:
        logits_of = partial(_logits, weight=weight, bias=bias, after=after)
        cap = Cap(after.softcap) if after.scale == 1 else None  # a fused kernel knows soft-caps, not scales
        return linear_cross_entropy(flat_hidden, weight, bias, flat_targets, step, logits_of, cap)
    temperature = _token_temperature(request.temperature, batch, length)
    # float32 log-softmax, and a soft-cap's slope beside it, for every token: kept only for a backward, in budget
    kept = flat_targets.numel() * weight.shape[0] * 4 * (2 if after.softcap else 1)
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    keep = grads and kept <= request.kept_bytes
    log_probs, entropies = [], []
    for start in range(0, flat_targets.numel(), step):
        part = slice(start, start + step)
        part_temperature = temperature[part] if temperature is not None else None
        lp, entropy = _ChunkLogProbs.apply(
            flat_hidden[part], weight, bias, flat_targets[part], after, part_temperature, request.entropy, keep
        )
        log_probs.append(lp)
        entropies.append(entropy)
    if request.entropy:
        request.entropies = torch.cat(entropies).reshape(batch, length)
    return torch.cat(log_probs).reshape(batch, length).clone()  # its own storage: FSDP hooks a view badly


def _chunked_on_shard(
    flat_hidden: torch.Tensor,
    flat_targets: torch.Tensor,
    shard: VocabShard,
    request: TokenRequest,
    after: AfterHead,
    step: int,
    shape: tuple[int, int],
) -> torch.Tensor:
    """`_chunked` on this rank's vocabulary shard of the head: the same log-probs, entropies and summed loss."""
    temperature = _token_temperature(request.temperature, *shape)

    def logits_of(
        hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | float | None]:
        return _tempered(*_logits(hidden, weight, bias, after), temperature)

    log_probs, entropies = [], []
    for start in range(0, flat_targets.numel(), step):
        part = slice(start, start + step)
        part_temperature = temperature[part] if temperature is not None else None
        lp, entropy = VocabShardLogProbs.apply(
            flat_hidden[part],
            shard.weight,
            shard.bias,
            flat_targets[part],
            part_temperature,
            logits_of,
            request.entropy,
            shard.group,
            shard.start,
        )
        log_probs.append(lp)
        entropies.append(entropy)
    if request.summed:
        return -torch.cat(log_probs).sum()
    if request.entropy:
        request.entropies = torch.cat(entropies).reshape(shape)
    return torch.cat(log_probs).reshape(shape).clone()


def _token_temperature(temperature: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """Each token's temperature, flat [batch x length] float32, from one for all, one per sample ([batch]) or one
    per token ([batch, length]: packed rows, train/packing.py)."""
    if temperature is None:
        return None
    if temperature.dim() == 2:
        return temperature.float().reshape(-1)
    per_sample = temperature.float().reshape(-1, 1) if temperature.dim() else temperature.float()
    return per_sample.expand(batch, length).reshape(-1)


@contextmanager
def token_request(model: nn.Module, request: TokenRequest) -> Iterator[TokenRequest]:
    """Within the block, the model's forward returns `request`'s log-probs as its `logits`. The model's own steps
    after the head are switched off meanwhile: the chunks apply them, and they must not transform their result."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    switched = [(step, step.holder(model)) for step in AFTER_HEAD if step.value(model) is not None]
    kept = [getattr(holder, step.attribute) for step, holder in switched]
    setattr(head, _REQUEST, request)
    for step, holder in switched:
        setattr(holder, step.attribute, step.neutral)
    try:
        yield request
    finally:
        setattr(head, _REQUEST, None)
        for (step, holder), value in zip(switched, kept, strict=True):
            setattr(holder, step.attribute, value)


PROBE_TOKENS = 16


@torch.no_grad()
def probe_token_head(model: nn.Module, device: torch.device, where: str) -> None:
    """Once per built model: the chunked head's log-probs of a few fixed tokens must equal log_softmax of the model's
    own logits, else the family transforms its logits after the head in a way the chunks do not, and would train on
    wrong log-probs: refused, naming `where` (the model as the user gave it). Collective under FSDP: every rank runs
    the same tokens and the ranks decide on the largest difference together. Eval mode, no gradients, RNG kept;
    compiled layers (training.compile) run eagerly here: compiling them for the probe would cost a second
    compilation of its own, no-grad graph at its own shapes, before the first step compiles the one training runs."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    tokens = (torch.arange(PROBE_TOKENS + 1, device=device) * 7919 % head.weight.shape[0])[None]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    was_training = model.training
    model.eval()
    try:
        with (
            torch.random.fork_rng(devices=[device] if device.type == "cuda" else []),
            torch.compiler.set_stance("force_eager"),
        ):
            logits = model(input_ids=inputs, use_cache=False).logits
            # The positions the head sees: fewer than the inputs where the model cuts the sequence inside (a VL model
            # under Ulysses slices after the vision merge); any targets serve, the same for both.
            targets = targets[:, : logits.shape[1]]
            with token_request(model, TokenRequest(targets, 0)):
                chunked = model(input_ids=inputs, use_cache=False).logits.float()
    finally:
        model.train(was_training)
        _reshard(model)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    # The model's own steps after the head run in its dtype, the chunks' in float32: a bf16 model differs by its
    # rounding of the largest logit; a missed transform changes every log-prob by the logits' own scale.
    tolerance = 1e-4 + 4 * torch.finfo(logits.dtype).eps * logits.float().abs().max()
    excess = ((chunked - expected).abs().max() - tolerance).reshape(1)
    if dist.is_initialized():
        dist.all_reduce(excess, op=dist.ReduceOp.MAX)
    if excess.item() > 0:
        family = getattr(getattr(model, "config", None), "model_type", "?")
        name = model_class_name(model)
        raise UserError(
            f"model.name_or_path: '{where}' ({family}, {name}) transforms its logits after the LM head in a way "
            f"fsdp2kit's chunked log-probs do not reproduce (they differ from its own by up to "
            f"{excess.item() + tolerance.item():.3g}); refused rather than trained on wrong log-probs"
        )


def _reshard(model: nn.Module) -> None:
    """Put every FSDP group back to its shards: after a forward without backward the root group keeps its gathered
    parameters registered, and an optimizer built from `model.parameters()` then would hold those, not the shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def kept_logits_budget(setting: int | str, vocab_size: int) -> int:
    """Bytes of float32 logits (and slopes) a log-prob request may keep from its forward for its backward, sparing
    the backward its recompute of every chunk's logits (a third of the head's matmuls): what one chunk may take, so
    the peak stays that of one chunk. `training.loss_chunk_tokens` N: N tokens' logits (the request keeps only when
    it is one chunk); auto and 0 (the API's log-probs are chunked anyway): `LOGITS_BUDGET_BYTES`."""
    if setting == "auto" or int(setting) == 0:
        return LOGITS_BUDGET_BYTES
    return int(setting) * vocab_size * 4


def chunk_tokens(setting: int | str, vocab_size: int, tp_size: int = 1) -> int:
    """`training.loss_chunk_tokens`: `auto` chunks above a 32k vocabulary, where the logits start to dominate a
    step's memory, by as many tokens as 1 GiB of float32 logits holds (`budget_chunk_tokens`: 2048 at 128k); 0
    computes the whole sequence at once. Under tensor parallelism the loss is always computed on the head's
    vocabulary shards, so `auto` and 0 chunk by what 1 GiB of a shard's logits holds."""
    if tp_size > 1 and setting in ("auto", 0):
        return budget_chunk_tokens(-(-vocab_size // tp_size))
    if setting == "auto":
        return budget_chunk_tokens(vocab_size) if vocab_size > 32768 else 0
    return int(setting)
