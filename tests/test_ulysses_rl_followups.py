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


def _context_parallel_rank(rank: int, port: int, want: torch.Tensor, results: dict) -> None:
    """Rank `rank` of 2 (context parallel 2, gloo): the VL model's logits of this rank's tokens, as the trainer cuts
    a VL micro-batch (`shard_vision_batch` records the index maps, the language model's entry cuts the embeddings)."""
    from fsdp2kit.config.schema import StrategyConfig
    from fsdp2kit.parallel.mesh import mesh_layout, sequence_parallel_group
    from fsdp2kit.parallel.sequence_layout import token_order
    from fsdp2kit.parallel.vision import shard_vision_batch

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        group = sequence_parallel_group(mesh_layout(2, StrategyConfig(), context_parallel_size=2))
        model = tiny_vl_model()
        apply_ulysses(model, group, "text_config")
        apply_vision_ulysses(model, group)
        batch = left_padded(model.config.get_text_config().vocab_size)
        sharded = shard_vision_batch({**batch, "labels": batch["input_ids"]}, group)
        with torch.no_grad():
            got = model(input_ids=sharded["input_ids"], attention_mask=sharded["attention_mask"]).logits
        local = token_order(16, 2, 1)[rank, 0]
        real = batch["attention_mask"].bool()[:, local]
        results[rank] = ((got - want[:, local])[real].abs().max().item(), tuple(local.tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_vision_language_model_under_context_parallel_keeps_left_padding_masked():
    """Context parallel 2 on 2 ranks: each rank holds a front chunk and its mirror of the merged sequence; the logits
    of its real tokens equal transformers' model's on the whole left-padded batch (the padding masked out as keys in
    the rectangular mask over the gathered keys)."""
    import torch.multiprocessing as mp

    from fsdp2kit.distributed import free_port

    reference = tiny_vl_model()
    with torch.no_grad():
        want = reference(**left_padded(reference.config.get_text_config().vocab_size)).logits
    results = mp.Manager().dict()
    mp.spawn(_context_parallel_rank, args=(free_port(), want, results), nprocs=2)
    assert results[0][1] == (0, 1, 2, 3, 12, 13, 14, 15) and results[1][1] == (4, 5, 6, 7, 8, 9, 10, 11)
    assert max(results[0][0], results[1][0]) < 1e-5, dict(results)
