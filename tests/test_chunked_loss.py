"""`training.loss_chunk_tokens`: the LM head and the cross-entropy over chunks of tokens give the same loss and
gradients as the whole logits at once, and a step's tracked peak falls to a fraction of the unchunked one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_strategy import strategy, tiny_llama
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

from fsdp2kit.parallel.token_logprobs import chunk_tokens

VOCAB = 40000  # above 32k: chunked by default


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("chunked") / "model", vocab=VOCAB, layers=1)


def config(model_dir: Path, chunk: int | str, attention: str = "sdpa") -> dict:
    return {
        "model": {"name_or_path": str(model_dir), "attn_implementation": attention},
        "training": {
            "learning_rate": 1e-3,
            "max_steps": 2,
            "lr_scheduler_type": "constant",
            "loss_chunk_tokens": chunk,
        },
    }


def batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, : length // 4] = -100  # a prompt that is no target
    return {"input_ids": ids, "labels": labels}


def test_auto_chunks_only_large_vocabularies():
    assert chunk_tokens("auto", 32000) == 0 and chunk_tokens("auto", 151936) == 1536 and chunk_tokens(64, 100) == 64


def step_with_gradients(model_dir: Path, chunk: int, attention: str = "sdpa") -> tuple[dict, dict[str, torch.Tensor]]:
    """One step's result and the gradients the optimizer was given."""
    grads: dict[str, torch.Tensor] = {}
    with strategy(config(model_dir, chunk, attention)) as s:
        names = {id(p): n for n, p in s.model.named_parameters()}

        def keep_grads(optimizer: torch.optim.Optimizer, *_: object) -> None:
            grads.update({names[id(p)]: p.grad.clone() for g in optimizer.param_groups for p in g["params"]})

        s.optimizer.register_step_pre_hook(keep_grads)
        return s.train_step([batch(2, 100)]), grads


def test_chunked_loss_and_gradients_equal_the_whole_logits(model_dir):
    results = [step_with_gradients(model_dir, chunk) for chunk in (0, 48)]
    (whole, whole_grads), (chunked, chunked_grads) = results
    assert chunked["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    assert chunked["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-6)
    assert sorted(chunked_grads) == sorted(whole_grads)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-8, msg=name)


def step_peak(model_dir: Path, chunk: int) -> tuple[int, float]:
    with strategy(config(model_dir, chunk)) as s:
        tracker = FSDPMemTracker(s.model, s.optimizer)
        with tracker:
            loss = s.train_step([batch(1, 1024)])["loss"]
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]), loss


def test_a_chunked_step_peaks_at_a_fraction_of_the_unchunked_one(model_dir):
    (whole, whole_loss), (chunked, chunked_loss) = step_peak(model_dir, 0), step_peak(model_dir, 128)
    assert chunked_loss == pytest.approx(whole_loss, abs=1e-6)
    assert chunked <= 0.5 * whole, f"chunked {chunked / 2**20:.0f} MiB vs whole {whole / 2**20:.0f} MiB"


@pytest.fixture(scope="module")
def softcapped_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Gemma-2 whose logits are soft-capped hard (cap 0.5), so a chunked head that ignored the cap would
    be far off."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from fsdp2kit.data.builtin import tokenizer_dir

    folder = tmp_path_factory.mktemp("softcap") / "model"
    config = AutoConfig.for_model(
        "gemma2",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=0.5,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir()).save_pretrained(folder)
    return folder


def test_soft_capped_logits_are_capped_in_the_chunks(softcapped_dir):
    """Gemma's final_logit_softcapping: chunked loss, gradients and forward_step log-probs equal the model's own."""
    from transformers import AutoModelForCausalLM

    (whole, whole_grads), (chunked, chunked_grads) = (step_with_gradients(softcapped_dir, c, "eager") for c in (0, 48))
    assert chunked["loss"] == pytest.approx(whole["loss"], abs=1e-6)
    for name, grad in whole_grads.items():  # float32 rounding of the cap's slope: 1e-6 of each tensor's scale
        scale = float(grad.abs().max())
        torch.testing.assert_close(chunked_grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)
    ids = batch(2, 40)["input_ids"]
    with strategy(config(softcapped_dir, 16, "eager")) as s:
        got = s.forward_step({"input_ids": ids})["log_probs"]
    model = AutoModelForCausalLM.from_pretrained(
        softcapped_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1].float()
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_soft_capped_log_probs_keep_the_caps_slope_for_backward(softcapped_dir):
    """Gemma's soft-cap under log-probs kept from the forward: the kept slope (1 - tanh^2) gives the gradients the
    chunks give when they recompute their logits in backward, exactly, at a temperature per sample."""
    from transformers import AutoModelForCausalLM

    from fsdp2kit.parallel.token_logprobs import TokenRequest, install_token_head, token_request

    ids = batch(2, 24)["input_ids"]
    weights = torch.rand(2, 23, generator=torch.Generator().manual_seed(1))
    grads = []
    for kept_bytes in (0, 1 << 30):
        model = AutoModelForCausalLM.from_pretrained(softcapped_dir, dtype=torch.float32, attn_implementation="eager")
        install_token_head(model)
        request = TokenRequest(ids[:, 1:], 16, True, temperature=torch.tensor([0.7, 1.3]), kept_bytes=kept_bytes)
        with token_request(model, request):
            log_probs = model(input_ids=ids[:, :-1]).logits
        assert request.entropies is not None
        ((log_probs * weights).sum() + (request.entropies * weights.flip(-1)).sum()).backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("ignored", ["prompt and padding", "all", "none"])
def test_the_head_runs_on_targeted_tokens_alone_with_the_whole_logits_loss_and_gradients(ignored):
    """Tokens without a target (a prompt, padding) get no logits: the head's chunks see only the targeted rows, and
    the loss and the gradients (zero at the untargeted rows) are those of the whole logits' cross-entropy."""
    from torch.nn.functional import cross_entropy, linear

    from fsdp2kit.parallel.linear_cross_entropy import linear_cross_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (40,), generator=generator)
    if ignored != "none":
        targets[:10] = -100  # a prompt
        targets[30:] = -100  # padding
    if ignored == "all":
        targets[:] = -100
    rows_seen: list[int] = []

    def logits_of(part: torch.Tensor) -> tuple[torch.Tensor, None]:
        rows_seen.append(part.shape[0])
        return linear(part, weight), None  # float64: exact to rounding

    loss = linear_cross_entropy(hidden, weight, None, targets, 8, logits_of)
    loss.backward()
    ours = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad, weight.grad = None, None
    expected = cross_entropy(linear(hidden, weight), targets, ignore_index=-100, reduction="sum")
    expected.backward()
    targeted = int((targets != -100).sum())
    assert sum(rows_seen) == (targeted or 40)  # every row only where no token has a target (the loss is 0 there)
    torch.testing.assert_close(ours[0].double(), expected.detach(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours[1], hidden.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours[2], weight.grad, rtol=1e-10, atol=1e-12)
    assert not ours[1][targets == -100].any()
