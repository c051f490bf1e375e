"""Vision-language models (docs/vl.md) on the built-in tiny Qwen2.5-VL and Qwen3-VL: the plan's vision groups,
image+text conversations in both record forms, weights in and out under the HF folders' names (transformers loads
the export with equal log-probs), a frozen tower holding no optimizer state, 2 ranks training like 1 (tower frozen
or not, Ulysses) on data where a rank's micro-batch has no image, and the hang the vision patch prevents."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    HANG_TIMEOUT_S,
    REPO,
    cli_without_patch,
    logit_logprobs,
    process_group,
    read_metrics,
    run_cli,
    sharded_model,
    two_ranks_hang,
)

from fsdp2kit.check import describe
from fsdp2kit.checkpoint.convert import convert
from fsdp2kit.config.load import load_config
from fsdp2kit.config.schema import DataConfig, JobConfig, TrainingConfig
from fsdp2kit.data.vl import VLEncoder, load_conversations
from fsdp2kit.errors import UserError
from fsdp2kit.infer.logprobs import infer
from fsdp2kit.models.export import export_hf
from fsdp2kit.train.optim import build_optimizer
from fsdp2kit.train.step import token_loss_sum
from fsdp2kit.trainer import train

sys.path.insert(0, str(REPO / "examples"))
from make_vl_dataset import main as make_dataset  # noqa: E402

QWEN25, QWEN3 = "builtin:tiny-qwen2.5-vl", "builtin:tiny-qwen3-vl"


def job(name: str = QWEN25, data: str = "", strategy: dict | None = None, **model) -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": {"name_or_path": name, **model},
            "data": {"source": data or "unused.jsonl", "seq_len": 128, "pack": False},
            "strategy_args": {"strategy_config": strategy or {}},
        }
    )


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """24 records: 16 with an image (28-84 px), every third one text only; chat form and LLaVA form."""
    folder = tmp_path_factory.mktemp("vl_data")
    make_dataset(folder, 24, 0)
    return folder


def encoder_and_conversations(sharded, source: Path, seq_len: int = 128):
    encoder = VLEncoder.load(sharded.source.tokenizer_path, sharded.source.hf_config, seq_len)
    return encoder, load_conversations(DataConfig(source=str(source), seq_len=seq_len, pack=False))


@pytest.mark.parametrize(
    "name, projectors",
    [(QWEN25, ["model.visual.merger"]), (QWEN3, ["model.visual.merger", "model.visual.deepstack_merger_list.0"])],
)
def test_vision_blocks_and_merger_are_groups_without_input_casting(name, projectors):
    with process_group() as runtime:
        plan = describe(job(name), runtime)
    vision = ["model.visual.blocks.0", "model.visual.blocks.1", *projectors]
    assert plan["sharded_modules"] == ["", *vision, "model.language_model.layers.0", "model.language_model.layers.1"]
    cast = {group["modules"][0]: group["cast_forward_inputs"] for group in plan["groups"]}
    assert cast == {
        "": False,
        **dict.fromkeys(vision, False),
        **dict.fromkeys(["model.language_model.layers.0", "model.language_model.layers.1"], True),
    }
    assert plan["vision_patch"] is True
    # A deviation from ROLL and MindSpeed-MM, which leave the projectors in the root's group: said in the notes.
    assert [note for note in plan["notes"] if note.startswith("vision projector")] == [
        f"vision projector '{name}': its own shard group (ROLL and MindSpeed-MM leave it in the root's)"
        for name in projectors
    ]


def test_mindspeed_patterns_pick_the_visual_blocks():
    """MindSpeed-MM's `sub_modules_to_wrap` spelling, with transformers' module paths."""
    strategy = {"sub_modules_to_wrap": ["model.visual.blocks.{*}", "model.language_model.layers.{*}"]}
    with process_group() as runtime:
        plan = describe(job(strategy=strategy), runtime)
    assert plan["sharded_modules"] == [
        "",
        "model.visual.blocks.0",
        "model.visual.blocks.1",
        "model.language_model.layers.0",
        "model.language_model.layers.1",
    ]


def test_other_stacks_names_of_the_tower_and_language_model_map_onto_the_plan():
    """ROLL's `freeze_module_prefix: vision_model` and MindSpeed-MM's Qwen2.5-VL file (its own module names:
    `image_encoder`, `text_decoder.decoder.layers.{*}`) read as transformers' paths, each reading noted."""
    strategy = {"sub_modules_to_wrap": ["text_decoder.decoder.layers.{*}"], "ignored_modules": ["image_encoder"]}
    with process_group() as runtime:
        plan = describe(job(strategy=strategy, freeze_module_prefix="vision_model"), runtime)
    assert plan["sharded_modules"] == ["", "model.language_model.layers.0", "model.language_model.layers.1"]
    assert plan["ignored_modules"] == ["model.visual"]
    assert plan["frozen_parameters"] == 257344  # the whole tower (docs/vl.md)
    assert plan["notes"] == [
        "strategy_config.ignored_modules: 'image_encoder' read as 'model.visual'",
        "strategy_config.sub_modules_to_wrap: 'text_decoder.decoder.layers.{*}' read as "
        "'model.language_model.layers.{*}'",
        "model.freeze_module_prefix: 'vision_model' read as 'model.visual'",
    ]


def test_both_record_forms_give_the_same_samples_with_loss_on_the_answers(dataset):
    with process_group() as runtime:
        sharded = sharded_model(job(), runtime, training=False, materialize=False)
    encoder, chat = encoder_and_conversations(sharded, dataset / "train.jsonl")
    _, llava = encoder_and_conversations(sharded, dataset / "llava.jsonl")
    assert len(chat) == len(llava) == 24
    for a, b in zip(chat[:6], llava[:6], strict=True):
        x, y = encoder.encode(a), encoder.encode(b)
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.trained, y.trained)
        assert (x.pixel_values is None) == (y.pixel_values is None)
        if x.pixel_values is not None:
            assert torch.equal(x.pixel_values, y.pixel_values)
            merged_patches = int(x.image_grid_thw.prod()) // 4
            assert int((x.tokens == sharded.source.hf_config.image_token_id).sum()) == merged_patches
    first = encoder.encode(chat[0])
    answer = encoder.tokenizer.decode(first.tokens[first.trained])
    assert answer.startswith("A ") and answer.endswith(".<|im_end|>"), answer
    batch = encoder.collate([encoder.encode(c) for c in chat[:3]], 2)  # image, image, text only
    assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    assert int((batch["mm_token_type_ids"] == 1).sum()) == int(batch["image_grid_thw"].prod(-1).sum()) // 4


def test_missing_or_unreadable_images_and_packing_are_refused(dataset, tmp_path):
    lines = (dataset / "train.jsonl").read_text().splitlines()
    missing = dataset / "missing.jsonl"  # beside the images, which it names relative to its folder
    missing.write_text(lines[0] + "\n" + lines[1].replace("images/001.png", "images/nope.png") + "\n")
    with pytest.raises(UserError, match=r"record 2 of '.*missing.jsonl' names image '.*images/nope.png', which does"):
        load_conversations(DataConfig(source=str(missing), pack=False))
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "000.png").write_bytes(b"not a png")
    broken = tmp_path / "broken.jsonl"
    broken.write_text(lines[0] + "\n")
    # Found when the data is read (prepare, the start of a run), not first when the sample is drawn.
    with pytest.raises(UserError, match=r"record 1 of '.*broken.jsonl': image '.*images/000.png' cannot be read"):
        load_conversations(DataConfig(source=str(broken), pack=False))
    with pytest.raises(UserError, match="data.pack: vision-language samples are not packed"):
        load_conversations(DataConfig(source=str(broken), pack=True))


def test_prepare_checks_every_image_a_vision_language_source_names(dataset, tmp_path, run_main):
    """`prepare` on a vision-language config read its conversations as text and refused their first image part; a
    file that is no image was found only when its sample was drawn. Now it checks every record and image."""
    lines = (dataset / "train.jsonl").read_text().splitlines()[:12]
    shutil.copytree(dataset / "images", tmp_path / "images")  # beside the file, which names them relative to it
    source = tmp_path / "train.jsonl"
    source.write_text("\n".join(lines) + "\n")
    args = ["prepare", "examples/demo.yaml", "--set", f"model.name_or_path={QWEN25}", "--set", f"data.source={source}"]
    args += ["--set", "data.pack=false", "--set", "data.seq_len=128"]
    result = run_main(*args)
    assert result.returncode == 0, result.stderr
    assert result.stdout.endswith(
        "12 conversations naming 8 images, each checked; no token store (these samples "
        "are encoded as they are batched)\n"
    )
    (tmp_path / "images" / "010.png").write_text("not an image")  # the last record's
    result = run_main(*args)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: data.source: record 11 of '{source}': image ")
    assert "cannot be read" in result.stderr and result.stderr.count("\n") == 1


def test_an_evaluation_source_without_conversations_is_refused_naming_data_eval_source(dataset, tmp_path):
    """The evaluation set is read as a source of its own: its refusals named data.source (issue 34), and an empty
    one evaluated nothing without a word."""
    with process_group() as runtime:
        sharded = sharded_model(job(), runtime, training=False, materialize=False)
    order = (1, 1, 1, 0, 0, True, 0, None)  # GlobalBatches' fields: batch size, accumulation, ranks, ..., seed, ...

    def batches_with(eval_source: Path):
        data = DataConfig(source=str(dataset / "train.jsonl"), eval_source=str(eval_source), seq_len=128, pack=False)
        return sharded.variant.global_batches(data, None, sharded.source, order)

    assert len(batches_with(dataset / "llava.jsonl").eval_samples) == 24
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError, match=r"^data\.eval_source: it holds no conversation to evaluate"):
        batches_with(empty)
    unanswered = tmp_path / "unanswered.jsonl"
    unanswered.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match=r"^data\.eval_source: record 1 of '.*unanswered.jsonl' has no assistant turn"):
        batches_with(unanswered)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
        for state in optimizer.state.values()
        for t in state.values()
        if t.dim() > 0  # AdamW's step counters are scalars
    )


def test_frozen_tower_has_no_gradients_and_no_optimizer_state(dataset):
    """A step on a batch with images: the frozen tower gets no gradient, and AdamW holds its two fp32 moments for
    the language model's parameters alone."""
    measured = {}
    for frozen in ([], ["model.visual"]):
        with process_group() as runtime:
            sharded = sharded_model(job(freeze_module_prefix=frozen), runtime, training=True)
            model = sharded.model
            encoder, conversations = encoder_and_conversations(sharded, dataset / "train.jsonl")
            optimizer = build_optimizer(model, TrainingConfig())
            token_loss_sum(model, encoder.collate([encoder.encode(c) for c in conversations[:2]], 2)).backward()
            optimizer.step()
            visual_grads = [p.grad for n, p in model.named_parameters() if n.startswith("model.visual.")]
            language = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual."))
            everything = sum(p.numel() for p in model.parameters())
            measured[bool(frozen)] = optimizer_state_bytes(optimizer)
        assert all((g is None) == bool(frozen) for g in visual_grads)
    assert measured[True] == 2 * 4 * language
    assert measured[False] == 2 * 4 * everything > measured[True]


def run(config: Path, ranks: int, command: str, *settings: str) -> None:
    """The command on 2 ranks through the command line; 1 rank in this process (the same code, no start-up cost)."""
    if ranks > 1:
        result = run_cli(command, config, "--nproc", ranks, *(a for s in settings for a in ("--set", s)), timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return
    cfg = load_config(config, list(settings))
    with process_group() as runtime:
        (train if command == "train" else infer)(cfg, runtime)


def hf_logprobs(folder: Path, batches: list[dict]) -> list[float]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return [s for batch in batches for s in logit_logprobs(model, batch)[0]]


@pytest.mark.parametrize("name", [QWEN25, QWEN3])
def test_export_has_the_hf_names_and_transformers_gives_the_same_logprobs(name, dataset, tmp_path):
    from safetensors import safe_open

    with process_group() as runtime:
        sharded = sharded_model(job(name), runtime, training=False)
        encoder, conversations = encoder_and_conversations(sharded, dataset / "train.jsonl")
        batches = [encoder.collate([encoder.encode(c)], 2) for c in conversations[:3]]  # image, image, text
        ours = [s for batch in batches for s in logit_logprobs(sharded.model, batch)[0]]
        export_hf(sharded.model, tmp_path / "hf", sharded.source.tokenizer_path, "fp32", is_main=True)
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
    if name == QWEN25:  # as Qwen2.5-VL checkpoints store them (transformers renames on load and save)
        assert {"visual.blocks.0.attn.qkv.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"} <= names
    else:
        assert {
            "model.visual.blocks.0.attn.qkv.weight",
            "model.language_model.layers.0.self_attn.q_proj.weight",
        } <= names
    assert (tmp_path / "hf" / "preprocessor_config.json").is_file()
    torch.testing.assert_close(hf_logprobs(tmp_path / "hf", batches), ours, rtol=1e-4, atol=1e-4)
    with process_group() as runtime:  # and back in: sliced loading reads the renamed tensors
        reloaded = sharded_model(job(str(tmp_path / "hf")), runtime, training=False).model
        again = [s for batch in batches for s in logit_logprobs(reloaded, batch)[0]]
    assert again == pytest.approx(ours, rel=1e-6)


@pytest.mark.slow
def test_infer_on_1_and_2_ranks_matches_transformers(dataset, tmp_path):
    with process_group() as runtime:
        sharded = sharded_model(job(), runtime, training=False)
        export_hf(sharded.model, tmp_path / "hf", sharded.source.tokenizer_path, "fp32", is_main=True)
        encoder, conversations = encoder_and_conversations(sharded, dataset / "train.jsonl")
        batches = [encoder.collate([encoder.encode(c)], 2) for c in conversations[:5]]
    expected = hf_logprobs(tmp_path / "hf", batches)
    config = tmp_path / "infer.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name_or_path": str(tmp_path / "hf")},
                "data": {"source": str(dataset / "train.jsonl"), "seq_len": 128, "pack": False, "max_samples": 5},
                "strategy_args": {"strategy_name": "fsdp2_infer"},
            }
        )
    )
    for ranks in (1, 2):  # 2 ranks: 3 and 2 samples, so rank 1 runs one text-only dummy batch at the end
        out = tmp_path / f"infer{ranks}"
        run(config, ranks, "infer", f"training.output_dir={out}")
        records = [json.loads(line) for line in (out / "infer.jsonl").read_text().splitlines()][:-1]
        torch.testing.assert_close([r["sum_logprob"] for r in records], expected, rtol=1e-4, atol=1e-4)


# Training on the generated data in file order: step 1 = records 1-2 (both with an image), step 2 = records 3-4 (text
# only, image), step 3 = records 5-6 (image, text only). On 2 ranks, rank 0 has no image in step 2, rank 1 in step 3.
STEPS = 3


@pytest.fixture(scope="module")
def training_config(dataset, tmp_path_factory) -> Path:
    config = yaml.safe_load((REPO / "examples" / "vl_sft.yaml").read_text())
    config["data"].update({"source": str(dataset / "train.jsonl"), "shuffle": False})
    config["training"].update(
        {"max_steps": STEPS, "per_device_train_batch_size": 1, "seed": 3, "export_hf": False, "save_steps": 0}
    )
    path = tmp_path_factory.mktemp("vl_train") / "vl_sft.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train_records(config: Path, out: Path, ranks: int, *settings: str) -> list[dict]:
    """The metrics records of a run (a sequence group of 2 ranks trains one micro-batch at a time, as 1 rank)."""
    sequence = any(s in settings for s in ("model.ulysses_size=2", "model.context_parallel_size=2"))
    accumulation = 2 // ranks if not sequence else 2
    run(
        config,
        ranks,
        "train",
        f"training.gradient_accumulation_steps={accumulation}",
        f"training.output_dir={out}",
        *settings,
    )
    return read_metrics(out)


def train_losses(config: Path, out: Path, ranks: int, *settings: str) -> list[float]:
    return [record["loss"] for record in train_records(config, out, ranks, *settings)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, frozen",
    [(QWEN25, "model.visual"), (QWEN3, "[]")],
    ids=["Qwen2.5-VL, tower frozen", "Qwen3-VL, tower trained, Ulysses and CP"],
)
def test_two_ranks_train_like_one_with_text_only_micro_batches(training_config, tmp_path, name, frozen):
    model = [f"model.name_or_path={name}", f"model.freeze_module_prefix={frozen}"]
    one_records = train_records(training_config, tmp_path / "one", 1, *model, "training.export_hf=true")
    one = [record["loss"] for record in one_records]
    two = train_losses(training_config, tmp_path / "two", 2, *model)
    assert len(one) == len(two) == STEPS
    assert two == pytest.approx(one, rel=1e-5)
    assert one[-1] < one[0]
    if name == QWEN25:  # `convert --to hf` of the final checkpoint writes the export's names and tensors
        from safetensors.torch import load_file

        convert(tmp_path / "one" / "checkpoints" / f"step_{STEPS}", tmp_path / "converted", "hf")
        converted, exported = (
            load_file(p / "model.safetensors") for p in (tmp_path / "converted", tmp_path / "one" / "hf")
        )
        assert converted.keys() == exported.keys() and "visual.blocks.0.attn.qkv.weight" in converted
        assert all(torch.equal(converted[key], exported[key]) for key in converted)
    else:  # Ulysses and CP: the sequence cut after the image (and deepstack) features are merged, the tower unsplit
        ulysses = train_losses(training_config, tmp_path / "ulysses", 2, *model, "model.ulysses_size=2")
        assert ulysses == pytest.approx(one, rel=1e-5)
        # Context parallel: a front chunk and its mirror of the merged sequence (image tokens inside) per rank. Were
        # CP ignored, the 2 ranks would be 2 data-parallel ranks with 2 micro-batches each: twice the samples a step.
        cp = train_records(training_config, tmp_path / "cp", 2, *model, "model.context_parallel_size=2")
        assert [record["loss"] for record in cp] == pytest.approx(one, rel=1e-5)
        assert [record["grad_norm"] for record in cp] == pytest.approx([r["grad_norm"] for r in one_records], rel=1e-5)


# A run with the vision patch left out, its ranks launched here so that the patch can be removed in them.
WITHOUT_PATCH = cli_without_patch("apply_vision_patch", announce_forwards=True)


@pytest.mark.slow
def test_without_the_vision_patch_a_rank_without_images_never_finishes(training_config, dataset, tmp_path):
    """Records 3-4 first: rank 0 (text only) skips the tower, rank 1 (an image) all-gathers its blocks; their next
    collectives do not pair up. NCCL would wait forever; gloo aborts on the size mismatch. With the patch the same
    micro-batches train (the test above, step 2)."""
    lines = (dataset / "train.jsonl").read_text().splitlines()
    data = dataset / "text_first.jsonl"
    data.write_text("\n".join(lines[2:4]) + "\n")
    args = ["train", str(training_config), "--set", f"data.source={data}", "--set", f"training.output_dir={tmp_path}"]
    args += ["--set", "training.max_steps=1", "--set", "model.freeze_module_prefix=[]"]
    hung, output = two_ranks_hang(WITHOUT_PATCH, args, tmp_path)
    outcome = f"hung in step 1 (a collective timed out after {HANG_TIMEOUT_S}s)" if hung else "aborted by gloo"
    assert "forward: images False" in output and "forward: images True" in output, output[-3000:]
    print(f"\nwithout the vision patch: {outcome}")
    assert hung or "Is there a distributed collective mismatch" in output, output[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path)
