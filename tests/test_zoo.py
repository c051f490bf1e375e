"""Every causal-LM family of tests/zoo_case.py's table, as a user meets it: a folder written by transformers'
`save_pretrained`, loaded through fsdp2kit's loading path. Per family: forward_step's log-probs equal transformers'
(which pins what the chunked head must apply after the LM head: Cohere's scale, Granite's divisor, Gemma's cap),
one step's loss and gradient norm equal transformers' own backward, the export loads in transformers with the
trained model's log-probs; and 2 ranks with a micro-batch each equal 1 rank accumulating both (one 2-rank launch
for all families). A model that transforms its logits in a way fsdp2kit does not reproduce is refused at build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import launch_two_ranks
from strategy_case import clip_grad_norm_exact
from zoo_case import (
    FAMILIES,
    TINY,
    Family,
    family_folder,
    next_token_loss,
    probe_batch,
    train_and_score,
    zoo_batches,
    zoo_config,
)

import fsdp2kit
from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError

# Each family's one-rank results, kept for the 2-rank comparison (which computes any that are missing).
ONE_RANK: dict[str, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zoo")
    for family in FAMILIES:
        family_folder(root, family)
    return root


def one_rank(config: dict[str, Any], export: Path | None = None) -> dict[str, Any]:
    """The family trained one step in this process (a world of one) accumulating both micro-batches, with the
    default loss written as a loss_fn (the 2-rank run takes the default: both backward paths of the chunked head)."""
    try:
        strategy = fsdp2kit.Strategy.from_config(config)
        result = train_and_score(strategy, zoo_batches(2), next_token_loss)
        if export is not None:
            strategy.export_hf(export)
        return result
    finally:
        shutdown()


def hf_log_probs(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def hf_step(folder: Path) -> tuple[float, float]:
    """transformers' own token-mean cross-entropy over both micro-batches (padding excluded) and its gradient norm."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    total, count = torch.zeros(()), 0
    for batch in zoo_batches(2):
        keep = batch["attention_mask"][:, 1:].bool()
        total = total - hf_log_probs(model, batch)[keep].sum()
        count += int(keep.sum())
    loss = total / count
    loss.backward()
    norm = clip_grad_norm_exact(model.parameters(), float("inf"))
    return loss.item(), norm.item()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_family_equals_transformers(zoo: Path, family: Family, tmp_path: Path):
    from transformers import AutoModelForCausalLM

    folder = zoo / family.name
    got = ONE_RANK[family.name] = one_rank(zoo_config(folder, tmp_path / "run"), tmp_path / "hf")
    with torch.no_grad():
        original = hf_log_probs(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), probe_batch())
        exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
        trained = hf_log_probs(exported, probe_batch())
    torch.testing.assert_close(got["before"], original, rtol=0, atol=1e-4)
    loss, grad_norm = hf_step(folder)
    assert got["loss"] == pytest.approx(loss, abs=1e-5)
    assert got["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert (got["after"] - got["before"]).abs().max() > 0.05  # it trained
    torch.testing.assert_close(got["after"], trained, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_accumulating(zoo: Path, tmp_path: Path):
    """One torchrun launch trains every family at 2 ranks, each with one of the two micro-batches, and scores the
    probe batch with the two ranks as a Ulysses pair (around sdpa, or eager for Gemma2)."""
    out = tmp_path / "two_ranks.pt"
    launch_two_ranks("zoo_worker.py", zoo, out)
    two_ranks = torch.load(out)
    real = probe_batch()["attention_mask"][:, 1:].bool()  # Ulysses leaves right padding unmasked: its scores differ
    for family in FAMILIES:
        one = ONE_RANK.get(family.name) or one_rank(zoo_config(zoo / family.name, tmp_path / family.name))
        two = two_ranks[family.name]
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-5), family.name
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-6), family.name
        torch.testing.assert_close(two["after"], one["after"], rtol=0, atol=1e-5, msg=family.name)
        ulysses, alone = two["ulysses"][real], one["before"][real]
        torch.testing.assert_close(ulysses, alone, rtol=0, atol=1e-5, msg=f"{family.name} ulysses")


SCALED_LLAMA = '''
from transformers import LlamaForCausalLM


class ScaledLlama(LlamaForCausalLM):
    """A family that multiplies its logits by 3 after the head, in its own forward (no config key says so)."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 3
        return output
'''


def test_a_family_whose_logits_the_chunks_miss_is_refused_at_build(zoo: Path, tmp_path: Path):
    """The build-time probe: the chunked head's log-probs differ from the model's own, so the model is refused in
    one line naming it, before any step could train on wrong log-probs."""
    (tmp_path / "scaled_llama.py").write_text(SCALED_LLAMA)
    config = zoo_config(zoo / "llama", tmp_path / "run")
    config["model"]["model_class"] = f"{tmp_path / 'scaled_llama.py'}:ScaledLlama"
    with pytest.raises(UserError) as refused:
        one_rank(config)
    message = str(refused.value)
    assert "\n" not in message and "ScaledLlama" in message and str(zoo / "llama") in message
    assert "transforms its logits after the LM head" in message


def test_attention_is_transformers_choice_unless_one_is_named(zoo: Path, tmp_path: Path):
    """By default a model runs the attention transformers picks for it (Gemma2: eager on 5.24, which has no SDPA
    path for it; sdpa on 5.2 and 5.10), which check names; asking for sdpa where the family has none is one line
    naming the key (it was the forced default, and every Gemma2 was refused)."""
    from conftest import process_group
    from transformers import AutoConfig, AutoModelForCausalLM, Gemma2ForCausalLM

    from fsdp2kit.check import describe
    from fsdp2kit.config.load import validate

    theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(zoo / "gemma2")).config._attn_implementation
    config = zoo_config(zoo / "gemma2", tmp_path / "run")
    with process_group(1) as runtime:
        assert describe(validate(config, "config"), runtime)["attn_implementation"] == theirs
    if Gemma2ForCausalLM._supports_sdpa:
        pytest.skip("this transformers' Gemma2 has an SDPA path (5.24's has none): no attention to refuse")
    config["model"]["attn_implementation"] = "sdpa"
    with pytest.raises(UserError) as refused:
        one_rank(config)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("model.attn_implementation: sdpa is not an attention")
    assert "Gemma2ForCausalLM" in message and "valid: auto" in message


def test_ulysses_refuses_an_attention_it_cannot_wrap():
    """Ulysses attends over the gathered sequence with the family's sdpa or eager; any other implementation the model
    runs (here flex_attention) is one line, not a wrapper that would call eager without its mask."""
    import torch.distributed as dist
    from conftest import process_group
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2kit.parallel.ulysses import apply_ulysses

    config = AutoConfig.for_model("llama", vocab_size=64, head_dim=8, **TINY)
    config._attn_implementation = "flex_attention"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    with process_group(2), pytest.raises(UserError) as refused:
        apply_ulysses(model, dist.new_group([0, 1]))
    assert str(refused.value) == (
        "model.attn_implementation: flex_attention cannot run inside Ulysses (model.ulysses_size = 2), which attends "
        "over the gathered sequence with sdpa or eager; set auto, sdpa or eager"
    )
