"""Ulysses under an RL back-end, in one process: a vision-language model keeps left-padded prompts masked (its
language model's 2-D mask was dropped where the sequence is cut), and two models with different Ulysses groups each
attend over their own group (the wrapper was registered under one process-wide name, so the last group served
both)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from conftest import process_group

from fsdp2kit.models.builtin import BUILTIN_MODELS
from fsdp2kit.models.vl import BUILTIN_VL_MODELS
from fsdp2kit.parallel.ulysses import apply_ulysses
from fsdp2kit.parallel.vision import apply_vision_ulysses


def tiny_vl_model() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForImageTextToText

    settings = copy.deepcopy(BUILTIN_VL_MODELS["tiny-qwen2.5-vl"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    config.get_text_config()._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()


def left_padded(vocab: int) -> dict[str, torch.Tensor]:
    """Two prompts, the first left-padded by 5 and both right-padded by 2 (RL's layout)."""
    ids = torch.randint(20, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[:, -2:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def test_a_vision_language_model_under_ulysses_keeps_left_padding_masked():
    """A Ulysses group of one rank (the cut and the wrapper run, the all-to-all is the identity): the real tokens'
    logits equal transformers' own model on the same left-padded batch; before, padding was attended (off by ~1)."""
    reference = tiny_vl_model()
    batch = left_padded(reference.config.get_text_config().vocab_size)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        want = reference(**batch).logits[real]
    with process_group():
        model = copy.deepcopy(reference)
        apply_ulysses(model, dist.group.WORLD, "text_config")
        apply_vision_ulysses(model, dist.group.WORLD)
        with torch.no_grad():
            got = model(**batch).logits[real]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_two_models_with_different_ulysses_groups_each_attend_over_their_own(monkeypatch: pytest.MonkeyPatch):
    """Two groups (of this one rank), one model switched to each: each model's all-to-alls go through its own
    group; before, the second registration replaced the first under the one name `ulysses_sdpa`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(BUILTIN_MODELS["tiny-llama"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    config._attn_implementation = "sdpa"
    batch = {"input_ids": torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(2))}
    used: list[object] = []
    exchange = dist.all_to_all_single

    def recorded(output: torch.Tensor, input: torch.Tensor, group: object = None, **kwargs: object) -> object:
        used.append(group)
        return exchange(output, input, group=group, **kwargs)

    with process_group():
        groups = [dist.new_group([0]), dist.new_group([0])]
        models = [AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval() for _ in groups]
        for model, group in zip(models, groups, strict=True):
            apply_ulysses(model, group)
        monkeypatch.setattr(dist, "all_to_all_single", recorded)
        with torch.no_grad():
            for model, group in zip(models, groups, strict=True):
                used.clear()
                model(**batch)
                assert used and all(g is group for g in used), model.config._attn_implementation
    assert models[0].config._attn_implementation != models[1].config._attn_implementation
