"""Remove-padding (`model.remove_padding`) and token-budget micro-batches (`max_tokens`) in the Strategy API, held
to the padded computation of plain transformers (fp32, 1e-5): log-probs (0 where token t or t+1 is padding),
entropies, a per-sample temperature, the loss and every parameter's gradient; at 1 rank in-process, and at 2 ranks
(data-parallel, Ulysses 2, and token budgets that give the ranks unequal micro-batch counts) in one launch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import launch_two_ranks
from packing_worker import BUDGET, config, padded_batch, step_gradients
from strategy_case import policy_loss
from test_strategy import strategy, tiny_llama

from fsdp2kit.errors import UserError
from fsdp2kit.parallel import document_attention
from fsdp2kit.parallel.document_attention import DOCUMENT_FLEX
from fsdp2kit.train.packing import split_rows

Batch = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("packing") / "model")


def scored(batch: Batch) -> torch.Tensor:
    """Where a shifted output is defined without padding: token t and t+1 both real."""
    mask = batch["attention_mask"].bool()
    return mask[:, :-1] & mask[:, 1:]


def reference(model_dir: Path, batches: list[Batch], temperature: torch.Tensor | None = None) -> dict:
    """The padded computation in plain transformers: each batch's log-probs and entropies (at `temperature`, one
    per sample), and the loss sum(loss_sum) / sum(weight) over the batches with its gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sums, weights, log_probs, entropies = [], [], [], []
    for batch in batches:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        if temperature is not None:
            logits = logits / temperature[:, None, None]
        log_softmax = torch.log_softmax(logits, -1)
        picked = log_softmax.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        loss_sum, weight = policy_loss(picked, batch)
        sums.append(loss_sum)
        weights.append(weight)
        log_probs.append(picked.detach())
        entropies.append(-(log_softmax.exp() * log_softmax).sum(-1).detach())
    loss = torch.stack(sums).sum() / torch.stack(weights).sum()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "log_probs": log_probs, "entropy": entropies}


def assert_outputs(got: torch.Tensor, expected: torch.Tensor, batch: Batch) -> None:
    """Equal where defined, exactly 0 at padding (the padded computation has values there)."""
    torch.testing.assert_close(got, expected * scored(batch), rtol=0, atol=1e-5)


def assert_step(step: tuple[dict, dict[str, torch.Tensor]], expected: dict) -> None:
    result, grads = step
    assert result["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert sorted(grads) == sorted(expected["grads"])
    for name, grad in expected["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5, msg=name)


def test_packed_and_budgeted_steps_equal_the_padded_computation(model_dir, tmp_path):
    batches = [padded_batch(0), padded_batch(1)]
    expected = reference(model_dir, batches)
    temperature = torch.tensor([0.5, 1.0, 2.0, 0.7])
    tempered = reference(model_dir, batches[:1], temperature)
    parts = sum(len(split_rows(batch, BUDGET)) for batch in batches)
    assert parts > len(batches)  # the budget does cut the batches
    with strategy(config(str(model_dir), str(tmp_path), remove_padding=True)) as s:
        widths: list[tuple[int, ...]] = []
        s.model.register_forward_pre_hook(
            lambda _, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
        )
        out = s.forward_step(batches[0], entropy=True)
        assert widths == [(1, int(batches[0]["attention_mask"].sum()))]  # one stream of the real tokens
        assert_outputs(out["log_probs"], expected["log_probs"][0], batches[0])
        assert_outputs(out["entropy"], expected["entropy"][0], batches[0])
        assert_outputs(
            s.forward_step(batches[0], temperature=temperature)["log_probs"], tempered["log_probs"][0], batches[0]
        )
        assert_step(step_gradients(s, lambda: s.train_step(batches, policy_loss)), expected)
        widths.clear()
        assert_step(step_gradients(s, lambda: s.train_step(batches, policy_loss, max_tokens=BUDGET)), expected)
        assert len(widths) == parts and all(shape[1] <= BUDGET or shape[0] == 1 for shape in widths)
        budgeted = s.forward_step(batches[0], max_tokens=BUDGET)["log_probs"]
        assert_outputs(budgeted, expected["log_probs"][0], batches[0])
        s.cfg.model.remove_padding = False  # the same model, padded: a budget alone cuts the rows
        assert_step(step_gradients(s, lambda: s.train_step(batches, policy_loss, max_tokens=BUDGET)), expected)
        right_padded = {key: batches[1][key][2:] for key in ("input_ids", "attention_mask")}  # no left pad
        padded_loss = s.train_step([right_padded])["loss"]  # the default cross-entropy
        s.cfg.model.remove_padding = True
        assert s.train_step([right_padded])["loss"] == pytest.approx(padded_loss, abs=1e-6)
        holed = {**batches[0], "attention_mask": batches[0]["attention_mask"].clone()}
        holed["attention_mask"][1, 7] = 0
        with pytest.raises(UserError, match="one run of 1s per row"):
            s.forward_step(holed)


def test_packed_rows_through_flex_attention_equal_the_padded_computation(model_dir, tmp_path, monkeypatch):
    """Where the build picks FlexAttention for packed documents (CUDA; forced here, forward only: torch has no CPU
    backward for it), forward_step's stream goes through its block mask and equals the padded computation."""
    monkeypatch.setattr(document_attention, "document_path", lambda *_: (DOCUMENT_FLEX, "as on CUDA"))
    batch = padded_batch(0)
    expected = reference(model_dir, [batch])
    with strategy(config(str(model_dir), str(tmp_path), remove_padding=True)) as s:
        assert s.model.config._attn_implementation == DOCUMENT_FLEX
        out = s.forward_step(batch, entropy=True)
    assert_outputs(out["log_probs"], expected["log_probs"][0], batch)
    assert_outputs(out["entropy"], expected["entropy"][0], batch)


def test_packed_value_and_reward_models_equal_the_padded_computation(tmp_path):
    """A critic's values [B, T] (0 at padding) and its clipped value loss's gradients, a reward model's scores [B]
    (read at each row's last real token), packed, equal transformers' padded forward."""
    from test_value_models import value_model
    from value_case import MODEL_CLASSES, load_reference, outputs, value_loss

    batch = padded_batch(0)
    generator = torch.Generator().manual_seed(5)
    batch["returns"] = torch.randn(batch["token_weights"].shape, generator=generator)
    batch["old_values"] = batch["returns"] + 0.5 * torch.randn(batch["token_weights"].shape, generator=generator)
    for kind, output in (("critic", "values"), ("reward", "scores")):
        folder = value_model(tmp_path / kind, kind)
        model = load_reference(kind, folder)
        padded = outputs(model, batch)
        cfg = config(str(folder), str(tmp_path / f"{kind}-run"), remove_padding=True)
        cfg["model"]["model_class"] = MODEL_CLASSES[kind]
        with strategy(cfg) as s:
            got = s.forward_step(batch)[output]
            if kind == "critic":
                step = step_gradients(s, lambda: s.train_step([batch], value_loss))
        if kind == "reward":
            torch.testing.assert_close(got, padded, rtol=0, atol=1e-5)
            continue
        torch.testing.assert_close(got, padded * batch["attention_mask"], rtol=0, atol=1e-5)
        loss_sum, weight = value_loss(padded, batch)
        (loss_sum / weight).backward()
        grads = {name: p.grad for name, p in model.named_parameters()}
        assert_step(step, {"loss": (loss_sum / weight).item(), "grads": grads})


@pytest.mark.slow
def test_packed_and_budgeted_steps_at_two_ranks_and_ulysses(model_dir, tmp_path):
    """One launch: remove-padding at 2 data-parallel ranks (a share each) and under Ulysses 2 (the whole batch), and
    token budgets where rank 0 needs more micro-batches than rank 1 (no hang; the global loss and gradients)."""
    whole, second = padded_batch(0), padded_batch(1, rows=2)
    assert len(split_rows(whole, BUDGET)) > len(split_rows(second, BUDGET))
    out = tmp_path / "out.pt"
    launch_two_ranks("packing_worker.py", model_dir, out, timeout=300)
    seen = torch.load(out, weights_only=False)
    # the data-parallel steps attended each packed stream by documents (the CPU's path), never through the dense
    # mask (a stream of one document needs none); the reference is the padded computation
    masked = [call for call in seen["by_documents"] if call is not None]
    assert seen["dp_attention"] == "document_sdpa" and masked and all(masked)
    expected = reference(model_dir, [whole])
    rank_zero = {k: v[:2] for k, v in whole.items()}
    assert_outputs(seen["dp_log_probs"], expected["log_probs"][0][:2], rank_zero)
    assert_step(seen["dp"], expected)
    assert_outputs(seen["sp_log_probs"]["log_probs"], expected["log_probs"][0], whole)
    assert_outputs(seen["sp_log_probs"]["entropy"], expected["entropy"][0], whole)
    assert_step(seen["sp"], expected)
    assert_outputs(seen["budget_log_probs"], expected["log_probs"][0], whole)
    assert_step(seen["budget"], reference(model_dir, [whole, second]))
    parts = len(split_rows(whole, BUDGET)) + len(split_rows(second, BUDGET))  # rank 1's empty ones not counted
    assert seen["budget"][0]["metrics"]["rows"] == pytest.approx(6 / parts)


def test_packed_scores_and_values_with_another_padding_id_than_pad_token_id(tmp_path):
    """Issue 42 (1): a reward model whose pad_token_id is 2, on rows padded with 0 (as collators and verl pad) with an
    attention_mask. Left-padded rows and rows padded with pad_token_id read their score at a real token: packed, it
    equals the padded computation. Right-padded rows with 0 read it at a padding position, which packing does not
    compute (it gave exactly 0.0): refused in one line, in forward_step and train_step; padded, they are
    transformers'. A critic's values at the real tokens equal the padded computation for either padding."""
    from conftest import make_hf_folder
    from test_value_models import SMALL
    from value_case import AUTO_CLASSES, MODEL_CLASSES, load_reference, outputs

    pad = 2
    mask = torch.tensor([[1] * 7 + [0] * 3, [1] * 10, [1] * 4 + [0] * 6])
    ids = torch.randint(3, 512, mask.shape, generator=torch.Generator().manual_seed(1))
    right = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
    left = {key: value.flip(1) for key, value in right.items()}
    with_pad_id = {"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask}
    for kind, output in (("reward", "scores"), ("critic", "values")):
        folder = tmp_path / kind
        settings = {"num_labels": 1, "pad_token_id": pad, "vocab_size": 512, **SMALL}
        make_hf_folder(folder, "tiny-llama", auto_class=AUTO_CLASSES[kind], **settings)
        model = load_reference(kind, folder)
        cfg = config(str(folder), str(tmp_path / f"{kind}-run"), remove_padding=True)
        cfg["model"]["model_class"] = MODEL_CLASSES[kind]
        with strategy(cfg) as s:
            for batch in (left, with_pad_id) if kind == "reward" else (left, right, with_pad_id):
                padded = outputs(model, batch)
                got = s.forward_step(batch)[output]
                expected = padded if kind == "reward" else padded * batch["attention_mask"]
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
            if kind == "critic":
                continue
            refusal = "row 0's score is read at its last token that is not pad_token_id 2 (position 9), which"
            with pytest.raises(UserError, match=re.escape("forward_step: model.remove_padding computes only")):
                s.forward_step(right)
            with pytest.raises(UserError, match=re.escape(refusal)):
                s.train_step([right], lambda scores, batch: (scores.sum(), torch.tensor(1.0)))
            s.cfg.model.remove_padding = False
            torch.testing.assert_close(s.forward_step(right)[output], outputs(model, right), rtol=0, atol=1e-5)
