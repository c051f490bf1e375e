"""Build a `transformers` causal LM on the meta device and give each rank only its own shards:
fresh weights (seeded per module, identical at every world size and mesh) or weights read from safetensors."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2kit.checkpoint.dcp_io import METADATA_FILE, read_dcp, refuse_extra_model_tensors, stored_model_keys
from fsdp2kit.config.schema import ModelConfig
from fsdp2kit.dtypes import torch_dtype
from fsdp2kit.errors import UserError
from fsdp2kit.models.builtin import BUILTIN_MODELS
from fsdp2kit.models.hf_layout import StoredTensor, checkpoint_conversions, layout_of, model_views
from fsdp2kit.models.lora import base_renamer, base_state
from fsdp2kit.models.shards import copy_to_shard, module_seed
from fsdp2kit.models.variant_part import TensorLeeway
from fsdp2kit.models.vl import auto_model_class, builtin_tokenizer_dir
from fsdp2kit.parallel.moe import expert_views_from_fused, refuse_other_expert_layout
from fsdp2kit.transformers_compat import configs_check_types

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


@dataclass
class ModelSource:
    """Where a model comes from: its transformers config, its tokenizer and (if pretrained) its weights."""

    hf_config: PretrainedConfig
    tokenizer_path: Path
    weights_dir: Path | None
    weights_format: str | None = None  # "safetensors" (an HF folder) or "dcp" (a checkpoint of ours)


def _hf_config(load: Callable[..., PretrainedConfig], where: str, overrides: dict) -> PretrainedConfig:
    """A transformers config built by `load` (AutoConfig.for_model or .from_pretrained, keyword overrides) with
    `model.config` overrides (so derived fields such as layer_types follow); `where` names it in errors."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        base = load()
        for key in overrides:
            if not hasattr(base, key):
                raise UserError(f"model.config.{key}: the {type(base).__name__} has no such setting")
        config = load(**overrides) if overrides else base
    except (ValueError, TypeError, OSError, KeyError, StrictDataclassError) as exc:
        # transformers' configs check their fields' types (huggingface_hub's strict dataclasses): `"hidden_size": "64"`
        reason = str(exc).strip().splitlines()[-1].strip()
        raise UserError(f"{where} is not a valid transformers config: {reason}") from None
    _check_sizes(config, where, overrides)
    return config


# Sizes every causal LM has; transformers builds some models with a 0 or a negative one, or fails deep inside.
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_sizes(config: PretrainedConfig, where: str, overrides: dict) -> None:
    for key in _SIZES:
        value = getattr(config.get_text_config(), key, None)
        if isinstance(value, int) and value < 1:
            named = f"model.config.{key}" if key in overrides else f"{where}: {key}"
            raise UserError(f"{named} = {value}: a model's sizes are whole numbers >= 1")


def _refuse_own_code(folder: Path, trusted: bool) -> None:
    """A folder whose config.json names its own Python (`auto_map`) needs that code, which runs only when the user
    trusts it (docs/security.md). Untrusted, transformers would build its own class of the same model_type instead,
    or fail deep inside: refused in one line naming the class."""
    auto_map = {} if trusted else _auto_map(folder)
    if not auto_map:
        return
    chosen = next((auto_map[k] for k in ("AutoModelForCausalLM", "AutoModel", "AutoConfig") if k in auto_map), None)
    named = chosen if chosen is not None else next(iter(auto_map.values()))
    class_name = next((c for c in named if c), named) if isinstance(named, list) else named
    raise UserError(
        f"model.name_or_path: '{folder}' needs its own code ({class_name}, from config.json's auto_map), which "
        "fsdp2kit runs only when you pass --trust-remote-code (trust_remote_code=True to Strategy.from_config)"
    )


def resolve_model(cfg: ModelConfig, tokenizer: str | None = None) -> ModelSource:
    from transformers import AutoConfig

    name = cfg.name_or_path
    if name.startswith("builtin:"):
        key = name.split(":", 1)[1]
        if key not in BUILTIN_MODELS:
            raise UserError(
                f"model.name_or_path: unknown built-in model '{name}'; valid: "
                + ", ".join(f"builtin:{k}" for k in BUILTIN_MODELS)
            )
        settings = {**BUILTIN_MODELS[key], **cfg.config}  # model.config may even pick another architecture
        hf_config = _hf_config(partial(AutoConfig.for_model, settings.pop("model_type")), "model.config", settings)
        weights_dir, weights_format, default_tokenizer = None, None, builtin_tokenizer_dir(hf_config)
    else:
        folder = Path(name)
        if not (folder / "config.json").is_file():
            raise UserError(
                f"model.name_or_path: '{name}' is not a model folder or checkpoint with a config.json "
                "(or a builtin: model: " + ", ".join(f"builtin:{k}" for k in BUILTIN_MODELS) + ")"
            )
        _refuse_own_code(folder, cfg.trust_remote_code)
        with _own_code_errors(_own_config_class(folder, cfg.trust_remote_code)):
            hf_config = _hf_config(
                partial(AutoConfig.from_pretrained, folder, trust_remote_code=cfg.trust_remote_code),
                f"'{folder / 'config.json'}'",
                cfg.config,
            )
        if (folder / METADATA_FILE).is_file():
            weights_dir, weights_format = folder, "dcp"
        elif any(folder.glob("*.safetensors")):
            weights_dir, weights_format = folder, "safetensors"
        else:
            _refuse_missing_weights(folder, name, cfg.allow_random_init)
            weights_dir, weights_format = None, None
        default_tokenizer = folder
    tokenizer_path = Path(tokenizer) if tokenizer else default_tokenizer
    if not (tokenizer_path / "tokenizer_config.json").is_file() and not (tokenizer_path / "tokenizer.json").is_file():
        raise UserError(f"data.tokenizer: no tokenizer files in '{tokenizer_path}'")
    return ModelSource(hf_config, tokenizer_path, weights_dir, weights_format)


def check_data_fits(hf_config: PretrainedConfig, seq_len: int, tokenizer: Any) -> None:
    """What fsdp2kit's own data pipeline feeds the model must fit it; asked only where fsdp2kit reads data (an API
    caller brings its own). Positions past the model's table are not an error in most attention code: they are
    silently garbage; a token id past the embedding table is an IndexError deep in training (on CUDA an assert)."""
    text_config = hf_config.get_text_config()
    limit = getattr(text_config, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise UserError(
            f"data.seq_len: {seq_len} is more than the model's max_position_embeddings ({limit}); give at most "
            f"{limit}, or raise model.config.max_position_embeddings if the model was trained for longer"
        )
    vocab = getattr(text_config, "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise UserError(
            f"model.config.vocab_size: the model embeds {vocab} token ids but its tokenizer has {len(tokenizer)} "
            "tokens; give the model's own tokenizer (data.tokenizer) or a vocab_size of at least the tokenizer's"
        )


PICKLED_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def _refuse_missing_weights(folder: Path, name: str, allow_random_init: bool) -> None:
    """A model folder without safetensors or a DCP checkpoint would train and infer on random weights."""
    pickled = sorted(p.name for pattern in PICKLED_WEIGHTS for p in folder.glob(pattern))
    if pickled:
        raise UserError(
            f"model.name_or_path: '{name}' holds its weights as '{pickled[0]}', a pickle that can run code when "
            "loaded, which fsdp2kit does not read; save them as safetensors (transformers: "
            "from_pretrained(folder).save_pretrained(folder), which reads .bin with weights_only=True)"
        )
    if not allow_random_init:
        raise UserError(
            f"model.name_or_path: '{name}' has a config.json but no weights (*.safetensors or a DCP checkpoint); "
            "set model.allow_random_init: true to start from fresh random weights"
        )


def load_model_class(spec: str, hf_config: PretrainedConfig) -> type[PreTrainedModel]:
    """`model.model_class`: a transformers model class for this config, from an importable module or a .py file
    (relative paths from the current directory). Local code only: nothing is downloaded."""
    from transformers import PreTrainedModel

    where, _, class_name = spec.rpartition(":")
    if not where or not class_name:
        raise UserError(f"model.model_class: '{spec}' must look like 'package.module:Class' or 'path/to/file.py:Class'")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise UserError(f"model.model_class: no such file '{path}'")
        module_spec = importlib.util.spec_from_file_location(f"fsdp2kit_model_class.{path.stem}", path)
        if module_spec is None or module_spec.loader is None:
            raise UserError(f"model.model_class: '{path}' cannot be loaded as a Python module")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # so that the module can refer to itself (dataclasses, pickling)
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise UserError(f"model.model_class: cannot import '{where}': {exc}") from None
    model_class = getattr(module, class_name, None)
    if where == "transformers" and class_name.startswith("AutoModel") and model_class is not None:
        model_class = _auto_model_class(model_class, class_name, hf_config)
    if not (isinstance(model_class, type) and issubclass(model_class, PreTrainedModel)):
        raise UserError(f"model.model_class: '{where}' has no transformers model class named '{class_name}'")
    config_class = model_class.config_class
    if config_class is not None and not isinstance(hf_config, config_class):
        raise UserError(
            f"model.model_class: {class_name} takes a {config_class.__name__}, but the model's "
            f"config is a {type(hf_config).__name__}"
        )
    return model_class


def _auto_model_class(auto_class: Any, class_name: str, hf_config: PretrainedConfig) -> Any:
    """The class a transformers Auto class picks for this config's family (`transformers:AutoModelForToken
    Classification`: Qwen2ForTokenClassification for a Qwen2), as `from_pretrained` would."""
    try:
        return auto_class._model_mapping[type(hf_config)]
    except KeyError:
        raise UserError(
            f"model.model_class: transformers' {class_name} has no class for a {type(hf_config).__name__}"
        ) from None


def resolve_attention(requested: str, ulysses_size: int = 1) -> tuple[str | None, str | None]:
    """What `model.attn_implementation` asks transformers for (None: its own choice for the family, sdpa where the
    family has it, else eager) and a note when that is not what was asked: flash_attention_2 needs the flash-attn
    package and CUDA, and Ulysses runs sdpa or eager over the gathered sequence; elsewhere transformers' choice
    computes the same attention. The build refuses an implementation the family does not have (`build_meta_model`)."""
    if requested == "auto":
        return None, None
    if requested != "flash_attention_2":
        return requested, None
    if ulysses_size > 1:
        why = "does not run inside Ulysses or context parallel (model.ulysses_size or context_parallel_size > 1)"
    elif not torch.cuda.is_available():
        why = "needs CUDA"
    elif importlib.util.find_spec("flash_attn") is None:
        why = "needs the flash-attn package"
    else:
        return requested, None
    return None, f"model.attn_implementation: flash_attention_2 {why}; transformers' choice runs the same attention"


def attention_implementation(model: nn.Module) -> str:
    """The attention implementation the model's decoder runs, as transformers resolved it (a VL model's language
    model's; `ulysses_<inner>_group<name>` under Ulysses)."""
    config: Any = model.config
    return str(config.get_text_config()._attn_implementation)


def build_meta_model(source: ModelSource, cfg: ModelConfig) -> PreTrainedModel:
    """The model with every parameter and buffer on the meta device: no memory, any size. It keeps transformers'
    conversions between its tensors and its family's HF folders (`hf_layout.checkpoint_conversions`), taken before
    sharding."""
    sequence_size = cfg.ulysses_size * cfg.context_parallel_size
    source.hf_config._attn_implementation = resolve_attention(cfg.attn_implementation, sequence_size)[0]
    # The model owns its config (transformers' from_config keeps the object it is given): what is switched through
    # it (Ulysses' attention) must not reach another model built from the source's config in the same process.
    config = copy.deepcopy(source.hf_config)
    dtype = torch_dtype(cfg.dtype)
    with torch.device("meta"):
        model_class = load_model_class(cfg.model_class, config) if cfg.model_class else None
        try:
            if model_class is not None:
                model = model_class._from_config(config, dtype=dtype)
            else:
                model = _from_auto_class(config, dtype, cfg.trust_remote_code)
        except ValueError as exc:
            _refuse_attention(exc, cfg.attn_implementation)
            if model_class is not None:
                raise
            raise UserError(
                f"model.name_or_path: transformers cannot build a causal LM from this config: {exc}"
            ) from None
        except TypeError as exc:
            if configs_check_types():
                raise
            import transformers

            raise UserError(
                f"model.name_or_path: transformers cannot build a model from this config: {exc}; transformers "
                f"{transformers.__version__} does not check config.json's field types: check them"
            ) from None
    model.checkpoint_conversions = checkpoint_conversions(model)
    return model


def _from_auto_class(config: Any, dtype: torch.dtype, trusted: bool) -> PreTrainedModel:
    """The model from its family's auto class; the folder's own code for that class where the caller trusts it."""
    auto = auto_model_class(config)
    own = (getattr(config, "auto_map", None) or {}).get(auto.__name__) if trusted else None
    with _own_code_errors(own):
        return auto.from_config(config, dtype=dtype, trust_remote_code=trusted)


@contextmanager
def _own_code_errors(own: str | None) -> Iterator[None]:
    """Where a folder's own code `own` (config.json's auto_map) is trusted, transformers imports it: whatever fails
    there (a missing file or class, the code raising) is one line naming the class, not a traceback from inside
    transformers or the code."""
    if own is None:
        yield
        return
    try:
        yield
    except UserError:
        raise
    except Exception as exc:  # the folder's own code: any exception of it is the folder's fault
        reason = (str(exc).strip().splitlines() or [""])[0].split(" Checkout ")[0]
        raise UserError(
            f"model.name_or_path: the model's own code {own} (config.json's auto_map, trusted by --trust-remote-code) "
            f"cannot build it: {type(exc).__name__}: {reason}"
        ) from None


def _own_config_class(folder: Path, trusted: bool) -> str | None:
    """The config class a trusted folder's auto_map names (None where it names none or is not trusted)."""
    return _auto_map(folder).get("AutoConfig") if trusted else None


def _auto_map(folder: Path) -> dict:
    """config.json's `auto_map` ({} where it has none; and where the file cannot be read, which _hf_config, reading
    it next, reports)."""
    try:
        auto_map = json.loads((folder / "config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return {}
    return auto_map if isinstance(auto_map, dict) else {}


def _refuse_attention(exc: ValueError, requested: str) -> None:
    """transformers' refusal of an attention implementation the family lacks, as one line naming the key."""
    reason = str(exc).strip()
    if "attention implementation" in reason or "attn_implementation" in reason:
        first = reason.split(". ")[0].split("\n")[0]
        raise UserError(
            f"model.attn_implementation: {requested} is not an attention this model has ({first}); "
            "valid: auto (transformers' choice for the family) or eager"
        ) from None


@torch.no_grad()
def initialise_weights(
    model: PreTrainedModel, seed: int, buffers_only: bool = False, only: set[int] | None = None
) -> None:
    """Fresh weights as transformers' `initialize_weights` gives them: children before their parent, each module by
    its nearest (sub-)model's own `_init_weights`, a parent's writes into its children winning (a MoE block that
    initialises its router). Each module's init runs on a full-size CPU copy, seeded by the module's name, and each
    rank keeps its slice: the weights depend on the seed only, not on the mesh. A copy is real only where that
    module's init writes, so peak extra memory is one module's share, never the model's. `only`: the ids of the
    parameters to initialise (those a folder lacked), and no buffers. `buffers_only`: the buffers a folder does not
    hold (rotary tables: not in the state dict); the persistent ones are read with the weights, as `from_pretrained`
    reads them. A tensor no init writes is refused: its value would be whatever memory held. LoRA adapters are left
    to peft's own initialisation (`lora.initialise_adapters`)."""
    if buffers_only:
        wanted = {id(b) for b in model.buffers()} - {id(t) for t in model.state_dict(keep_vars=True).values()}
    else:
        base = {id(t) for t in base_state(model).values()}
        wanted = {id(p) for p in model.parameters() if id(p) in base}
        wanted = wanted & only if only is not None else wanted | {id(b) for b in model.buffers()}
    written: set[int] = set()
    rename = base_renamer(model)
    for name, module, owner in _children_first(model):
        if not any(id(t) in wanted for t in (*module.parameters(), *module.buffers())):
            continue
        own = {id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None} & wanted
        module_init = partial(_run_init, module, owner, module_seed(seed, rename(name) or name))  # LoRA: base's name
        copies = module_init(own)
        # The meta copies this init wrote into (a MoE block's router): once more, those real too.
        below = {key for key, (_, copy) in copies.items() if copy.is_meta and copy._version and key in wanted}
        if below:
            copies = module_init(own | below)
        for key in own | below:
            live, copy = copies[key]
            # A tied weight keeps its first module's values; a parent's write replaces its child's.
            if _was_written(copy) and (key not in written or key in below):
                written.add(key)
                copy_to_shard(live, copy)
    unwritten = wanted - written
    missing = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if id(t) in unwritten]
    if missing:
        raise UserError(
            f"model weights: {type(model).__name__}'s _init_weights leaves '{missing[0]}'"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''} uninitialised (or partly): give"
            " model.name_or_path a folder with its weights"
        )


def _children_first(
    module: nn.Module, name: str = "", owner: Any = None, seen: set[int] | None = None
) -> Iterator[tuple[str, nn.Module, Any]]:
    """(name, module, the nearest PreTrainedModel at or above it) for each module, children before their parent:
    the order and dispatch of transformers' `initialize_weights`; a module reached twice is visited once."""
    from transformers import PreTrainedModel

    seen = set() if seen is None else seen
    owner = module if isinstance(module, PreTrainedModel) else owner
    for child_name, child in module.named_children():
        if id(child) not in seen:
            seen.add(id(child))
            yield from _children_first(child, f"{name}.{child_name}" if name else child_name, owner, seen)
    yield name, module, owner


def _run_init(module: nn.Module, owner: Any, seed: int, real: set[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`owner._init_weights` on a copy of `module` (`_shadow`), seeded: {id of a live tensor: (live, copy)}."""
    shadow, copies = _shadow(module, real)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        owner._init_weights(shadow)
    return copies


def _shadow(module: nn.Module, real: set[int]) -> tuple[nn.Module, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """A copy of `module` and its descendants with their own tensors: full-size on the CPU (floating ones NaN, to
    tell what the init wrote) for the ids in `real`, on the meta device for the rest (in-place writes still count
    in their `_version`). Returns it and {id of the live tensor: (live, copy)}."""
    copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def blank(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in copies:
            device = "cpu" if id(tensor) in real else "meta"
            fill = float("nan") if tensor.is_floating_point() else 0
            copies[id(tensor)] = (tensor, torch.full(tensor.shape, fill, dtype=tensor.dtype, device=device))
        return copies[id(tensor)][1]

    def copy_of(original: nn.Module) -> nn.Module:
        # Same class and attributes, own tensors. Not copy.copy: on a module that is itself a shard group (an
        # embedding, a head) it would call FSDP's class __new__, which runs __init__ again without arguments.
        shadow = object.__new__(type(original))
        shadow.__dict__.update(original.__dict__)
        shadow._parameters = {
            k: None if p is None else nn.Parameter(blank(p), requires_grad=False)
            for k, p in original._parameters.items()
        }
        shadow._buffers = {k: None if b is None else blank(b) for k, b in original._buffers.items()}
        shadow._modules = {k: None if m is None else copy_of(m) for k, m in original._modules.items()}
        return shadow

    return copy_of(module), copies


def _was_written(copy: torch.Tensor) -> bool:
    """Whether an init wrote all of this copy: no NaN of its fill is left (any write, even through `.data`), or, for
    an integer tensor, an in-place op counted."""
    if not copy.is_floating_point():
        return copy._version > 0
    # One pass without a mask: a sum is NaN when a NaN is left (or, rarely, +inf meets -inf: then look closer).
    return not bool(copy.sum().isnan()) or not bool(copy.isnan().any())


def tied_weight_names(model: nn.Module) -> set[str]:
    """Output weights tied to the input embeddings: transformers stores (and expects) them once, under their
    source's name, so export skips them and loading does not look for them."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return set()
    return set(getattr(model, "_tied_weights_keys", None) or {})


def open_safetensors(file: Path) -> Any:
    """A safetensors file opened (headers read, tensors memory-mapped); close it with `__exit__`. A truncated or
    damaged file is one sentence naming it: safetensors checks that the header covers the whole file."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, framework="pt").__enter__()
    except (SafetensorError, OSError) as exc:
        raise UserError(
            f"model weights: '{file}' is not a readable safetensors file ({exc}); it is truncated or damaged"
        ) from None


def safetensors_index(folder: Path) -> dict[str, Path]:
    """Which file holds each tensor: the index's word where there is one (a damaged index is one sentence), else the
    files' headers, where a tensor in two files (a `model_backup.safetensors` left beside `model.safetensors`) is
    refused: which copy a loader takes would be an accident of file order."""
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        return _read_index(index_file)
    names: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open_safetensors(file) as handle:
            for key in handle.keys():
                if key in names:
                    raise UserError(
                        f"model weights: '{names[key]}' and '{file}' both hold '{key}' and no "
                        "model.safetensors.index.json says which to use; remove the stale file"
                    )
                names[key] = file
    return names


def _read_index(index_file: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        reason = f"no {exc}" if isinstance(exc, KeyError) else str(exc).splitlines()[0]
        raise UserError(f"model weights: '{index_file}' is damaged ({reason}); restore it or remove it") from None
    folder = index_file.parent
    outside = sorted({f for f in weight_map.values() if Path(f).name != f})
    if outside:
        raise UserError(f"model weights: '{index_file}' names '{outside[0]}', which is not a file of {folder}")
    return {name: folder / file for name, file in weight_map.items()}


@torch.no_grad()
def _safetensors_views(
    model: nn.Module, folder: Path, handles: dict[Path, Any], leeway: TensorLeeway
) -> tuple[dict[str, tuple[torch.Tensor, Any]], LoadSkips]:
    """Each state-dict tensor with its lazy view in the files (headers only), read as transformers reads the family's
    HF folders (`hf_layout`: renamed, per-expert tensors fused), checked against the model; and what the `leeway`
    let it skip (a new head the files lack, the head they hold that the model has not)."""
    index = safetensors_index(folder)
    tied = tied_weight_names(model)
    state = base_state(model)  # LoRA: the base model's tensors under their own names

    def stored_view(key: str) -> Any:
        file = index[key]
        if not file.is_file():
            raise UserError(f"model weights: file '{file}' named by the index does not exist")
        if file not in handles:
            handles[file] = open_safetensors(file)
        return handles[file].get_slice(key)

    available = model_views(index, stored_view, layout_of(model, state), index)
    # MoE experts split into one module per expert, read from fused experts in the files.
    split = expert_views_from_fused(model, [n for n in state if n not in available], available)
    available.update({name: StoredTensor(*found) for name, found in split.items()})
    consumed = {source for name in state if name in available for source in available[name].sources}
    leftover = {source for name in set(available) - set(state) for source in available[name].sources}
    unused = sorted(source for source in leftover - consumed if source.startswith(leeway.unused))
    unexpected = sorted(leftover - consumed - set(unused))
    if unexpected:
        raise UserError(
            f"model weights: tensor '{unexpected[0]}' in '{folder}' is not part of the model its "
            f"config.json describes ({len(unexpected)} such tensors); config and weights do not match"
        )
    views, fresh = {}, {}
    for name, param in state.items():
        if name in available:
            view, sources = available[name].open(), available[name].sources
            where = f"'{index[sources[0]].name}'" if len(sources) == 1 else f"'{sources[0]}' and the like"
        elif name in tied:
            continue  # tied to its source, loaded under that name
        elif name.startswith(leeway.fresh):
            fresh[name] = param
            continue
        else:
            raise UserError(f"model weights: tensor '{name}' is missing from the safetensors files in '{folder}'")
        if tuple(view.get_shape()) != tuple(param.shape):
            raise UserError(
                f"model weights: tensor '{name}' in {where} has shape {tuple(view.get_shape())}, "
                f"the model expects {tuple(param.shape)}"
            )
        views[name] = (param, view)
    return views, LoadSkips(fresh, unused)


NO_LEEWAY = TensorLeeway()  # every tensor of the model in the folder, and nothing else


@dataclass
class LoadSkips:
    """What a load left out, as the model's `TensorLeeway` allowed: its tensors the folder lacked (by name: to be
    initialised fresh) and the folder's tensors it did not read."""

    fresh: dict[str, torch.Tensor] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)

    def line(self, folder: Path, seed: int) -> str:
        """What transformers warns on such a load, in one line."""
        said = f"model weights: {_listed(list(self.fresh))} not in '{folder}': initialised fresh (seed {seed})"
        return said + (f"; {_listed(self.unused)} in the folder not used" if self.unused else "")


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_safetensors(model: nn.Module, folder: Path, leeway: TensorLeeway = NO_LEEWAY) -> None:
    """What `load_safetensors` refuses (a tensor missing, extra or of another shape, per-expert tensors that do not
    stack), refused from the files' headers alone, on the model built on the meta device: `check`'s word."""
    handles: dict[Path, Any] = {}
    try:
        _safetensors_views(model, folder, handles, leeway)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)


@torch.no_grad()
def load_safetensors(
    model: nn.Module, folder: Path, mode: str = "sliced", leeway: TensorLeeway = NO_LEEWAY
) -> LoadSkips:
    """Fill each rank's shards from the safetensors files; the tensors `leeway` lets the folder lack are left for
    the caller to initialise (returned, with the folder's tensors left unread).

    `sliced` (default): every rank reads only the rows it owns — no rank ever holds a whole tensor, the files are
    read once in total, and no network traffic is needed. `rank0_broadcast`: rank 0 reads each whole tensor and
    scatters the shards — for file systems where many readers are slow; its peak is one full tensor."""
    from torch.distributed.tensor import distribute_tensor

    handles: dict[Path, Any] = {}  # safetensors' safe_open handles, entered
    try:
        # every rank validates: errors come before any collective
        views, skips = _safetensors_views(model, folder, handles, leeway)
        for param, view in views.values():
            if mode == "rank0_broadcast" and isinstance(param, DTensor):
                local = param.to_local()
                full = (
                    view[:].to(local.dtype) if dist.get_rank() == 0 else torch.empty(param.shape, dtype=local.dtype)
                ).to(param.device_mesh.device_type)  # the collective's device: shards may live on the host
                if param.device_mesh.size() == 1:  # NO_SHARD on gloo: each replica holds it whole (replica_reduce.py)
                    dist.broadcast(full, src=0)
                    local.copy_(full)
                else:
                    local.copy_(
                        distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=0).to_local()
                    )
            else:  # sliced, or a replicated (ignored) module that every rank reads whole
                copy_to_shard(param, view)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return skips


def _to_empty_keeping_ties(model: nn.Module, device: torch.device) -> None:
    """`to_empty`, with a parameter that several modules share (tied embeddings and LM head) still one parameter
    after: torch gives each module a new one when a tensor leaves the meta device, so an unsharded tied pair (an
    ignored module, a one-process model) would be initialised, loaded and trained as two."""
    held = [(module, key, param) for module in model.modules() for key, param in module._parameters.items()]
    holders = [(module, key, id(param)) for module, key, param in held if param is not None]
    model.to_empty(device=device)
    first: dict[int, nn.Parameter | None] = {}
    for module, key, meta_id in holders:
        module._parameters[key] = first.setdefault(meta_id, module._parameters[key])


@torch.no_grad()
def _move_unsharded(model: nn.Module, device: torch.device) -> None:
    """Buffers (rotary tables) and the parameters FSDP does not manage (ignored modules) to the compute device: FSDP
    moves only its own shards there. A parameter moves in place (tied ones stay one object); a buffer that several
    modules share stays shared."""
    moved: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device:
                module._buffers[key] = moved.setdefault(id(buffer), buffer.to(device))
        for param in module._parameters.values():
            if param is not None and not isinstance(param, DTensor) and param.device != device:
                param.data = param.data.to(device)


def load_dcp(model: nn.Module, folder: Path, leeway: TensorLeeway = NO_LEEWAY) -> LoadSkips:
    """Load the model part of a DCP checkpoint; DCP reshards it to this run's mesh and world size. The tensors
    `leeway` lets the checkpoint lack are left for the caller to initialise (returned, with those left unread)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = base_state(model, get_model_state_dict(model))  # the live shards: DCP reads into them in place
    cannot_load = f"model weights: checkpoint '{folder}' cannot be loaded into this model"
    stored = stored_model_keys(folder, cannot_load)
    refuse_other_expert_layout(model, stored, cannot_load)
    live = base_state(model)
    fresh = {name: live[name] for name in state if name not in stored and name.startswith(leeway.fresh)}
    unused = sorted(key for key in stored - set(state) if key.startswith(leeway.unused))
    refuse_extra_model_tensors(folder, set(state) | set(unused), cannot_load)
    read_dcp({"model": {name: t for name, t in state.items() if name not in fresh}}, folder, cannot_load)
    return LoadSkips(fresh, unused)


def materialise(
    model: PreTrainedModel,
    source: ModelSource,
    device: torch.device,
    seed: int,
    loading: str = "sliced",
    shard_device: torch.device | None = None,
    leeway: TensorLeeway = NO_LEEWAY,
) -> None:
    """Allocate each rank's shards on `shard_device` (default: `device`; the host under CPU offload, which FSDP
    refuses otherwise), buffers and replicated parameters on `device`, where the forward reads them; then initialise
    them (fresh) or read them (pretrained): the same values wherever they live. A pretrained folder may lack the
    tensors `leeway` names (a new head: initialised fresh, seeded as above, and said in one line on rank 0)."""
    _to_empty_keeping_ties(model, shard_device or device)
    if shard_device is not None and shard_device != device:
        _move_unsharded(model, device)
    if source.weights_dir is None:
        initialise_weights(model, seed)
    else:
        initialise_weights(model, seed, buffers_only=True)  # rotary tables and other computed buffers
        if source.weights_format == "dcp":
            skips = load_dcp(model, source.weights_dir, leeway)
        else:
            skips = load_safetensors(model, source.weights_dir, loading, leeway)
        if skips.fresh:
            initialise_weights(model, seed, only={id(param) for param in skips.fresh.values()})
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(skips.line(source.weights_dir, seed), flush=True)
