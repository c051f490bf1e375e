"""Every MoE family of transformers 5 as its checkpoints are written (issue 33): a folder written by transformers'
`save_pretrained` (per-expert tensors, Mixtral's `block_sparse_moe.experts.<i>.w1`) loads through fsdp2kit's
streamed loader, trains with the router's auxiliary loss as transformers computes it, and exports to the tensors
`save_pretrained` writes, which transformers loads with the same log-probs; `full_weights` gives those names; 1 rank
x 2 accumulation equals 2 ranks (and a Ulysses pair where the family's attention allows it) within 1e-5."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import launch_two_ranks
from moe_families_worker import micro_batches
from moe_families_worker import train as train_in_process
from safetensors import safe_open
from zoo_case import DEEPSEEK_V3

from fsdp2kit.data.builtin import VOCAB_SIZE, tokenizer_dir
from fsdp2kit.distributed import shutdown

STEPS = 1  # one update compares every gradient; more steps add only the optimizer's arithmetic
SMALL = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.05,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
# family -> (its settings beyond SMALL, the class wrap_policy.moe_experts names: per-expert where transformers has
# one, else the fused experts module, whether a Ulysses pair is checked)
FAMILIES: dict[str, tuple[dict[str, Any], str, bool]] = {
    "qwen2_moe": (
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
        },
        "Qwen2MoeMLP",
        True,
    ),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2}, "MixtralBlockSparseTop2MLP", True),
    "olmoe": ({"num_experts": 4, "num_experts_per_tok": 2}, "OlmoeMLP", True),
    "deepseek_v3": (
        DEEPSEEK_V3,  # multi-head latent attention, a shared expert, layer 0 dense
        "DeepseekV3MLP",
        True,
    ),
    "gpt_oss": (
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 8,
        },
        "GptOssExperts",
        True,
    ),
}


def saved_folder(folder: Path, family: str, own: dict[str, Any] | None = None) -> Path:
    """The family's tiny model (its FAMILIES settings, or `own`), saved by transformers with the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**SMALL, **(FAMILIES[family][0] if own is None else own)}
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **settings)).save_pretrained(folder)
    for file in tokenizer_dir().iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def stored(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def runs(
    folders: dict[str, Path], out: Path, accumulation: int, ulysses: int, export: bool = False
) -> list[dict[str, Any]]:
    return [
        {
            "folder": str(folder),
            "out": str(out / f"{family}-{accumulation}x{ulysses}.pt"),
            "experts": FAMILIES[family][1],
            "per_expert": not FAMILIES[family][1].endswith("Experts"),  # the fused classes' names end so
            "accumulation": accumulation,
            "ulysses": ulysses,
            "steps": STEPS,
            "export": export,
        }
        for family, folder in folders.items()
        if ulysses == 1 or FAMILIES[family][2]
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_families")
    return {family: saved_folder(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def one_rank(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each family trained in this process, a world of one, 2 micro-batches a step."""
    out = tmp_path_factory.mktemp("one_rank")
    try:
        for run in runs(folders, out, accumulation=2, ulysses=1, export=True):
            train_in_process(run)
    finally:
        shutdown()
    return {
        family: {**torch.load(out / f"{family}-2x1.pt"), "export": out / f"{family}-2x1.pt.hf"} for family in folders
    }


def transformers_loss(folder: Path, batch: dict[str, torch.Tensor]) -> float:
    """transformers' own training loss: token cross-entropy plus router_aux_loss_coef x its load-balancing loss."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss.item()


def transformers_log_probs(folder: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    logits = model(**batch).logits
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_save_pretrained_folder_loads_trains_and_exports_as_transformers_writes_it(family, folders, one_rank):
    result, folder = one_rank[family], folders[family]
    first_step = micro_batches(0, 2)
    expected = sum(transformers_loss(folder, batch) for batch in first_step) / 2  # equal real-token counts
    assert result["losses"][0] == pytest.approx(expected, abs=1e-4)  # loaded right, with the auxiliary loss
    export = result["export"]
    written, saved = stored(export), stored(folder)
    assert sorted(written) == sorted(saved)  # save_pretrained's names and shapes
    assert all(written[key].shape == saved[key].shape for key in saved)
    assert sorted(result["weights"]) == sorted(saved)  # full_weights: the names a rollout engine loads
    assert all(torch.equal(result["weights"][key], written[key]) for key in saved)
    probe = micro_batches(-1, 1)[0]
    real = probe["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(
        result["log_probs"][real], transformers_log_probs(export, probe)[real], atol=1e-5, rtol=0
    )


def test_a_slice_of_fused_experts_reads_only_those_experts_tensors(folders):
    """Loading is streamed: the rows of experts 2 and 3 of a fused tensor (rank 1 of 2's shard) come from those
    experts' stored tensors alone, converted as transformers converts them."""
    from transformers import AutoModelForCausalLM

    from fsdp2kit.models.hf_layout import ModelShapes, checkpoint_conversions, model_views

    model = AutoModelForCausalLM.from_pretrained(folders["mixtral"], dtype=torch.float32)
    state = model.state_dict()
    read: list[str] = []
    layout = ModelShapes(checkpoint_conversions(model), model.config, {n: t.shape for n, t in state.items()})
    name = "model.layers.1.mlp.experts.gate_up_proj"
    with safe_open(folders["mixtral"] / "model.safetensors", "pt") as handle:

        class Recorded:  # a stored tensor's lazy slice that records which tensors are read
            def __init__(self, key: str) -> None:
                self.key, self.slice = key, handle.get_slice(key)

            def get_shape(self) -> list[int]:
                return self.slice.get_shape()

            def __getitem__(self, index: Any) -> torch.Tensor:
                read.append(self.key)
                return self.slice[index]

        def open_stored(key: str) -> Recorded:
            return Recorded(key)

        rows = model_views(handle.keys(), open_stored, layout)[name].open()[2:4]
    expected = [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in (2, 3) for w in ("w1", "w3")]
    assert sorted(read) == expected
    assert torch.equal(rows, state[name][2:4])


def test_router_rows_gathered_from_a_ulysses_pair_are_in_sequence_order_without_padding():
    """2 ranks hold halves of 2 sequences of 4 tokens (rank-major once gathered): the loss gets them back in
    sequence order, without the padding a text batch's loss leaves out (the last token of sequence 1), or every row
    where the model masks padding itself (a VL batch)."""
    from fsdp2kit.parallel.moe import _sequence_rows
    from fsdp2kit.parallel.sequence_layout import remember_tokens

    group: Any = object()  # what the records are keyed by; no collective runs
    token = torch.arange(8.0).reshape(2, 4)  # token t of sequence b is 4b + t
    gathered = torch.stack([token[:, :2].reshape(4, 1), token[:, 2:].reshape(4, 1)])  # [ranks, B x T/2, 1]
    remember_tokens(group, torch.tensor([[True, True, True, True], [True, True, True, False]]))
    assert _sequence_rows(gathered, group).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6]
    remember_tokens(group, torch.ones(2, 4, dtype=torch.bool))
    assert _sequence_rows(gathered, group).flatten().tolist() == list(range(8))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])  # renamed and fused; fused
def test_convert_to_dcp_and_back_gives_the_save_pretrained_tensors(family, folders, tmp_path):
    """`convert --to dcp` fuses the experts into the model's own names (a DCP checkpoint holds those); `--to hf`
    writes save_pretrained's per-expert tensors again, bit for bit."""
    from fsdp2kit.checkpoint.convert import convert
    from fsdp2kit.checkpoint.dcp_io import model_tensors

    convert(folders[family], tmp_path / "dcp", "dcp")
    assert "model.layers.1.mlp.experts.gate_up_proj" in model_tensors(tmp_path / "dcp")
    convert(tmp_path / "dcp", tmp_path / "back", "hf")
    back, saved = stored(tmp_path / "back"), stored(folders[family])
    assert sorted(back) == sorted(saved)
    assert all(torch.equal(back[key], saved[key]) for key in saved)


@pytest.mark.slow
def test_two_ranks_and_ulysses_train_every_family_like_one_rank(folders, one_rank, tmp_path):
    """2 data-parallel ranks with a micro-batch each (each rank reading only its experts' files), and a Ulysses pair
    with 2 micro-batches: the same losses and weights as one rank (per-expert groups with the expert patch where the
    family has a per-expert class)."""
    spec = tmp_path / "runs.json"
    planned = runs(folders, tmp_path, accumulation=1, ulysses=1) + runs(folders, tmp_path, accumulation=2, ulysses=2)
    spec.write_text(json.dumps(planned))
    launch_two_ranks("moe_families_worker.py", spec)
    for run in planned:
        family = Path(run["folder"]).name
        got, expected = torch.load(run["out"]), one_rank[family]
        assert got["losses"] == pytest.approx(expected["losses"], abs=1e-5), run["out"]
        for name, tensor in expected["weights"].items():
            torch.testing.assert_close(got["weights"][name], tensor, atol=1e-5, rtol=0, msg=f"{run['out']}: {name}")
