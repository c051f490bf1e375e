"""An API caller's mistakes (fourth adversarial pass, issue 34): each is one UserError sentence at the call, never a
raw exception from deep in the forward, and never a silent run."""

from __future__ import annotations

import pytest
import torch

import fsdp2kit
from fsdp2kit.errors import UserError
from fsdp2kit.strategy import reshard

POSITIONS = 64


@pytest.fixture(scope="module")
def strategy(tmp_path_factory):
    from fsdp2kit.distributed import shutdown

    model = {"config": {"num_hidden_layers": 1, "max_position_embeddings": POSITIONS}}
    output_dir = str(tmp_path_factory.mktemp("api") / "out")
    config = {"model": model, "training": {"output_dir": output_dir, "lr_scheduler_type": "constant"}}
    try:
        yield fsdp2kit.Strategy.from_config(config)
    finally:
        shutdown()


def _local_weights(strategy) -> list[torch.Tensor]:
    return [p.to_local().clone() for p in strategy.model.parameters()]


def _ids(value: int, length: int = 8) -> torch.Tensor:
    return torch.full((1, length), value, dtype=torch.long)


def _detached_loss(log_probs, batch):
    return log_probs.detach().sum(), torch.tensor(1.0)


def _constant_loss(log_probs, batch):
    return torch.tensor(3.0), torch.tensor(1.0)


def _weighted(weight: float):
    return lambda log_probs, batch: (-log_probs.sum(), torch.tensor(weight))


# case: (call on the strategy, the fragment its one sentence holds)
API_MISTAKES = {
    "id_past_the_vocabulary": (
        lambda s: s.forward_step({"input_ids": _ids(s.vocab_size)}),
        "batch: input_ids holds 4096, outside the model's vocabulary (token ids 0..4095)",
    ),
    "negative_id": (
        lambda s: s.train_step([{"input_ids": _ids(-1)}]),
        "micro-batch 0: input_ids holds -1, outside the model's vocabulary",
    ),
    "negative_label": (
        lambda s: s.train_step([{"input_ids": _ids(1), "labels": _ids(-5)}]),
        "micro-batch 0: labels holds -5, outside the model's vocabulary (token ids 0..4095 or -100)",
    ),
    "float_labels": (
        lambda s: s.train_step([{"input_ids": _ids(1), "labels": torch.ones(1, 8)}]),
        "micro-batch 0: labels must be whole token ids (int64 or int32, -100 where not trained), not torch.float32",
    ),
    "detached_loss": (
        lambda s: s.train_step([{"input_ids": _ids(1)}], loss_fn=_detached_loss),
        "loss_fn: the loss_sum it returns carries no gradient",
    ),
    "constant_loss": (
        lambda s: s.train_step([{"input_ids": _ids(1)}], loss_fn=_constant_loss),
        "loss_fn: the loss_sum it returns carries no gradient",
    ),
    **{
        f"weight_{name}": (
            lambda s, w=weight: s.train_step([{"input_ids": _ids(1)}], loss_fn=_weighted(w)),
            "loss_fn: 1 of the weights it returned (over the ranks' micro-batches) are negative or not finite",
        )
        for name, weight in [("nan", float("nan")), ("inf", float("inf")), ("negative", -5.0)]
    },
    # issue 42 (4): no rows has nothing to compute; attention failed to reshape it
    "train_no_rows": (
        lambda s: s.train_step([{"input_ids": _ids(1)}, {"input_ids": torch.zeros(0, 8, dtype=torch.long)}]),
        "micro-batch 1: input_ids must be an int64 or int32 tensor [B, T] with B >= 1 rows and T >= 2, not (0, 8)",
    ),
    "forward_no_rows": (
        lambda s: s.forward_step({"input_ids": torch.zeros(0, 8, dtype=torch.long)}),
        "batch: input_ids must be an int64 or int32 tensor [B, T] with B >= 1 rows and T >= 2, not (0, 8)",
    ),
    "forward_past_the_positions": (
        lambda s: s.forward_step({"input_ids": _ids(1, POSITIONS + 1)}),
        f"batch: input_ids has {POSITIONS + 1} positions, more than the model's max_position_embeddings ({POSITIONS})",
    ),
    "train_past_the_positions": (
        lambda s: s.train_step([{"input_ids": _ids(1, POSITIONS + 1)}]),
        f"micro-batch 0: input_ids has {POSITIONS + 1} positions, more than the model's max_position_embeddings",
    ),
}


@pytest.mark.parametrize("case", list(API_MISTAKES))
def test_api_mistakes_are_one_sentence_and_change_nothing(strategy, case):
    call, fragment = API_MISTAKES[case]
    before = _local_weights(strategy)
    with pytest.raises(UserError) as raised:
        call(strategy)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
    reshard(strategy.model)  # a loss_fn refused mid-step leaves the root's forward gathered
    assert all(torch.equal(a, b) for a, b in zip(before, _local_weights(strategy), strict=True))
    full = strategy.forward_step({"input_ids": _ids(1, POSITIONS)})["log_probs"]  # the limit itself still runs
    assert full.shape == (1, POSITIONS - 1)


@pytest.mark.parametrize("config", [None, 3, ["config.yaml"]])
def test_from_config_of_neither_a_path_nor_a_dict_is_one_sentence(config):
    with pytest.raises(
        UserError, match=f"config must be a path to a config file or a dict .*not {type(config).__name__}"
    ):
        fsdp2kit.Strategy.from_config(config)


def test_a_half_read_full_weights_refuses_a_step_and_reading_on_after_one(strategy):
    """Half-read, then train_step: the step would mix the rest's weights (and at more ranks, the other ranks wait
    in its gathers): refused on this rank; after closing it the step runs, and a new iterator is whole again."""
    batch = [{"input_ids": torch.arange(16).reshape(2, 8)}]
    weights = strategy.full_weights(bucket_bytes=1)
    next(weights)
    with pytest.raises(UserError, match="train_step: a full_weights\\(\\) iterator on this rank is half-read"):
        strategy.train_step(batch)
    weights.close()
    strategy.train_step(batch)
    stale = strategy.full_weights(bucket_bytes=1)
    next(stale)
    strategy.steps_done += 1  # a step taken some other way than train_step (the Trainer's `step`, a restore)
    with pytest.raises(UserError, match="full_weights: the model stepped \\(step 1 -> 2\\) while this iterator"):
        next(stale)
    assert strategy.open_weight_streams == 0
    assert len(list(strategy.full_weights())) == len(list(strategy.model.state_dict()))


RANK_ZERO_READS_THE_WEIGHTS = """
import sys, torch, fsdp2kit
from fsdp2kit.errors import UserError
config = {"model": {"config": {"num_hidden_layers": 1}},
          "training": {"output_dir": sys.argv[1], "lr_scheduler_type": "constant"}}
strategy = fsdp2kit.Strategy.from_config(config)
sender = strategy.weight_sender()
reads = {"weights": lambda: list(strategy.full_weights()), "sync": lambda: sender.sync(None, lambda message: None)}
for reading, max_tokens in (("weights", None), ("weights", 8), ("sync", None)):  # each error leaves them in step
    try:
        if strategy.runtime.rank == 0:
            reads[reading]()
        else:
            strategy.train_step([{"input_ids": torch.arange(16).reshape(2, 8)}], max_tokens=max_tokens)
    except UserError as exc:
        print(f"rank {strategy.runtime.rank}, {reading}, max_tokens {max_tokens}: {exc}", flush=True)
"""


@pytest.mark.slow
def test_full_weights_read_on_rank_zero_alone_is_one_error_on_every_rank_not_a_hang(tmp_path):
    """Rank 0 reads full_weights (or makes a weight sync) while rank 1 steps: they met in mismatched collectives and
    hung; now their first collectives agree on which call every rank is in. With max_tokens the step's first
    collective is the token budget's count of micro-batches: it agrees on the call too (it hung there, issue 34)."""
    from conftest import two_ranks_hang

    hung, output = two_ranks_hang(RANK_ZERO_READS_THE_WEIGHTS, [str(tmp_path / "out")], tmp_path)
    assert not hung, output
    said = "some ranks are in train_step() and others in full_weights(); full_weights() is a collective"
    for max_tokens in (None, 8):
        assert f"rank 0, weights, max_tokens {max_tokens}: full_weights: {said}" in output, output
        assert f"rank 1, weights, max_tokens {max_tokens}: train_step: {said}" in output, output
    said = "some ranks are in train_step() and others in weight_sender(); a weight sync is a collective"
    assert f"rank 0, sync, max_tokens None: weight_sender: {said}" in output, output
    assert f"rank 1, sync, max_tokens None: train_step: {said}" in output, output
