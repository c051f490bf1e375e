"""`fsdp2kit.Strategy` driven the way an RL loop drives it: forward_step before train_step, left-padded prompts under
Ulysses, a plain transformers model in the same process, weights streamed to a rollout engine, the caller's RNG,
unequal micro-batch counts, int32 ids; and the loss contract RL algorithms use (temperature, entropy with autograd,
metrics, the weight without a second call). Each is held against the same computation by plain transformers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from rl_case import (
    CLIP,
    ENTROPY_COEF,
    applied_gradients,
    clipped_config,
    entropy_bonus_loss,
    largest_difference,
    metric_loss,
    plain_outputs,
    plain_step,
    update_norm,
)
from strategy_case import clip_grad_norm_exact, global_micro_batches, policy_loss
from test_strategy import strategy, tiny_llama

from fsdp2kit.distributed import COLLECTIVE_TIMEOUT_ENV, free_port
from fsdp2kit.errors import UserError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("strategy_rl") / "model")


def test_forward_step_then_train_step_clips_every_parameter(model_dir, tmp_path):
    """The no-grad forward left root parameters unsharded; the step's norm and clipping missed them while the
    optimizer updated them. The gradients the optimizer steps with are the plain model's clipped ones."""
    batches = global_micro_batches(0, 2)
    expected = plain_step(str(model_dir), batches, policy_loss)
    with strategy(clipped_config(str(model_dir), str(tmp_path), 1)) as s:
        s.forward_step(batches[0])
        with applied_gradients(s) as grads:
            result = s.train_step(batches, policy_loss)
    assert expected["grad_norm"] > CLIP  # clipping acts
    assert result["grad_norm"] == pytest.approx(expected["grad_norm"], abs=1e-5)
    assert update_norm(grads) == pytest.approx(CLIP, abs=1e-5)
    assert largest_difference(grads, expected["grads"]) < 1e-5


def test_the_loss_contract_equals_plain_pytorch(model_dir, tmp_path):
    """Per-sample temperatures, an entropy bonus with autograd and returned metrics: the loss, the clipped gradients
    and the metrics (averaged over micro-batches) are those of transformers' whole logits; the loss is called once
    per micro-batch."""
    batches = global_micro_batches(1, 2)
    batches[0]["temperature"] = torch.tensor([0.7, 1.3])
    batches[1]["temperature"] = torch.tensor([0.9, 0.9])
    calls = []

    def loss(log_probs, batch, entropy):
        calls.append(log_probs.detach().clone())
        loss_sum, weight = entropy_bonus_loss(log_probs, batch, entropy)
        return loss_sum, weight, {"entropy_mean": entropy.detach().mean()}

    expected = plain_step(str(model_dir), batches, entropy_bonus_loss)
    with strategy(clipped_config(str(model_dir), str(tmp_path), 1)) as s:
        with applied_gradients(s) as grads:
            result = s.train_step(batches, loss)
    assert len(calls) == 2 and all(c.abs().sum() > 0 for c in calls)  # never on zeros
    assert result["loss"] == pytest.approx(expected["loss"], abs=1e-5)
    assert result["grad_norm"] == pytest.approx(expected["grad_norm"], abs=1e-5)
    assert largest_difference(grads, expected["grads"]) < 1e-5
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        entropies = [
            plain_outputs(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b)[1]
            for b in batches
        ]
    assert result["metrics"]["entropy_mean"] == pytest.approx(sum(e.mean().item() for e in entropies) / 2, abs=1e-5)
    assert ENTROPY_COEF > 0


@pytest.mark.parametrize("kept_bytes", [0, 1 << 30], ids=["recomputed in backward", "kept from the forward"])
def test_chunked_entropy_and_log_probs_have_the_plain_gradients(model_dir, kept_bytes, monkeypatch):
    """Through the chunked LM head (chunks of 5 tokens, a temperature per sample), a loss of entropies and log-probs
    gives every parameter the gradient that a log-softmax over the whole logits gives, within 1e-5: with each
    chunk's logits recomputed in backward, and with them kept from the forward (the head's matmul once a chunk)."""
    from transformers import AutoModelForCausalLM

    from fsdp2kit.parallel import token_logprobs
    from fsdp2kit.parallel.token_logprobs import TokenRequest, install_token_head, token_request

    ids = global_micro_batches(0, 1)[0]["input_ids"]
    temperature = torch.tensor([0.6, 1.7])
    weights = torch.rand(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(5))
    head_matmuls = []
    chunk_logits = token_logprobs._logits
    monkeypatch.setattr(token_logprobs, "_logits", lambda *args: head_matmuls.append(1) or chunk_logits(*args))
    grads = []
    for chunked in (False, True):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if chunked:
            install_token_head(model)
            request = TokenRequest(ids[:, 1:], 5, entropy=True, temperature=temperature, kept_bytes=kept_bytes)
            with token_request(model, request):
                log_probs = model(input_ids=ids[:, :-1]).logits
            entropy = request.entropies
        else:
            logits = model(input_ids=ids).logits
            log_probs, entropy = plain_outputs(logits, {"input_ids": ids, "temperature": temperature})
        ((entropy * weights).sum() + (log_probs * weights.flip(-1)).sum()).backward()
        grads.append({name: param.grad for name, param in model.named_parameters()})
    assert largest_difference(grads[1], grads[0]) < 1e-5
    assert max(g.abs().max().item() for g in grads[0].values()) > 1e-2  # gradients worth comparing
    chunks = -(-ids[:, 1:].numel() // 5)
    assert len(head_matmuls) == (chunks if kept_bytes else 2 * chunks)


def test_kept_logits_cannot_be_backpropagated_twice(model_dir):
    """Backward turns the kept log-softmax into the gradient in place: a second backward through the same graph
    is autograd's error, never a gradient computed from the spent tensor."""
    from transformers import AutoModelForCausalLM

    from fsdp2kit.parallel.token_logprobs import TokenRequest, install_token_head, token_request

    ids = global_micro_batches(0, 1)[0]["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    install_token_head(model)
    with token_request(model, TokenRequest(ids[:, 1:], 5, kept_bytes=1 << 30)):
        loss = model(input_ids=ids[:, :-1]).logits.sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_kept_logits_budget_is_what_one_chunk_may_take():
    """auto and 0: 1 GiB of float32 logits; an explicit loss_chunk_tokens N: N tokens' logits, so that a request of
    several chunks recomputes (its peak stays one chunk's) and a request of one keeps."""
    from fsdp2kit.parallel.linear_cross_entropy import LOGITS_BUDGET_BYTES
    from fsdp2kit.parallel.token_logprobs import kept_logits_budget

    assert kept_logits_budget("auto", 151_936) == kept_logits_budget(0, 512) == LOGITS_BUDGET_BYTES
    assert kept_logits_budget(1024, 151_936) == 1024 * 151_936 * 4


def test_metrics_are_averaged_over_micro_batches(model_dir, tmp_path):
    batches = global_micro_batches(2, 2)
    expected = plain_step(str(model_dir), batches, metric_loss)
    with strategy(clipped_config(str(model_dir), str(tmp_path), 1)) as s:
        result = s.train_step(batches, metric_loss)
    for name in ("log_prob_mean", "weight"):
        mean = sum(m[name].item() for m in expected["metrics"]) / 2
        assert result["metrics"][name] == pytest.approx(mean, abs=1e-5), name


def test_forward_step_at_a_temperature(model_dir, tmp_path):
    """A scalar and a per-sample temperature divide the logits before the softmax, for log-probs and entropy."""
    from transformers import AutoModelForCausalLM

    batch = global_micro_batches(0, 1)[0]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    with strategy(clipped_config(str(model_dir), str(tmp_path), 1)) as s:
        for temperature in (0.6, torch.tensor([0.5, 2.0])):
            got = s.forward_step(batch, entropy=True, temperature=temperature)
            log_probs, entropy = plain_outputs(logits, {**batch, "temperature": temperature})
            torch.testing.assert_close(got["log_probs"], log_probs, rtol=0, atol=1e-5)
            torch.testing.assert_close(got["entropy"], entropy, rtol=0, atol=1e-5)
        with pytest.raises(UserError, match="temperature"):
            s.forward_step({**batch, "temperature": 0.5}, temperature=0.7)
        with pytest.raises(UserError, match="temperature"):
            s.forward_step(batch, temperature=torch.tensor([1.0, 0.0]))


def test_full_weights_at_one_rank_are_a_snapshot(model_dir, tmp_path):
    """A rollout engine holding the streamed tensors must not see the next step change them in place."""
    batch = global_micro_batches(0, 1)
    with strategy(clipped_config(str(model_dir), str(tmp_path), 2)) as s:
        held = dict(s.full_weights())
        before = {name: tensor.clone() for name, tensor in held.items()}
        s.train_step(batch, policy_loss)
        after = dict(s.full_weights())
    assert all(torch.equal(held[name], before[name]) for name in before)
    assert any(not torch.equal(after[name], before[name]) for name in before)  # it trained


def test_from_config_keeps_the_callers_rng(model_dir, tmp_path):
    torch.manual_seed(4321)
    state = torch.get_rng_state()
    with strategy(clipped_config(str(model_dir), str(tmp_path), 1)):
        assert torch.equal(torch.get_rng_state(), state)


def test_int32_ids_are_accepted(model_dir, tmp_path):
    batch = global_micro_batches(0, 1)[0]
    narrow = {**batch, "input_ids": batch["input_ids"].int()}
    with strategy(clipped_config(str(model_dir), str(tmp_path), 2)) as s:
        torch.testing.assert_close(s.forward_step(narrow)["log_probs"], s.forward_step(batch)["log_probs"])
        assert s.train_step([narrow], policy_loss)["applied"]


def test_a_step_with_nothing_to_minimise_is_refused(model_dir, tmp_path):
    """Every weight 0 made loss = nan, applied = False, silently."""
    batch = global_micro_batches(0, 1)[0]
    with strategy(clipped_config(str(model_dir), str(tmp_path), 1)) as s:
        with pytest.raises(UserError, match="weight"):
            s.train_step([batch], lambda log_probs, b: (log_probs.sum() * 0, torch.zeros(())))
        with pytest.raises(UserError, match="weight"):
            s.train_step([batch], lambda log_probs, b: (log_probs.sum(), log_probs.sum()))  # a weight with gradient
        with pytest.raises(UserError, match="temperature"):
            s.train_step([{**batch, "temperature": 0.5}])  # the default cross-entropy takes none


@pytest.fixture(scope="module")
def two_ranks(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """tests/strategy_rl_worker.py at 2 ranks (one launch for every 2-rank claim), with a collective timeout of
    20 s: what each rank measured."""
    out = tmp_path_factory.mktemp("strategy_rl_two") / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(REPO / "tests" / "strategy_rl_worker.py"), str(model_dir)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env |= {"OMP_NUM_THREADS": "1", COLLECTIVE_TIMEOUT_ENV: "20"}
    result = subprocess.run([*command, str(out)], env=env, capture_output=True, text=True, timeout=300)
    measured = [
        torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(2) if Path(f"{out}.rank{rank}").exists()
    ]
    assert len(measured) == 2, result.stderr[-3000:]
    for rank in measured:
        rank["returncode"], rank["stderr"] = result.returncode, result.stderr[-3000:]
    return measured


@pytest.mark.slow
def test_forward_step_then_train_step_clips_every_parameter_at_two_ranks(two_ranks):
    for rank in two_ranks:
        assert "data_parallel_failure" not in rank, rank["data_parallel_failure"]
        got, expected = rank["grad_norm"]
        assert got == pytest.approx(expected, abs=1e-5)
        assert rank["update_norm"] == pytest.approx(CLIP, abs=1e-5)
        assert rank["grad_error"] < 1e-5


@pytest.mark.slow
def test_metrics_are_averaged_over_ranks(two_ranks):
    for rank in two_ranks:
        assert "metrics_failure" not in rank, rank["metrics_failure"]
        got, expected = rank["metrics"]
        assert got == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
def test_ulysses_with_left_padded_prompts_equals_the_padded_computation(two_ranks):
    for rank in two_ranks:
        assert "ulysses_failure" not in rank, rank["ulysses_failure"]
        assert rank["left_padded_error"] < 1e-5


@pytest.mark.slow
def test_ulysses_leaves_other_models_of_the_process_alone(two_ranks):
    for rank in two_ranks:
        assert "ulysses_failure" not in rank, rank["ulysses_failure"]
        assert rank["plain_model_error"] < 1e-5


@pytest.mark.slow
def test_unequal_micro_batch_counts_are_one_error_on_every_rank(two_ranks):
    """They hung (until the collective timeout, which the launch sets to 20 s)."""
    for rank in two_ranks:
        assert rank.get("unequal_error") is not None, rank.get("unequal_failure") or rank["stderr"]
        assert "micro-batch" in rank["unequal_error"] and rank["unequal_seconds"] < 10


@pytest.mark.slow
def test_a_batch_one_rank_refuses_is_the_same_error_on_every_rank(two_ranks):
    """A batch only rank 1 refuses (train_step: an id outside the vocabulary; forward_step: no rows) was rank 1's
    error while rank 0 waited in the step's collectives until the timeout; a loss_fn failing at micro-batch 1 (on
    both ranks) left micro-batch 0's gradients for the next step. Now every rank raises the same error at once, and
    the next good step is a fresh strategy's first step."""
    for rank in two_ranks:
        assert "refused_failure" not in rank, rank["refused_failure"]
        assert all(error is not None for error in rank["refused_errors"]), rank["refused_errors"]
        assert max(rank["refused_seconds"]) < 10
        assert rank["after_refusals"] == pytest.approx(rank["clean_step"], rel=1e-6, abs=1e-6)
    assert [rank["refused_errors"] for rank in two_ranks][0] == two_ranks[1]["refused_errors"]
    train_error, forward_error, _ = two_ranks[0]["refused_errors"]
    assert "vocabulary" in train_error and "rank 1" in train_error and "rows" in forward_error


def test_a_loss_fn_on_a_mixture_of_experts_adds_transformers_router_loss(tmp_path):
    """One micro-batch with a loss_fn: the loss and gradient norm are transformers' loss_sum / weight plus
    router_aux_loss_coef x its load-balancing loss (its weight comes with the loss, so the router term is scaled by
    it, not by a weight read before the forward)."""
    from transformers import AutoModelForCausalLM

    config = {
        "model": {"name_or_path": "builtin:tiny-qwen3-moe", "config": {"num_hidden_layers": 1}},
        "training": {"max_steps": 1, "lr_scheduler_type": "constant", "output_dir": str(tmp_path / "run")},
    }
    batch = global_micro_batches(0, 1)[0]
    with strategy(config) as s:
        s.export_hf(tmp_path / "hf")
        coef = s.aux_loss_coef
        result = s.train_step([batch], policy_loss)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_router_logits=True)
    loss_sum, weight = policy_loss(plain_outputs(outputs.logits, batch)[0], batch)
    loss = loss_sum / weight + coef * outputs.aux_loss
    loss.backward()
    norm = clip_grad_norm_exact(model.parameters(), float("inf"))
    assert coef > 0 and outputs.aux_loss > 0
    assert result["loss"] == pytest.approx(loss.item(), abs=1e-5)
    assert result["grad_norm"] == pytest.approx(norm.item(), abs=1e-5)
