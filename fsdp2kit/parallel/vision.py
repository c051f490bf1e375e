"""Vision-language models under FSDP2: the projector's shard group, the collective-safety patch for ranks without
images, and Ulysses sequence parallel and context parallel after the image features are merged into the embeddings.

A micro-batch without images skips the vision tower in transformers' forward. Under FSDP the tower's shard groups
all-gather their parameters when called and reduce-scatter their gradients in backward, so a rank that skips them
leaves the other ranks waiting (NCCL hangs; gloo aborts on the mismatched sizes). `apply_vision_patch` runs the tower
on a tiny dummy image (one merged patch) whenever a forward has no images, and adds its outputs to the model's with
weight zero (ROLL's `force_vit_image`): every rank calls every vision group, in the same order (before the language
layers, where real images run), and the results and gradients are exactly those of the unpatched model.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel.mesh import sequence_subgroups
from fsdp2kit.parallel.sequence_layout import remember_tokens, token_order
from fsdp2kit.parallel.sequence_masks import padding_mask

_PROJECTOR_CLASS = re.compile(r"(Merger|Projector)$")


def vision_tower_owner(model: nn.Module) -> Any:
    """The module whose forward runs the vision tower and merges its features (transformers' `model.model`)."""
    inner = getattr(model, "model", None)
    if inner is None or not callable(getattr(inner, "get_image_features", None)):
        raise ValueError(f"{type(model).__name__} has no inner model with get_image_features")
    return inner


def projector_modules(model: nn.Module) -> list[str]:
    """The vision-to-text projectors (Qwen's patch mergers, LLaVA's multi-modal projector): classes named
    `...Merger` / `...Projector`, outermost only."""
    names = [n for n, m in model.named_modules() if n and _PROJECTOR_CLASS.search(type(m).__name__)]
    return [n for n in names if not any(n.startswith(outer + ".") for outer in names)]


def default_projector_groups(model: nn.Module, notes: list[str]) -> list[str]:
    """With the default shard groups, a VL model's projectors get their own (ROLL and MindSpeed-MM leave them in the
    root's); none for a text model."""
    if getattr(getattr(model, "config", None), "vision_config", None) is None:
        return []
    projectors = projector_modules(model)
    notes += [
        f"vision projector '{name}': its own shard group (ROLL and MindSpeed-MM leave it in the root's)"
        for name in projectors
    ]
    return projectors


def uncast_modules(groups: list[tuple[str, ...]]) -> list[str]:
    """Shard groups of a vision encoder: their inputs keep their precision (pixel values are not cast)."""
    return [name for group in groups for name in group if re.search(r"vision|visual", name)]


# Other stacks' names for a VL model's two halves, read as transformers' module paths: ROLL's `vision_model`, LLaVA's
# `vision_tower`, MindSpeed-MM's `image_encoder`/`text_decoder` (its own Qwen2.5-VL) and `language_model.model`
# (InternVL) or `language_model` (Mistral3), all relative to the model that holds the tower.
_HALF_ALIASES = {
    "vision_model": "tower",
    "visual": "tower",
    "vision_tower": "tower",
    "image_encoder": "tower",
    "image_encoder.encoder": "tower",
    "language_model": "language",
    "language_model.model": "language",
    "text_decoder": "language",
    "text_decoder.decoder": "language",
}


def translate_vl_path(model: nn.Module, pattern: str) -> str | None:
    """`pattern` with another stack's name of the vision tower or language model replaced by the model's own path
    (`vision_model.blocks.{*}` -> `model.visual.blocks.{*}`); None if it names neither or the model is not VL."""
    inner = getattr(model, "model", None)
    if getattr(getattr(model, "config", None), "vision_config", None) is None or inner is None:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    tower = next((getattr(inner, a) for a in ("visual", "vision_tower", "vision_model") if hasattr(inner, a)), None)
    language = getattr(inner, "language_model", None)
    targets = {"tower": names.get(id(tower)), "language": names.get(id(language))}
    for alias in sorted(_HALF_ALIASES, key=len, reverse=True):
        if (pattern == alias or pattern.startswith(alias + ".")) and targets[_HALF_ALIASES[alias]]:
            return f"{targets[_HALF_ALIASES[alias]]}{pattern[len(alias) :]}"
    return None


def _dummy_image(inner: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel rows and grid of the smallest image the tower takes: one merged patch (merge x merge patches), on the
    device the forward computes on (its inputs': under CPU offload the parameters live on the host)."""
    vision = inner.config.vision_config
    merge = vision.spatial_merge_size
    row = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixels = torch.zeros(merge * merge, row, dtype=torch.float32, device=device)
    grid = torch.tensor([[1, merge, merge]], device=device)
    return pixels, grid


def _zero_sum(value: Any) -> torch.Tensor | None:
    """0 x the sum of every floating tensor in a (nested) model output: joins them to the graph, changes nothing."""
    if isinstance(value, torch.Tensor):
        return value.float().sum() * 0 if value.is_floating_point() else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        parts = [p for p in (_zero_sum(v) for v in value) if p is not None]
        return torch.stack(parts).sum() if parts else None
    return None


def apply_vision_patch(model: nn.Module) -> None:
    """Every forward runs the vision tower: on the batch's images, or on a dummy image whose output is added with
    weight zero (see the module docstring)."""
    inner = vision_tower_owner(model)
    pending: list[torch.Tensor | None] = []

    def before(module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs.get("pixel_values") is None and not kwargs.get("past_key_values"):
            device = next(v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
            pixels, grid = _dummy_image(module, device)
            pending.append(_zero_sum(module.get_image_features(pixels, grid)))

    def after(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
        zero = pending.pop() if pending else None
        if zero is not None:
            output.last_hidden_state = output.last_hidden_state + zero.to(output.last_hidden_state.dtype)
        return output

    inner.register_forward_pre_hook(before, with_kwargs=True)
    inner.register_forward_hook(after, with_kwargs=True)


def _vision_cut(group: ProcessGroup, length: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """This rank's tokens of a VL sequence of `length` (a multiple of the cut) as `token_order` cuts a text one: a
    contiguous 1/k under Ulysses, a front chunk and its mirror under context parallel; and, under context parallel,
    the global index of its queries and of the gathered keys (None without)."""
    subgroups = sequence_subgroups(group)
    ulysses = (subgroups.ulysses.size(), subgroups.ulysses.rank()) if subgroups.ulysses is not None else (1, 0)
    context = (subgroups.context.size(), subgroups.context.rank()) if subgroups.context is not None else (1, 0)
    order = token_order(length, context[0], ulysses[0])
    indices = (order[context[1]].flatten(), order.flatten()) if context[0] > 1 else None
    return order[context[1], ulysses[1]], indices


def _cut_multiple(group: ProcessGroup) -> int:
    """The multiple a sequence is padded to before `_vision_cut`: k x c, and 2c chunks under context parallel."""
    context = sequence_subgroups(group).context
    return group.size() * (2 if context is not None else 1)


def apply_vision_ulysses(model: nn.Module, group: ProcessGroup) -> None:
    """Ulysses and context parallel for a VL model: the tower runs unsplit on every rank of the group (all hold the
    whole samples), the image features are merged into the embeddings of the whole sequence and the 3-D (mrope)
    positions computed over it; then, at the entry of the language model, each rank keeps its share of the tokens
    (`_vision_cut`, the cut of a text batch). The language model's attention is the sequence wrapper; the tower's
    stays the configured one."""
    language_model = vision_tower_owner(model).language_model

    def split(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        embeds = kwargs["inputs_embeds"]
        length = embeds.shape[1]
        local, indices = _vision_cut(group, length)
        local = local.to(embeds.device)
        positions = kwargs.get("position_ids")
        if positions is None:  # no image: the model would number the local slice from 0
            positions = torch.arange(length, device=embeds.device).expand(3, embeds.shape[0], -1)
        kwargs["inputs_embeds"] = embeds[:, local]
        kwargs["position_ids"] = positions[..., local]
        # Over the whole sequence, as parallel/sequence_layout.py:shard_sequence cuts a text batch: left padding (RL's
        # prompts) masked out as keys (rows: this rank's queries, columns: the gathered keys); right padding needs
        # no mask under causal attention.
        mask = kwargs.get("attention_mask")
        real = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        attend = None if real is None else padding_mask(real)
        if attend is not None and indices is not None:
            queries, keys = (t.to(attend.device) for t in indices)
            attend = attend[:, queries][:, :, keys]
        kwargs["attention_mask"] = None if attend is None else attend[:, None]
        masks = kwargs.get("visual_pos_masks")
        if masks is not None:  # Qwen3-VL's deepstack: the visual rows of this share (in sequence order, as `local`)
            mine = torch.zeros_like(masks)
            mine[:, local] = True
            keep = mine[masks]
            kwargs["visual_pos_masks"] = masks[:, local]
            kwargs["deepstack_visual_embeds"] = [e[keep] for e in kwargs["deepstack_visual_embeds"]]
        return args, kwargs

    language_model.register_forward_pre_hook(split, with_kwargs=True)


def shard_vision_batch(batch: dict[str, torch.Tensor], group: ProcessGroup) -> dict[str, torch.Tensor]:
    """A VL micro-batch for Ulysses or context parallel: the whole token sequence (the tower and the mrope positions
    need it), padded at the end to a multiple of the cut with non-target text tokens, and this rank's share of the
    labels; under context parallel the index maps the attention wrapper and the log-prob gather read."""
    import torch.nn.functional as F

    length = batch["input_ids"].shape[1]
    pad = -length % _cut_multiple(group)
    sharded = dict(batch)
    for key, value in (("input_ids", 0), ("attention_mask", 0), ("mm_token_type_ids", 0), ("labels", IGNORE_INDEX)):
        if key in batch:
            sharded[key] = F.pad(batch[key], (0, pad), value=value)
    total = length + pad
    local, indices = _vision_cut(group, total)
    sharded["labels"] = sharded["labels"][:, local]
    # The padded attention mask reaches the MoE router loss: it counts every row, in the order the ranks hold them.
    every = torch.ones(batch["input_ids"].shape[0], total, dtype=torch.bool)
    remember_tokens(group, every, None, indices, length=length)
    return sharded
