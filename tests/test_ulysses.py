"""SPEC §4.8: Ulysses sequence parallel. Ranks of a sequence-parallel group share their samples, each holding a slice
of the tokens, and attention sees the whole sequence through two all-to-alls. Trained that way, the model follows
one plain PyTorch process with no FSDP and no SP: the same losses, and after one step the same gradient for every
parameter. Sequence lengths that k does not divide, right padding (unpacked documents), packed documents (their
block-diagonal mask), HSDP, GQA with fewer key/value heads than ranks, eager attention, a sliding window and
head counts k does not divide (unaligned Ulysses: uneven heads per rank) are all covered."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import as_overrides, launch_two_ranks, plain_model, read_metrics, reference_run, run_cli, set_args
from safetensors.torch import load_file
from test_numerics import CONFIG as NUMERICS_CONFIG
from test_numerics import GLOBAL_BATCH, STEPS, TOLERANCE

from fsdp2kit.config.load import load_config
from fsdp2kit.config.schema import StrategyConfig
from fsdp2kit.data.builtin import corpus_documents
from fsdp2kit.data.dataset import collate, load_documents
from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel.mesh import mesh_layout
from fsdp2kit.parallel.sequence_layout import sequence_mask, shard_sequence
from fsdp2kit.parallel.sequence_masks import DenseMaskOnDemand
from fsdp2kit.parallel.ulysses import _rank_key_value, _RankHeadSinks, heads_per_rank

# The numerics tests' model, data and schedule, with no checkpoints, export or loggers.
TRAINING = {**NUMERICS_CONFIG["training"], "save_steps": 0, "export_hf": False, "report_to": []}
CONFIG = {**NUMERICS_CONFIG, "training": TRAINING}
# An odd sequence length: k = 2 never divides it, so every batch is padded for the split.
SMALL = {"model.config.num_hidden_layers": 2, "data.seq_len": 63}
# Unaligned Ulysses: k does not divide the attention heads. Qwen3 (its head_dim is its own, 64: any head count fits
# its hidden size), sequence length 63; its embeddings and LM head are tied.
UNALIGNED = SMALL | {"model.name_or_path": "builtin:tiny-qwen3"}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ulysses")
    path = folder / "ulysses.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.fixture(scope="module")
def uneven_jsonl(tmp_path_factory):
    """Documents of 20 to 400 characters, unpacked: samples of many lengths, right-padded in every batch."""
    path = tmp_path_factory.mktemp("ulysses_data") / "uneven.jsonl"
    rng = random.Random(0)
    path.write_text(
        "".join(json.dumps({"text": doc[: rng.randint(20, 400)]}) + "\n" for doc in corpus_documents()[:64])
    )
    return path


def reference_config(config_file, settings: dict):
    """The config of the one-process reference: each global batch as one micro-batch."""
    return load_config(config_file, as_overrides(settings | {"training.per_device_train_batch_size": GLOBAL_BATCH}))


def train_cli(config_file, ranks: int, settings: dict, output_dir) -> None:
    result = run_cli(
        "train", config_file, "--nproc", ranks, *set_args(settings | {"training.output_dir": str(output_dir)})
    )
    assert result.returncode == 0, result.stderr[-3000:]


def assert_losses_match(losses: list[float], reference: list[float]) -> float:
    assert len(losses) == len(reference) == STEPS
    differences = [abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True)]
    assert max(differences) < TOLERANCE, f"relative differences per step {differences}"
    assert reference[-1] < reference[0] - 0.5  # the comparison means something only if the loss moves
    return max(differences)


# Unit level: the layout, and how a batch is cut.


def test_layout_groups_consecutive_ranks_and_divides_data_parallel():
    """ROLL's example: 8 ranks, fsdp_size 4, ulysses 2 -> FSDP mesh (2, 4) [ddp, fsdp] unchanged, 4 SP groups,
    4 data-parallel ranks."""
    layout = mesh_layout(8, StrategyConfig(fsdp_size=4), ulysses_size=2)
    assert (layout.shape, layout.dim_names) == ((2, 4), ("ddp", "fsdp"))
    assert layout.sequence_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.data_parallel_size == 4
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_ulysses_size_must_divide_the_world():
    with pytest.raises(UserError, match=r"model.ulysses_size = 3 does not divide the world size 4; valid: 1, 2, 4"):
        mesh_layout(4, StrategyConfig(), ulysses_size=3)


def test_heads_per_rank_gives_the_first_ranks_one_more():
    assert heads_per_rank(6, 4) == [2, 2, 1, 1]
    assert heads_per_rank(3, 2) == [2, 1]
    assert heads_per_rank(28, 8) == [4, 4, 4, 4, 3, 3, 3, 3]
    assert heads_per_rank(8, 4) == [2, 2, 2, 2]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"),
    [(6, 6, 4), (6, 3, 4), (6, 2, 4), (6, 1, 4), (3, 1, 2), (4, 2, 4), (8, 2, 4), (4, 1, 2), (28, 4, 8)],
)
def test_each_rank_gets_the_key_value_heads_its_query_heads_read(heads, kv_heads, size):
    """Query head j reads key/value head j // (heads / kv_heads). After `_rank_key_value`, each rank's contiguous
    share of the (repeated) key/value heads, read as the inner attention reads it (query head i of the rank's share
    reads its key/value head i // num_key_value_groups), must be exactly that head for every query head."""
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads)
    key = torch.arange(kv_heads, dtype=torch.float)[None, :, None, None]  # each head holds its own index
    seen, key, _ = _rank_key_value(module, heads, key, key, size)
    kv_split, query_split = heads_per_rank(key.shape[1], size), heads_per_rank(heads, size)
    assert all(q == kv * seen.num_key_value_groups for q, kv in zip(query_split, kv_split, strict=True))
    read = []
    for share, count in zip(key.split(kv_split, dim=1), query_split, strict=True):
        read += [int(share[0, i // seen.num_key_value_groups, 0, 0]) for i in range(count)]
    assert read == [j // (heads // kv_heads) for j in range(heads)]
    if heads % size == 0 and kv_heads % size == 0:
        assert key.shape[1] == kv_heads  # the cheap path: nothing repeated


def test_rank_head_sinks_are_the_rank_s_own_uneven_heads():
    module = SimpleNamespace(sinks=torch.arange(6.0))
    shares = [_RankHeadSinks(module, heads_per_rank(6, 4), rank).sinks.tolist() for rank in range(4)]
    assert shares == [[0.0, 1.0], [2.0, 3.0], [4.0], [5.0]]


def fake_group(rank: int, size: int):
    return SimpleNamespace(rank=lambda: rank, size=lambda: size)


def test_shard_sequence_pads_and_slices_with_global_positions():
    batch = collate([torch.arange(10, 16), torch.arange(20, 24)], pad_id=2)  # 5 and 3 inputs, padded to 5
    groups = [fake_group(rank, 2) for rank in range(2)]
    shards = [shard_sequence(batch, group) for group in groups]
    joined = {key: torch.cat([s[key] for s in shards], dim=1) for key in ("input_ids", "labels", "position_ids")}
    assert joined["input_ids"][:, :5].tolist() == batch["input_ids"].tolist()
    assert joined["labels"].tolist() == [[11, 12, 13, 14, 15, IGNORE_INDEX], [21, 22, 23] + [IGNORE_INDEX] * 3]
    # The global positions, 0..T-1 as the model numbers the batch on one rank (padding included), and the sequence's
    # own padding to a multiple of k continues them.
    assert joined["position_ids"].tolist() == [list(range(6)), list(range(6))]
    assert shards[1]["position_ids"].tolist() == [[3, 4, 5], [3, 4, 5]]
    assert "attention_mask" not in shards[0]  # the model gets no mask (the attention reads the sequence's)
    assert sequence_mask(groups[1]) is None  # right padding under causal attention needs none


def test_shard_sequence_gives_packed_documents_their_full_length_mask():
    packed = {
        "input_ids": torch.arange(5)[None],
        "labels": torch.arange(1, 6)[None],
        "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
    }
    group = fake_group(0, 2)
    shard = shard_sequence(packed, group)
    assert "attention_mask" not in shard  # not the model's: MoE's router loss would read it as a padding mask
    on_demand = sequence_mask(group)  # the blocks attend without it: made only if a dense path asks for it
    assert isinstance(on_demand, DenseMaskOnDemand) and on_demand._mask is None
    mask = on_demand()[0, 0].int().tolist()
    # Two documents (positions 0-2 and 3-4), the padding (5) continuing the second: causal within each.
    assert mask == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]


# End to end, through the command line.


@pytest.mark.slow
def test_two_ranks_ulysses_matches_one_process_on_uneven_unpacked_samples(config_file, uneven_jsonl, tmp_path):
    settings = SMALL | {"data.source": str(uneven_jsonl), "data.pack": False}
    reference = reference_run(reference_config(config_file, settings), STEPS).losses
    train_cli(config_file, 2, settings | {"model.ulysses_size": 2, "training.gradient_accumulation_steps": 4}, tmp_path)
    records = read_metrics(tmp_path)
    print("max relative loss difference:", assert_losses_match([r["loss"] for r in records], reference))


@pytest.mark.slow
def test_ulysses_with_data_parallel_and_hsdp_matches_one_process_on_packed_documents(config_file, tmp_path):
    """4 ranks, ulysses 2 (2 data-parallel ranks, as 2 ranks of plain FSDP would be), HSDP (2, 2), recomputed
    layers: packed documents with their block-diagonal mask, on a Mistral whose sliding window (16) is shorter than
    the sequence."""
    settings = SMALL | {"model.config.model_type": "mistral", "model.config.sliding_window": 16}
    reference = reference_run(reference_config(config_file, settings), STEPS).losses
    train_cli(
        config_file,
        4,
        settings
        | {
            "model.ulysses_size": 2,
            "training.gradient_accumulation_steps": 2,
            "strategy_args.strategy_config.fsdp_size": 2,
            "strategy_args.strategy_config.recompute_modules": ["model.layers.{*}"],
        },
        tmp_path,
    )
    print("max relative loss difference:", assert_losses_match([r["loss"] for r in read_metrics(tmp_path)], reference))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layout"),
    [
        # Eager attention, and one key/value head for two ranks (each rank needs its own copy of it).
        pytest.param(
            {"model.config.num_key_value_heads": 1, "model.attn_implementation": "eager"},
            {"model.ulysses_size": 2},
            id="eager-mqa",
        ),
        # Unaligned: 3 heads over 2 ranks (2 and 1), sdpa.
        pytest.param(
            UNALIGNED | {"model.config.num_attention_heads": 3, "model.config.num_key_value_heads": 3},
            {"model.ulysses_size": 2},
            id="unaligned-3-heads",
        ),
        # Context parallel 2 on packed documents under a sliding window (16 < 63): sdpa's blocks, banded tiles.
        pytest.param(
            {"model.config.model_type": "mistral", "model.config.sliding_window": 16, "data.pack": True},
            {"model.context_parallel_size": 2},
            id="cp2-window-packed",
        ),
    ],
)
def test_every_gradient_matches_one_process_after_one_step(config_file, uneven_jsonl, tmp_path, model, layout):
    """One AdamW step with epsilon >> |grad| and lr = epsilon moves each weight by lr * g / (|g| + eps) = g (to 1e-7):
    the exported weights give every parameter's gradient, through `fsdp2kit train` at 2 ranks of sequence
    parallelism."""
    settings = SMALL | {"data.source": str(uneven_jsonl), "data.pack": False} | model
    one_step = {
        "training.max_steps": 1,
        "training.learning_rate": 1.0e6,
        "training.adam_epsilon": 1.0e6,
        "training.weight_decay": 0.0,
        "training.max_grad_norm": 0.0,
        "training.warmup_steps": 0,
        "training.lr_scheduler_type": "constant",
        "training.export_hf": True,
    }
    reference = reference_run(reference_config(config_file, settings | one_step), 1)
    initial, reference_grads = reference.initial, reference.first_grads
    train_cli(
        config_file,
        2,
        settings | one_step | layout | {"training.gradient_accumulation_steps": 4},
        tmp_path,
    )
    trained = {k: v for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(trained) == set(reference_grads)
    worst = 0.0
    for name, grad in reference_grads.items():
        measured = initial[name] - trained[name]
        error = ((measured - grad).abs().max() / grad.abs().max()).item()
        assert error < 1e-4, f"{name}: gradient differs by {error:.2e} of its largest element"
        worst = max(worst, error)
    print("max relative gradient difference:", worst)


@pytest.mark.slow
def test_uneven_heads_attend_exactly_as_the_whole_sequence_in_one_piece(tmp_path):
    """The attention function alone on 4 ranks, float64: 6 and 5 heads (uneven per rank) with 3 and 1 key/value
    heads, GPT-OSS's sinks over uneven heads (eager), and an aligned case; output and gradients as one piece."""
    out = tmp_path / "heads.pt"
    launch_two_ranks("ulysses_heads_worker.py", out, ranks=4, timeout=300)
    seen = torch.load(out)
    assert len(seen) == 4 and "sinks" in seen["6 heads, 2 kv, GPT-OSS sinks, eager"]
    for case, largest in seen.items():
        assert max(largest.values()) < 1e-12, (case, largest)
    print("largest differences:", seen)


@pytest.mark.slow
def test_unaligned_ulysses_4_of_6_heads_with_gqa_matches_one_process_on_packed_documents(config_file, tmp_path):
    """6 query heads over 4 ranks (2, 2, 1, 1) and 3 key/value heads (each rank gets its query heads' own, repeated),
    packed documents with their mask, 63 tokens padded to 64: per-step losses and gradient norms as one process."""
    settings = UNALIGNED | {"model.config.num_attention_heads": 6, "model.config.num_key_value_heads": 3}
    reference = reference_run(reference_config(config_file, settings), STEPS).results
    train_cli(config_file, 4, settings | {"model.ulysses_size": 4, "training.gradient_accumulation_steps": 4}, tmp_path)
    records = read_metrics(tmp_path)
    loss_difference = assert_losses_match([r["loss"] for r in records], [r.loss for r in reference])
    norms = [(r["grad_norm"], e.grad_norm) for r, e in zip(records, reference, strict=True)]
    norm_difference = max(abs(a - b) / b for a, b in norms)
    assert norm_difference < TOLERANCE, norms
    print("max relative loss difference:", loss_difference, "grad norm difference:", norm_difference)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["model.ulysses_size", "model.context_parallel_size"])
def test_infer_with_ulysses_matches_one_process(config_file, uneven_jsonl, tmp_path, layout):
    """fsdp2_infer: per-sample log-prob sums of unpadded samples of uneven lengths, in padded batches of 3; under
    Ulysses 2 or context parallel 2 (each sample's chunks gathered back in order, its records written once)."""
    settings = {
        "model.config.num_hidden_layers": 2,
        "model.allow_random_init": True,
        "data.source": str(uneven_jsonl),
        "data.max_samples": 7,
    }
    cfg = reference_config(config_file, settings)
    model, tokenizer = plain_model(cfg)
    expected = []
    with torch.no_grad():
        for document in load_documents(cfg.data):
            ids = torch.tensor([tokenizer(document)["input_ids"][: cfg.data.seq_len]])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1], -1)
            expected.append(logprobs.gather(-1, ids[0, 1:, None]).sum().item())
    result = run_cli(
        "infer",
        config_file,
        "--nproc",
        2,
        *set_args(
            settings
            | {
                layout: 2,
                "strategy_args.strategy_name": "fsdp2_infer",
                "infer_batch_size": 3,
                "training.output_dir": str(tmp_path),
            }
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "infer.jsonl").read_text().splitlines()][:-1]
    assert [r["index"] for r in records] == list(range(len(expected)))  # each sample once, not once per SP rank
    differences = [abs(r["sum_logprob"] - e) / abs(e) for r, e in zip(records, expected, strict=True)]
    assert max(differences) < TOLERANCE, differences
    print("max relative log-prob difference:", max(differences))


@pytest.mark.slow
def test_fewer_heads_than_ulysses_size_is_one_sentence(config_file, tmp_path):
    result = run_cli(
        "train",
        config_file,
        "--nproc",
        2,
        *set_args(
            SMALL
            | {
                "model.ulysses_size": 2,
                "model.config.num_attention_heads": 1,
                "model.config.num_key_value_heads": 1,
                "training.output_dir": str(tmp_path),
            }
        ),
    )
    assert result.returncode == 2
    assert "error: model.ulysses_size = 2 exceeds the model's 1 attention heads" in result.stderr
    assert "valid here: 1" in result.stderr
    assert "Traceback" not in result.stderr


def test_ulysses_size_not_dividing_nproc_fails_before_spawning(config_file, tmp_path):
    result = run_cli("train", config_file, "--nproc", 2, "--set", "model.ulysses_size=3")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: model.ulysses_size = 3 does not divide the world size 2; valid: 1, 2; "
        "launch with --nproc 3 (or a multiple of it) for this layout"
    )


@pytest.mark.slow
def test_check_shows_the_sequence_parallel_layout(config_file):
    result = run_cli(
        "check",
        config_file,
        "--nproc",
        2,
        "--json",
        *set_args({"model.ulysses_size": 2, "model.config.num_hidden_layers": 1}),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["mesh"] == {"shape": [2], "dim_names": ["fsdp"]}  # FSDP still shards over both ranks
    assert plan["sequence_parallel"] == {"size": 2, "groups": [[0, 1]], "data_parallel_size": 1}
    assert plan["ulysses_size"] == 2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_dense_mask_on_demand_is_made_once_by_its_first_caller_on_the_batch_device(device, monkeypatch):
    """Under context parallel, packed documents' dense mask is made by the first attention call that needs it
    (none, where the blocks attend), then kept for the micro-batch's other layers: the mask the eager build gives,
    on the batch's device (CUDA keeps the dense path: every CP call there takes it)."""
    from fsdp2kit.parallel import sequence_masks

    made = []
    build = sequence_masks._dense_mask
    monkeypatch.setattr(sequence_masks, "_dense_mask", lambda *args: made.append(1) or build(*args))
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]], device=device)  # three documents
    attend = sequence_masks._sequence_mask_function(sequence_masks._documents(positions), None)
    queries, keys = torch.tensor([0, 1, 6, 7], device=device), torch.arange(8, device=device)  # CP 2, rank 0
    mask = sequence_masks.DenseMaskOnDemand(attend, 1, queries, keys)
    assert made == []  # nothing made until asked
    first = mask()
    assert mask() is first and made == [1]  # once, then kept
    expected = build(attend, 1, queries, keys)
    assert first.device.type == device and first.shape == (1, 1, 4, 8) and torch.equal(first, expected)
    assert first[0, 0, 2].tolist() == [False] * 3 + [True] * 4 + [False]  # query 6: its document 3-6, causal
