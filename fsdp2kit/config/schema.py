"""The native config: every key, its default and a one-line doc, validated by pydantic.

Each section is its own model so that each function receives only the section it needs
(e.g. `apply_fsdp` takes a `StrategyConfig`, the data pipeline a `DataConfig`).
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from fsdp2kit.dtypes import short_name
from fsdp2kit.errors import UserError


def _pattern_list(value: Any) -> Any:
    """A single pattern may be written as a plain string (ROLL writes `freeze_module_prefix: vision_model`)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return value


_MAX_DEVICES = 1 << 20


def _device_list(value: Any) -> Any:
    """ROLL writes `device_mapping: list(range(0,16))`; accept that, a list literal, or a list."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    match = re.fullmatch(r"list\(\s*range\(\s*(\d+)\s*(?:,\s*(\d+)\s*)?(?:,\s*(\d+)\s*)?\)\s*\)", text)
    if match:
        numbers = [int(g) for g in match.groups() if g is not None]
        if len(numbers) == 3 and numbers[2] == 0:
            raise ValueError("list(range(start, stop, step)) with a step other than 0")
        devices = range(*numbers)
        if len(devices) > _MAX_DEVICES:  # the list would not fit in memory long before any cluster has that many
            raise ValueError(f"at most {_MAX_DEVICES} device ids (this range names {len(devices)})")
        return list(devices)
    try:
        parsed = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError("a list of device ids such as [0,1,2,3] or list(range(0,8))") from None
    return list(parsed) if isinstance(parsed, (list, tuple)) else parsed


# A dotted path whose last part is a class name (`package.module.DecoderLayer`), not a module path: MindSpeed's
# documented way of naming every module of a class in sub_modules_to_wrap and recompute_modules.
_CLASS_PATH = re.compile(r"(?:[A-Za-z_]\w*\.)+([A-Z]\w*)")


def pattern_class(pattern: str) -> str | None:
    """The class a module pattern names by its fully-qualified path, or None for a module path."""
    match = _CLASS_PATH.fullmatch(pattern)
    return match.group(1) if match else None


DType = Annotated[Literal["bf16", "fp16", "fp32"], BeforeValidator(short_name)]
OptionalDType = Annotated[Literal["bf16", "fp16", "fp32"] | None, BeforeValidator(short_name)]
PatternList = Annotated[list[str], BeforeValidator(_pattern_list)]
ReportTarget = Literal["tensorboard", "wandb"]
ReportTargets = Annotated[
    list[ReportTarget],
    BeforeValidator(lambda value: [] if value in ("none", None) else _pattern_list(value)),
]  # HF Trainer writes report_to: none


def _tensorboard_only() -> list[ReportTarget]:
    return ["tensorboard"]


class Section(BaseModel):
    """Base of every config section: unknown keys are errors; `ALIASES` maps other projects' spellings."""

    # inf and nan are never a setting: `learning_rate: .inf` would train NaN weights and end with exit 0.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    ALIASES: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _resolve_aliases(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.ALIASES:
            return data
        data = dict(data)
        for alias, name in cls.ALIASES.items():
            if alias in data:
                if name in data and data[name] != data[alias]:
                    raise ValueError(f"only one of '{alias}' and '{name}' (they are the same key)")
                data[name] = data.pop(alias)
        return data


def _module_names(value: Any) -> Any:
    """ROLL and MindSpeed-MM write module lists as one comma-separated string (`o_proj,q_proj`)."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return _pattern_list(value)


MAX_LORA_SCALING = 1000


class LoraConfig(Section):
    """LoRA through peft (`model.lora`). The aliases are ROLL's model_args keys and MindSpeed-MM's LoRA keys
    (`training.lora` of its FSDP2 back-end and `lora_args`), so their blocks can be pasted as they are written."""

    enable: bool = Field(True, description="MindSpeed-MM's switch: false leaves the model without adapters")
    rank: int = Field(8, ge=1, description="rank r of the low-rank matrices A (r x in) and B (out x r)")
    alpha: int | None = Field(None, gt=0, description="the update is scaled by alpha / rank; default 2 x rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: Annotated[list[str], BeforeValidator(_module_names)] = Field(
        default_factory=lambda: ["all-linear"],
        description="'all-linear' (every linear layer but the LM head), or module names (a suffix such as q_proj) "
        "and module-path patterns (`model.layers.{*}.self_attn.q_proj`)",
    )
    modules_to_save: Annotated[list[str], BeforeValidator(_module_names)] = Field(
        default_factory=list, description="whole modules trained (and saved with the adapter) besides the adapters"
    )
    adapter: str | None = Field(
        None, description="a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start from"
    )
    dtype: OptionalDType = Field(
        "fp32", description="dtype of the adapters' stored weights (fp32 over a bf16 base); none = the base's dtype"
    )
    init_lora_weights: bool | Literal["gaussian"] = Field(
        True, description="peft's initialisation: true (A Kaiming-uniform, B zero), gaussian, or false (B random)"
    )

    register_forward_hook: Annotated[list[str], BeforeValidator(_module_names)] = Field(
        default_factory=list,
        description="modules (by name, e.g. embed_tokens) whose outputs are made to require grad so that reentrant "
        "recompute reaches the adapters; the input embeddings always are when layers are recomputed",
    )

    ALIASES: ClassVar[dict[str, str]] = {
        "lora_register_forward_hook": "register_forward_hook",
        "r": "rank",
        "lora_rank": "rank",
        "lora_r": "rank",
        "lora_alpha": "alpha",
        "lora_dropout": "dropout",
        "lora_target": "target_modules",
        "lora_target_modules": "target_modules",
        "additional_target": "modules_to_save",
        "adapter_name_or_path": "adapter",
        "pretrained_lora_path": "adapter",
    }

    @property
    def scale_alpha(self) -> int:
        return self.alpha if self.alpha is not None else 2 * self.rank

    @model_validator(mode="after")
    def _sane_scaling(self) -> LoraConfig:
        """alpha / rank multiplies every adapter update: published recipes use 0.5-64 (rsLoRA's alpha/sqrt(rank)
        stays below too); past 1000 the first update swamps the base model and every step trains at ln(vocab)."""
        if self.scale_alpha / self.rank > MAX_LORA_SCALING:
            raise ValueError(
                f"alpha {self.scale_alpha} over rank {self.rank} scales every adapter update by "
                f"{self.scale_alpha / self.rank:g}, which destroys the base model's output; give alpha at most "
                f"{MAX_LORA_SCALING} x rank (usual: 1-2 x rank)"
            )
        return self


class ModelConfig(Section):
    name_or_path: str = Field("builtin:tiny-llama", description="`builtin:<name>` or a local HF model folder")
    config: dict[str, Any] = Field(default_factory=dict, description="overrides applied to the transformers config")
    dtype: DType = Field("fp32", description="dtype of the model's weights (compute dtype unless param_dtype is set)")
    init_on_meta: bool = Field(True, description="build on the meta device and materialise only each rank's shards")
    freeze_module_prefix: PatternList = Field(
        default_factory=list, description="parameters under these prefixes are frozen"
    )
    ulysses_size: int = Field(1, ge=1, description="sequence-parallel (Ulysses) degree")
    context_parallel_size: int = Field(
        1,
        ge=1,
        description="context-parallel degree: each rank holds a load-balanced 1/c of every sequence (a front "
        "chunk and its mirror) and attention all-gathers the keys and values over the c ranks; composes with "
        "ulysses_size",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="tensor-parallel degree: each decoder layer's matrices, the embedding and the LM head are split "
        "over this many consecutive ranks by the family's own transformers TP plan (base_model_tp_plan); log-probs "
        "and the loss are computed on the vocabulary shards; FSDP shards over the rest",
    )
    tensor_parallel_plan: dict[str, Literal["colwise", "rowwise"]] = Field(
        default_factory=dict,
        description="module-path patterns (`model.layers.{*}.self_attn.q_proj`) and how each is split, in place of "
        "the family's own plan: colwise (by output columns) or rowwise (by input rows); the LM head is split by "
        "vocabulary either way",
    )
    gradient_checkpointing: bool = Field(False, description="recompute every decoder layer in backward")
    remove_padding: bool = Field(
        False,
        description="the Strategy API packs each padded micro-batch's real tokens into one stream of documents (one "
        "per row, positions from 0) and puts the outputs back at their padded positions, 0 at padding (verl's "
        "use_remove_padding); worth it where documents need no dense mask: FlexAttention or flash_attention_2 on CUDA",
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = Field(
        "auto",
        description="transformers attention implementation; auto: transformers' choice for the family (sdpa where it "
        "has it, else eager); flash_attention_2 runs where flash-attn is installed on CUDA and without Ulysses, "
        "else transformers' choice (the same attention; check notes it); one the family lacks is refused",
    )
    weights_loading: Literal["sliced", "rank0_broadcast"] = Field(
        "sliced", description="safetensors loading: each rank reads its own rows, or rank 0 reads and scatters"
    )
    allow_random_init: bool = Field(
        False,
        description="let a model folder without weights, or a builtin model in `infer`, run on fresh random "
        "weights (otherwise refused: random weights are rarely what was meant)",
    )
    trust_remote_code: bool = Field(
        False,
        description="let transformers run the Python files a model folder ships (its config's auto_map): only "
        "--trust-remote-code (Strategy.from_config(trust_remote_code=True)) turns it on; a config's value is noted, "
        "not applied; off, nothing read from a model folder runs code",
    )
    model_class: str | None = Field(
        None,
        description="build this transformers model class instead of the Auto class: "
        "'package.module:Class' or 'path/to/file.py:Class' (it may define its own plan, `_fully_shard`)",
    )

    lora: LoraConfig | None = Field(None, description="train LoRA adapters (peft) over the frozen model")

    ALIASES: ClassVar[dict[str, str]] = {"model_name_or_path": "name_or_path"}

    @property
    def lora_enabled(self) -> bool:
        return self.lora is not None and self.lora.enable


class WeightedSource(Section):
    """One source of a mixture (`data.source: [{path: a.jsonl, weight: 0.8}, ...]`)."""

    path: str | list[str] = Field(description="a source in any form `data.source` takes (a file, glob, list, folder)")
    weight: float = Field(1.0, gt=0, description="its share of the samples: weight / the sum of the weights")


_ENTRY_KEYS = ("path", "weight")


def _source_entries(value: Any) -> Any:
    """A list naming a mixture holds only {path, weight} mappings; checked here so that a bad entry is one sentence."""
    if not isinstance(value, list) or not any(isinstance(item, dict) for item in value):
        return value
    for number, item in enumerate(value):
        if not isinstance(item, dict):
            raise ValueError(f"every entry of a mixture to be a {{path, weight}} mapping (entry {number} is not)")
        unknown = [key for key in item if key not in _ENTRY_KEYS]
        if unknown:
            raise ValueError(f"entry {number} to have only the keys path, weight (not '{unknown[0]}')")
        if "path" not in item:
            raise ValueError(f"entry {number} to name its source with 'path'")
        if _mixture_weight(item.get("weight", 1.0)) is None:
            raise ValueError(f"entry {number}'s weight to be a finite number > 0 (not {item['weight']!r})")
    return value


def _mixture_weight(weight: Any) -> float | None:
    """A weight as the other float keys take it (YAML reads `1e-3` as a string; pydantic, and so `lr: 1e-3`, takes
    it), or None where it is no finite number > 0."""
    if isinstance(weight, bool) or not isinstance(weight, int | float | str):
        return None
    try:
        number = float(weight)
    except ValueError:
        return None
    return number if math.isfinite(number) and number > 0 else None


SourceSpec = Annotated[str | list[str] | list[WeightedSource], BeforeValidator(_source_entries)]


def is_mixture(source: str | list[str] | list[WeightedSource] | None) -> bool:
    """Whether a source is a weighted mixture (a list of {path, weight})."""
    return isinstance(source, list) and any(isinstance(item, WeightedSource) for item in source)


class DataConfig(Section):
    source: SourceSpec = Field(
        "builtin:corpus",
        description="`builtin:corpus`, a *.jsonl/*.parquet/*.txt file or glob (or a list of files, read as one "
        "source), a local HF dataset folder, or a mixture: a list of {path, weight} whose samples interleave in "
        "those proportions",
    )
    dataset_dir: str | None = Field(
        None,
        description="a LLaMA-Factory data folder: its dataset_info.json names datasets, and `source` (and "
        "`eval_source`) give their names (a name, `a,b`, a list, or a mixture of {path: name, weight}); each is "
        "read as its entry's formatting, columns and tags say; several without weights are concatenated",
    )
    eval_source: SourceSpec | None = Field(
        None,
        description="evaluation data, in any form `source` takes (a mixture's entries are evaluated whole, weights "
        "aside); eval_loss is logged every training.eval_steps and at the end",
    )
    eval_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="instead of eval_source: hold out this fraction of the training samples (seeded, the same at "
        "every run of the seed; removed from training) as the evaluation set",
    )
    tokenizer: str | None = Field(
        None, description="tokenizer folder; default: the model's own (builtin models: the built-in tokenizer)"
    )
    text_key: str = Field("text", description="field holding the text in jsonl/parquet/HF datasets")
    seq_len: int = Field(512, ge=2, description="tokens per training sample")
    pack: bool = Field(True, description="concatenate documents and cut into seq_len windows (else pad each document)")
    shuffle: bool = Field(True, description="shuffle the sample order every epoch (seeded)")
    prompt_key: str = Field(
        "prompt", description="SFT: with this and response_key both present, the loss is on the response only"
    )
    response_key: str = Field("response", description="SFT: field holding the response (followed by EOS)")
    query_key: str | None = Field(
        None, description="SFT: a field appended to the prompt after a newline where present (ROLL's query_key)"
    )
    document_mask: bool = Field(
        True, description="packing: restart position ids at each document so attention never crosses documents"
    )
    max_samples: int | None = Field(
        None, ge=1, description="use only the first N documents of the source (default: all)"
    )
    max_document_bytes: int = Field(
        16 << 20,
        ge=1,
        description="refuse a document (a line of a jsonl or text file) larger than this; reading one costs many "
        "times its size in memory (default 16 MiB)",
    )
    cache_dir: str | None = Field(
        None,
        description="where token stores go (the corpus tokenized once, memory-mapped by every run and rank); "
        "default: ~/.cache/fsdp2kit/tokens, or $FSDP2KIT_CACHE/tokens",
    )
    num_proc: int | None = Field(
        None,
        ge=1,
        description="cores tokenizing a corpus into its token store: threads of a Rust tokenizer, processes for a "
        "Python one (default: every CPU core)",
    )
    max_tokens_per_micro_batch: int | None = Field(
        None,
        ge=1,
        description="group each rank's samples of a step into micro-batches of at most this many padded tokens "
        "(instead of per_device_train_batch_size samples each); the step's samples stay the same",
    )
    format: Literal["auto", "text", "alpaca", "sharegpt", "messages"] = Field(
        "auto",
        description="how records are read: auto (from the fields: `messages`, `conversations`, "
        "`instruction`+`output`, else text or prompt/response), or one of text, alpaca, sharegpt, messages",
    )
    messages_key: str = Field(
        "messages", description="conversations: the field holding a record's chat messages (ROLL's data_args.messages)"
    )
    chat_template: str | None = Field(
        None,
        description="conversations: a Jinja chat template (a file, or the template inline) instead of the "
        "tokenizer's own `chat_template`",
    )
    template: str | None = Field(
        None,
        description="a template name as ROLL, MindSpeed-MM or LLaMA-Factory write it (qwen2_5, llama3, ...): read as "
        "the model's own chat template where it names the model's family, else an error",
    )
    train_on_prompt: bool = Field(
        False, description="conversations: train on every token (prompts, system, tool results), not only the answers"
    )
    mask_history: bool = Field(
        False, description="conversations: train on the last assistant turn only (earlier ones are context)"
    )
    train_on_eos: bool = Field(
        True, description="conversations: train on each assistant turn's end-of-turn token(s) as well as its text"
    )

    @model_validator(mode="after")
    def _one_eval_set(self) -> DataConfig:
        if self.eval_source is not None and self.eval_fraction is not None:
            raise ValueError("one of data.eval_source and data.eval_fraction (held out of source), not both")
        return self


class TrainingConfig(Section):
    learning_rate: float = Field(1.0e-5, gt=0, description="peak learning rate of AdamW (and of Muon, then adjusted)")
    weight_decay: float = Field(
        0.0, ge=0, description="decoupled weight decay of AdamW and Muon (not applied to biases and norms)"
    )
    weight_decay_every_parameter: bool = Field(
        False, description="decay biases and norms too (one AdamW group, as verl's FSDP engine builds it)"
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2")
    adam_epsilon: float = Field(1.0e-8, gt=0, description="AdamW epsilon")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="adamw; muon: torch.optim.Muon's orthogonalised update for the matrices muon_split picks (each "
        "computed on the whole matrix, the work divided among the ranks), AdamW for the rest",
    )
    muon_split: Literal["hidden_matrices", "mindspeed_mm"] = Field(
        "hidden_matrices",
        description="with optimizer muon, which parameters Muon takes: hidden_matrices, the hidden layers' 2-D "
        "matrices and stacked experts (one matrix per expert), AdamW the embeddings, LM head, routers, norms and "
        "biases (torch.optim.Muon's documentation); mindspeed_mm, MindSpeed-MM's rule (_is_muon_eligible, set by its "
        "files): every 2-D parameter whose name has no 'embedding' or 'output_layer' and does not end in '.bias', so "
        "with HF names the embeddings, LM head and routers too, and the 3-D stacked experts to AdamW",
    )
    muon_momentum: float = Field(0.95, ge=0, lt=1, description="with optimizer muon: the momentum of Muon's matrices")
    muon_nesterov: bool = Field(True, description="with optimizer muon: Nesterov momentum")
    muon_ns_steps: int = Field(
        5, ge=1, lt=100, description="with optimizer muon: Newton-Schulz iterations per orthogonalisation"
    )
    muon_lr_adjustment: Literal["match_rms_adamw", "original"] = Field(
        "match_rms_adamw",
        description="with optimizer muon: the learning rate of an A x B matrix times muon_matched_adamw_rms x "
        "sqrt(max(A, B)), so that AdamW's learning rate and weight decay carry over (Moonlight, MindSpeed-MM); "
        "original: times sqrt(max(1, A / B)) (Keller Jordan's; torch.optim.Muon's default)",
    )
    muon_matched_adamw_rms: float = Field(
        0.2, gt=0, description="with muon_lr_adjustment match_rms_adamw: the update RMS matched (torch's 0.2)"
    )
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = Field("cosine", description="decay after warmup")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps from 0 to learning_rate")
    warmup_from_zero: bool = Field(
        False,
        description="warmup step s (from 0) at learning_rate x s / warmup, the first at 0, as transformers' "
        "get_*_schedule_with_warmup (set by configs read from HF Trainer, Accelerate or ROLL arguments); false: "
        "x (s + 1) / warmup, the first step already learns",
    )
    warmup_ratio: float = Field(
        0.0, ge=0, le=1, description="without warmup_steps: warm up for this fraction of the run's steps (rounded up)"
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="linear and cosine decay end at learning_rate x this, not 0 (verl's optim.min_lr_ratio, "
        "Megatron's lr_min / lr)",
    )
    num_cycles: float = Field(
        0.5,
        ge=0,
        description="cosine: the cosine's periods over the decay; 0.5 falls once to the end, 1 falls and rises back "
        "(verl's and transformers' num_cycles)",
    )
    per_device_train_batch_size: int = Field(1, ge=1, description="samples per micro-batch per data-parallel rank")
    per_device_eval_batch_size: int | None = Field(
        None, ge=1, description="samples per evaluation forward per data-parallel rank (default: the training one)"
    )
    eval_steps: int = Field(
        0,
        ge=0,
        description="with an evaluation set (data.eval_source or data.eval_fraction): eval_loss every N steps and "
        "at the end; 0: at the end only",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    num_train_epochs: float = Field(1.0, gt=0, description="epochs over the dataset (ignored when max_steps > 0)")
    max_steps: int = Field(-1, description="optimizer steps to run (> 0); -1 = derive from num_train_epochs")
    max_grad_norm: float = Field(1.0, ge=0, description="clip the global grad norm to this (0 = no clipping)")
    seed: int = Field(42, ge=0, lt=2**63, description="seed of initial weights and data order (0 <= seed < 2**63)")
    output_dir: str = Field("runs/default", description="where metrics, checkpoints and the HF export go")
    logging_steps: int = Field(
        1, ge=1, description="print a progress line every N steps (metrics.jsonl gets every step)"
    )
    save_steps: int = Field(0, ge=0, description="save a DCP checkpoint every N steps (0 = only at the end)")
    save_total_limit: int | None = Field(None, ge=1, description="keep only the newest K checkpoints")
    save_on_stop: bool = Field(
        True,
        description="on SIGTERM, SIGUSR1 (Slurm's --signal) or SIGINT: save the step the run stops after (a committed "
        "checkpoint, as every save) before exiting; false: only finish a save in flight",
    )
    resume: str = Field("auto", description="`auto` (newest checkpoint in output_dir), `never`, or a checkpoint path")
    resume_allow_changes: bool = Field(
        False,
        description="resume even though data, seq_len, the model or the seed changed since the checkpoint "
        "(the run then no longer continues the same loss curve)",
    )
    export_hf: bool = Field(
        True,
        description="write the final model as an HF safetensors folder to output_dir/hf "
        "(with model.lora: the adapter, in PEFT's layout, to output_dir/adapter)",
    )
    export_merged: bool = Field(
        False, description="with model.lora: also write the model with the adapters merged in to output_dir/hf"
    )
    max_nonfinite_steps: int = Field(
        5,
        ge=1,
        description="stop (exit code 1) after this many steps in a row skipped for a non-finite loss or grad norm",
    )
    fp16_initial_scale: float = Field(
        65536.0,
        gt=0,
        description="fp16 compute: initial loss scale (halved on overflow, doubled after 2000 clean steps)",
    )
    report_to: ReportTargets = Field(
        default_factory=_tensorboard_only,
        description="where metrics go besides metrics.jsonl: tensorboard (output_dir/tb), wandb; [] for neither",
    )
    compile: bool = Field(
        False, description="torch.compile each decoder layer (after recompute, before fully_shard); first steps compile"
    )
    track_memory: bool = Field(
        False,
        description="count live tensor bytes by category each step (torch's FSDPMemTracker; slower): "
        "peak_mem_bytes on CPU, peak_mem_categories everywhere",
    )
    profile_steps: list[int] | None = Field(
        None, description="[first, last] steps (1-based) to trace with torch.profiler into output_dir/profile/"
    )
    loss_chunk_tokens: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description="compute the LM head and the loss (and log-probs) over chunks of this many tokens, so that no "
        "[batch, seq, vocab] float32 tensor exists; auto: 1024 above a 32k vocabulary, else off; 0: off",
    )

    ALIASES: ClassVar[dict[str, str]] = {"resume_from_checkpoint": "resume"}

    @field_validator("max_steps")
    @classmethod
    def _steps_or_epochs(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("a number of steps > 0, or -1 to run num_train_epochs (0 would not mean no steps)")
        return value

    @model_validator(mode="after")
    def _decay_shape_needs_a_decay(self) -> TrainingConfig:
        """A decay setting on a schedule that never reads it is a mistake the run would hide (a UserError: one
        sentence naming the key, not the whole section)."""
        if self.min_lr_ratio and self.lr_scheduler_type == "constant":
            raise UserError("training.min_lr_ratio ends a decay; lr_scheduler_type constant never decays")
        if self.num_cycles != 0.5 and self.lr_scheduler_type != "cosine":
            raise UserError(f"training.num_cycles shapes a cosine; lr_scheduler_type is {self.lr_scheduler_type}")
        return self

    @field_validator("profile_steps")
    @classmethod
    def _profile_range(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and not (len(value) == 2 and 1 <= value[0] <= value[1]):
            raise ValueError("[first, last] with 1 <= first <= last")
        return value


class WrapPolicy(Section):
    transformer_layer_cls_to_wrap: PatternList = Field(
        default_factory=list, description="wrap every instance of these classes"
    )
    wrap_embeddings: bool | Literal["untied"] = Field(
        False,
        description="give the input embeddings their own shard group; `untied`: only when they are not tied to "
        "the LM head (ROLL's default)",
    )
    wrap_lm_output: bool = Field(False, description="give the LM head its own shard group")
    moe_experts: PatternList = Field(default_factory=list, description="MoE expert classes to wrap one by one")
    min_num_params: int = Field(
        0, ge=0, description="size-based wrapping: shard every module with at least this many params (0 = off)"
    )
    no_wrap: bool = Field(
        False,
        description="no default per-layer groups: only what other keys select, and the root (Accelerate's NO_WRAP)",
    )


class Float8Config(Section):
    """torchao's float8 training (`strategy_config.float8`): the model's linears matmul in float8 (docs/training.md)."""

    enabled: bool = Field(
        False, description="convert the linears (not the LM head, routers or dims off 16) to torchao's Float8Linear"
    )
    recipe: Literal["tensorwise", "rowwise"] = Field(
        "tensorwise", description="torchao's scaling recipe: one scale per tensor, or per row (more accurate, slower)"
    )
    fsdp_float8_all_gather: bool = Field(
        True, description="tensorwise: FSDP gathers the weights in float8 (half of bf16's bytes) instead of param_dtype"
    )
    exclude_modules: PatternList = Field(
        default_factory=list,
        description="module patterns kept in high precision besides the LM head, routers and linears whose "
        "dimensions are not multiples of 16",
    )

    @model_validator(mode="after")
    def _all_gather_needs_tensorwise(self) -> Float8Config:
        if self.enabled and self.fsdp_float8_all_gather and self.recipe != "tensorwise":
            raise UserError(
                f"strategy_config.float8.fsdp_float8_all_gather: torchao gathers float8 weights only with recipe "
                f"tensorwise, not {self.recipe}; set fsdp_float8_all_gather: false"
            )
        return self


class StrategyConfig(Section):
    fsdp_size: int | Literal["auto"] | None = Field(
        "auto", description="shard group size; auto/<=1/>=world = 1-D FSDP, else HSDP [ddp, fsdp]"
    )
    fsdp_size_exact: bool = Field(
        False,
        description="fsdp_size must divide the world and not exceed it, and 1 replicates on every rank "
        "(MindSpeed-MM's sharding_size) instead of meaning 1-D FSDP",
    )
    param_dtype: OptionalDType = Field(None, description="compute/all-gather dtype (default: model.dtype)")
    reduce_dtype: OptionalDType = Field(None, description="gradient reduce-scatter dtype (default: param_dtype)")
    output_dtype: OptionalDType = Field(None, description="dtype of forward outputs (default: unchanged)")
    cast_forward_inputs: bool = Field(True, description="cast floating inputs to param_dtype (vision encoders: off)")
    reshard_after_forward: bool | int = Field(
        True, description="true = ZeRO-3, false = ZeRO-2, int = reshard to a group of that size"
    )
    sharding_strategy: (
        Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"] | None
    ) = Field(None, description="FSDP1/Accelerate strategy name, mapped onto mesh + reshard_after_forward")
    sub_modules_to_wrap: PatternList = Field(
        default_factory=list, description="module-path patterns that get their own fully_shard"
    )
    wrap_policy: WrapPolicy = Field(
        default_factory=WrapPolicy, description="class/size based selection of shard groups"
    )
    ignored_modules: PatternList = Field(
        default_factory=list, description="module patterns left out of FSDP (replicated)"
    )
    recompute_modules: PatternList = Field(
        default_factory=list,
        description="module patterns recomputed in backward; a class path (`package.module.DecoderLayer`) stands "
        "for every module of that class",
    )
    use_reentrant: bool = Field(True, description="reentrant activation checkpointing implementation")
    activation_offload_modules: PatternList = Field(
        default_factory=list,
        description="module patterns whose saved activations wait in pinned host memory between forward and "
        "backward (CUDA; one module prefetched ahead of its backward; with recompute only the recomputed module's "
        "inputs move); on a CPU a no-op",
    )
    offload_policy: bool = Field(False, description="CPUOffloadPolicy: sharded params, grads and optimizer step on CPU")
    pin_memory: bool = Field(False, description="pinned host memory for offloaded tensors (only with offload)")
    sync_each_batch: bool = Field(
        False,
        description="reduce-scatter gradients after every micro-batch, not once per step: only sharded gradients "
        "are held between micro-batches (less memory, a reduce-scatter per micro-batch; Accelerate's sync_each_batch)",
    )
    num_to_forward_prefetch: int = Field(0, ge=0, description="explicitly prefetch the next k shard groups in forward")
    num_to_backward_prefetch: int = Field(
        1, ge=0, description="explicitly prefetch the previous k shard groups in backward"
    )
    apply_expert_patch: bool = Field(False, description="MoE: every rank runs every expert so collectives match")
    ep_size: int = Field(
        1,
        ge=1,
        description="MoE expert parallelism: each group of ep_size consecutive ranks splits every layer's experts "
        "among its ranks and sends each token to its experts' rank (all-to-all); 1 = off",
    )
    efsdp_size: int = Field(
        1,
        ge=1,
        description="with ep_size > 1: ranks that shard each expert's weights further with FSDP; efsdp_size x "
        "ep_size must divide the world, the rest replicate the experts (ROLL's expert mesh [eddp, efsdp, ep])",
    )
    moe_use_grouped_mm: bool | None = Field(
        None,
        description="fused experts: true = grouped GEMMs (transformers' grouped_mm experts implementation, its "
        "per-expert loop where torch has no kernel), false = the eager loop over the experts, unset = transformers' "
        "default",
    )
    apply_tiled_mlp: bool = Field(False, description="compute MLPs in sequence tiles to cut activation memory")
    tiled_num_shards: int = Field(4, ge=1, description="number of sequence tiles for TiledMLP")
    float8: Float8Config = Field(default_factory=Float8Config, description="float8 matmuls with torchao")
    async_save_ckpt: bool = Field(True, description="overlap checkpoint writes with training")
    ckpt_format: Literal["torch_dcp"] = Field("torch_dcp", description="sharded checkpoint format")

    ALIASES: ClassVar[dict[str, str]] = {
        "sharding_size": "fsdp_size",
        "offload_to_cpu": "offload_policy",
        "expert_parallel_size": "ep_size",  # MindSpeed-MM's name
    }

    @field_validator("fsdp_size")
    @classmethod
    def _fsdp_size_positive(cls, value: Any) -> Any:
        if isinstance(value, int) and value < 0:
            raise ValueError("'auto' or an integer >= 0")
        return value


class StrategyArgs(Section):
    strategy_name: Literal["fsdp2_train", "fsdp2_infer"] = Field("fsdp2_train", description="train or forward-only")
    strategy_config: StrategyConfig = Field(default_factory=StrategyConfig, description="FSDP2 settings")
    strategy_config_path: str | None = Field(
        None, description="a MindSpeed-MM fsdp2_config.yaml or Accelerate config replacing strategy_config"
    )


class JobConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="what to train")
    data: DataConfig = Field(default_factory=DataConfig, description="what to train on")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="optimizer, schedule, outputs")
    strategy_args: StrategyArgs = Field(default_factory=StrategyArgs, description="FSDP2 strategy")
    device_mapping: Annotated[list[int] | None, BeforeValidator(_device_list)] = Field(
        None, description="device ids this job uses; its length is the world size"
    )
    infer_batch_size: int = Field(1, ge=1, description="samples per forward in fsdp2_infer")
    # What a foreign dialect's loader mapped, renamed or could not use (printed by `fsdp2kit check`).
    _notes: list[str] = PrivateAttr(default_factory=list)
    # Native dotted key -> (file, key as written there): set by the loader so later errors name what the user wrote.
    _written_as: Callable[[str], tuple[str, str]] | None = PrivateAttr(None)
    # The files the config was read from, as given (the config, and a strategy file): a run keeps copies.
    _given_files: list[str] = PrivateAttr(default_factory=list)
    # Keys written as `${...}` interpolations (`${oc.env:TOKEN}`), with that text: what saved configs hold.
    _as_written: dict[str, Any] = PrivateAttr(default_factory=dict)

    def saved_dict(self) -> dict[str, Any]:
        """The config as a run saves it: interpolated keys keep their `${...}` text, so the value of an environment
        variable (a token, a private path) never lands in a file."""
        data = self.model_dump(mode="json")
        for key, text in self._as_written.items():
            *parents, leaf = key.split(".")
            node: Any = data
            for part in parents:
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict) and leaf in node:
                node[leaf] = text
        return data

    @property
    def notes(self) -> list[str]:
        return self._notes

    @property
    def given_files(self) -> list[str]:
        return self._given_files

    def written_as(self, native_key: str) -> tuple[str, str] | None:
        """Where a native key was written, or None when the config was read without a record of that."""
        return self._written_as(native_key) if self._written_as else None

    @model_validator(mode="after")
    def _muon_on_the_device(self) -> JobConfig:
        """Raised as a UserError, not a ValueError: one sentence naming both keys, not the whole config."""
        if self.training.optimizer == "muon" and self.strategy_args.strategy_config.offload_policy:
            raise UserError(
                "training.optimizer: muon is not available with strategy_args.strategy_config.offload_policy: true "
                "(Muon gathers each matrix on a rank's device to orthogonalise it; the offloaded ones stay in host "
                "memory); turn offload_policy off, or use training.optimizer: adamw"
            )
        return self

    @model_validator(mode="after")
    def _merged_export_needs_lora(self) -> JobConfig:
        if self.training.export_merged and not self.model.lora_enabled:
            raise ValueError("training.export_merged: true merges LoRA adapters and needs model.lora")
        return self
