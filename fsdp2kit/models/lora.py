"""LoRA through peft, on a model that FSDP2 shards.

Adapters are injected with `peft.inject_adapter_in_model` into the transformers model built on the meta device,
before the sharding plan. Each decoder layer's adapters are submodules of that layer, so they land in its FSDP
group; the FSDP root stays the transformers model, so every module path a config names (shard groups, recompute,
ignored, frozen) is the one users know. (Wrapping in a `PeftModel` instead would prefix every path with
`base_model.model.` and put a wrapper outside FSDP's root.) What peft renames — a target's weight moves to
`<target>.base_layer.weight`, a module to save becomes `<module>.original_module` plus
`<module>.modules_to_save.default` — is mapped back here, so the base is read from files under its own names,
and the adapter is written with the keys `peft.PeftModel.from_pretrained` reads.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from fsdp2kit.config.schema import LoraConfig, TrainingConfig
from fsdp2kit.dtypes import torch_dtype
from fsdp2kit.errors import UserError
from fsdp2kit.models.shards import SyncedWeights, WeightShard, copy_to_shard, module_seed, shard_of
from fsdp2kit.models.variant_part import VariantPart
from fsdp2kit.parallel.float8 import keep_high_precision, plain_weight
from fsdp2kit.parallel.plan import AdapterPlan, ShardingPlan, match_modules

if TYPE_CHECKING:
    from peft import PeftConfig

ADAPTER = "default"  # peft's adapter name; files written by peft leave it out of their keys
PEFT_MODEL_PREFIX = "base_model.model."  # a PeftModel's path to the model it wraps: the prefix of the file's keys
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
_SET_BY_ADAPTER = ("rank", "alpha", "target_modules", "modules_to_save")


def read_adapter_config(folder: Path, key: str = "model.lora.adapter", weights: bool = True) -> PeftConfig:
    """The `peft.LoraConfig` of a PEFT adapter folder (or of a LoRA checkpoint: `weights=False`), local files only."""
    from peft import LoraConfig as PeftLoraConfig

    if not (folder / ADAPTER_CONFIG_FILE).is_file() or (weights and not (folder / ADAPTER_WEIGHTS_FILE).is_file()):
        raise UserError(
            f"{key}: '{folder}' is not a PEFT adapter folder ({ADAPTER_CONFIG_FILE} + {ADAPTER_WEIGHTS_FILE})"
        )
    try:
        config = PeftLoraConfig.from_pretrained(str(folder))
    except (ValueError, TypeError, KeyError, json.JSONDecodeError) as exc:
        raise UserError(f"{key}: '{folder / ADAPTER_CONFIG_FILE}' is not a LoRA config: {exc}") from None
    if config.peft_type != "LORA":
        raise UserError(f"{key}: '{folder}' holds a {config.peft_type} adapter; only LoRA is supported")
    _check_adapter_settings(config, folder / ADAPTER_CONFIG_FILE, key)
    if weights:
        _check_adapter_weights(folder / ADAPTER_WEIGHTS_FILE, key)
    return config


def _check_adapter_settings(config: Any, file: Path, key: str) -> None:
    """peft reads `r: "abc"` without a word and fails deep in the model build: the numbers are checked here."""
    for name, value in (("r", config.r), ("lora_alpha", config.lora_alpha)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise UserError(f"{key}: '{file}' has {name} = {value!r}; it must be a number > 0")
    if not isinstance(config.r, int):
        raise UserError(f"{key}: '{file}' has r = {config.r!r}; the rank must be a whole number")
    init = config.init_lora_weights
    if isinstance(init, str) and init != "gaussian":  # pissa, olora, loftq, corda, eva, ...: computed from the base
        raise UserError(
            f"{key}: '{file}' has init_lora_weights = {init!r}, an initialisation peft computes from the base "
            "weights as it injects the adapter, which the meta-device build does not hold; give an adapter saved "
            "with init_lora_weights true or gaussian (peft converts a PiSSA or OLoRA adapter when saved with "
            "path_initial_model_for_weight_conversion)"
        )


def _check_adapter_weights(file: Path, key: str) -> None:
    """A truncated or damaged adapter_model.safetensors is one sentence (safetensors checks header against size)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except (SafetensorError, OSError) as exc:
        raise UserError(
            f"{key}: '{file}' is not a readable safetensors file ({exc}); it is truncated or damaged"
        ) from None


def _resolve_targets(model: nn.Module, names: list[str], key: str) -> list[str]:
    """Module-path patterns (`model.layers.{*}.self_attn.q_proj`, our shard-group syntax) become the module names
    they match; plain names stay suffixes, as peft reads them."""
    patterns = [n for n in names if "{" in n]
    resolved = match_modules(model, patterns, key) if patterns else []
    return [n for n in names if "{" not in n] + resolved


def peft_config(cfg: LoraConfig, model: nn.Module) -> Any:
    """The `peft.LoraConfig` for `model.lora`: an existing adapter's own, or one built from the section."""
    from peft import LoraConfig as PeftLoraConfig

    if cfg.adapter:
        config: Any = read_adapter_config(Path(cfg.adapter))  # a peft LoraConfig
        for key in _SET_BY_ADAPTER:
            if key in cfg.model_fields_set:
                raise UserError(
                    f"model.lora.{key}: the adapter '{cfg.adapter}' sets it in its {ADAPTER_CONFIG_FILE}; drop the key"
                )
        if "dropout" in cfg.model_fields_set:
            config.lora_dropout = cfg.dropout
        config.inference_mode = False
        return config
    targets: str | list[str] = _resolve_targets(model, cfg.target_modules, "model.lora.target_modules")
    if "all-linear" in targets:  # peft's shorthand: every linear layer but the output layer
        if len(targets) > 1:
            raise UserError("model.lora.target_modules: all-linear already takes every linear layer; give it alone")
        targets = "all-linear"
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.scale_alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        modules_to_save=_resolve_targets(model, cfg.modules_to_save, "model.lora.modules_to_save") or None,
        init_lora_weights=cfg.init_lora_weights,
        task_type="CAUSAL_LM",
    )


def inject_lora(model: nn.Module, cfg: LoraConfig, dtype: torch.dtype | None) -> None:
    """Add the adapters to the meta-device model in place; peft marks only them (and modules to save) trainable.
    Adapter weights are kept in `dtype` (`model.lora.dtype`; fp32 over a bf16 base: their updates are too small
    for bf16), or the base's dtype when None."""
    inject_peft(model, peft_config(cfg, model))
    if dtype is not None:
        for module in adapter_modules(model).values():
            module.to(dtype)
    keep_adapters_out_of_float8(model)


def keep_adapters_out_of_float8(model: nn.Module) -> None:
    """float8 training (strategy_config.float8) converts the frozen base's linears, a LoRA layer's `base_layer`
    included, and never what trains: lora_A, lora_B (nn.Linear inside peft's layers) and the modules to save (the
    trained copy and its frozen original, which no forward runs) stay in high precision."""
    inserted, adapters = _structure(model)
    originals = {name for name in inserted if name.endswith(".original_module")}
    for name, module in model.named_modules():
        if name in adapters or name in originals:
            keep_high_precision(module)


def inject_peft(model: nn.Module, config: PeftConfig) -> None:
    """peft's injection, its refusals as one sentence. Each module to save is then made the adapter's trained copy
    with peft's `set_adapter`, as `PeftModel` does: peft 0.12 (ROLL's pin) injects it frozen."""
    from peft import inject_adapter_in_model
    from peft.utils.other import ModulesToSaveWrapper

    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except ValueError as exc:
        linear = next((n for n, m in model.named_modules() if isinstance(m, nn.Linear)), "")
        raise UserError(
            f"model.lora.target_modules: {str(exc).split('. ')[0][:200]} (linear layers are named like '{linear}')"
        ) from None
    for module in model.modules():
        if isinstance(module, ModulesToSaveWrapper):
            module.set_adapter(ADAPTER)


def _structure(model: nn.Module) -> tuple[set[str], set[str]]:
    """(module paths peft inserted into the base's own paths, module paths that hold only adapter weights)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    inserted: set[str] = set()
    adapters: set[str] = set()
    for name, module in model.named_modules():
        children = list(module._modules)
        if isinstance(module, BaseTunerLayer):
            inserted.add(f"{name}.base_layer")
            adapters.update(f"{name}.{child}" for child in children if child != "base_layer")
        elif isinstance(module, ModulesToSaveWrapper):
            inserted.add(f"{name}.original_module")
            adapters.add(f"{name}.modules_to_save")
    return inserted, adapters


def base_renamer(model: nn.Module) -> Callable[[str], str | None]:
    """peft's path of a base tensor or module -> the base model's own path; None for an adapter's.
    The identity on a model without adapters."""
    inserted, adapters = _structure(model)

    def rename(name: str) -> str | None:
        kept, path = [], ""
        for part in name.split("."):
            path = f"{path}.{part}" if path else part
            if path in adapters:
                return None
            if path not in inserted:
                kept.append(part)
        return ".".join(kept)

    return rename


def has_adapters(model: nn.Module) -> bool:
    return bool(getattr(model, "peft_config", None))


def adapter_settings(model: nn.Module) -> Any:
    """The `peft.LoraConfig` that peft attached to the model when it injected the adapters."""
    return model.__dict__["peft_config"][ADAPTER]


def base_state(model: nn.Module, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The base model's entries of a state dict (default: the live tensors), under the base model's own names."""
    rename = base_renamer(model)
    state = model.state_dict(keep_vars=True) if state is None else state
    return {new: tensor for key, tensor in state.items() if (new := rename(key)) is not None}


def adapter_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that hold only adapter weights (lora_A, lora_B, ..., the trained copies of modules to save)."""
    _, adapters = _structure(model)
    return {name: module for name, module in model.named_modules() if name in adapters}


def peft_keys(model: nn.Module, embedding_layers: bool = False) -> dict[str, str]:
    """Each adapter tensor's state-dict key -> its key in PEFT's adapter_model.safetensors (peft's own naming).
    `embedding_layers`: with the base embeddings that peft's save adds under an embedding's adapter
    (`save_embedding_layers`)."""
    from peft import get_peft_model_state_dict

    rename = base_renamer(model)
    whole = model.state_dict(keep_vars=True)
    live = whole if embedding_layers else {key: tensor for key, tensor in whole.items() if rename(key) is None}
    state = get_peft_model_state_dict(
        model, state_dict=live, adapter_name=ADAPTER, save_embedding_layers=embedding_layers
    )
    key_of = {id(tensor): key for key, tensor in live.items()}
    return {key_of[id(tensor)]: PEFT_MODEL_PREFIX + key for key, tensor in state.items()}


def peft_state(model: nn.Module, embedding_layers: bool = False) -> dict[str, torch.Tensor]:
    """The live adapter tensors (and base embeddings: `peft_keys`) under the keys of PEFT's
    adapter_model.safetensors."""
    state = model.state_dict(keep_vars=True)
    return {file_key: state[key] for key, file_key in peft_keys(model, embedding_layers).items()}


# The tensors peft's `update_layer` makes for a layer's adapter, in its order: modules (lora_A / lora_B of a Linear,
# a convolution or a `ParamWrapper`) or bare parameters (an embedding's).
_MADE_BY_PEFT = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def split_adapters(model: nn.Module, modules: dict[str, str]) -> dict[str, str]:
    """Under tensor parallelism an adapter follows its base layer's split: a layer split by output columns has its
    B split alike (A, whole on every rank, sees the whole input); one split by input rows has its A split alike
    (its partial products summed as the base's are) and B whole. A wrapped embedding is refused."""
    from peft.tuners.lora import LoraLayer

    split: dict[str, str] = {}
    for name, style in modules.items():
        layer = model.get_submodule(name)
        if not isinstance(layer, LoraLayer):
            split[name] = style
            continue
        if layer.lora_embedding_A or style.startswith("embedding"):
            raise UserError(
                f"model.lora: '{name}' is split by vocabulary under model.tensor_parallel_size, which its adapter "
                "does not follow; leave it out of lora.target_modules (or set tensor_parallel_size: 1)"
            )
        split[f"{name}.base_layer"] = style
        follower = "lora_B" if style.startswith("colwise") else "lora_A"
        split.update({f"{name}.{follower}.{key}": style for key in getattr(layer, follower)})
    return split


@torch.no_grad()
def initialise_adapters(model: nn.Module, seed: int) -> None:
    """Each layer's adapters as peft's `update_layer` makes them, on full-size CPU copies seeded by the layer's name,
    each rank keeping its slice (as for the base weights: the same at any world size). A module to save starts as a
    copy of the module it replaces."""
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import ModulesToSaveWrapper

    init = adapter_settings(model).init_lora_weights
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.r:
            _initialise_layer(module, module_seed(seed, name), init)
        elif isinstance(module, ModulesToSaveWrapper):
            original = dict(module.original_module.named_parameters())
            for key, param in module.modules_to_save[ADAPTER].named_parameters():
                param.copy_(original[key])  # same shapes and placements: both live in one shard group


def _initialise_layer(layer: Any, seed: int, init: bool | str) -> None:
    """peft's steps on a copy of the layer holding full-size fp32 adapters (peft makes them in fp32): each made
    (a module's `reset_parameters`, as its constructor runs it; an embedding's `torch.randn`), then
    `reset_lora_parameters`; each rank's slice is copied into the live adapters."""
    live = {key: getattr(layer, key) for key in _MADE_BY_PEFT if ADAPTER in getattr(layer, key)}
    full = {key: _full_size_copy(container[ADAPTER]) for key, container in live.items()}
    shadow: Any = object.__new__(type(layer))
    shadow.__dict__.update(layer.__dict__)
    shadow._modules = {**layer._modules, **{key: type(live[key])({ADAPTER: full[key]}) for key in full}}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for clone in full.values():
            if isinstance(clone, nn.Module):
                cast(Any, clone).reset_parameters()
            else:
                clone.normal_()
        shadow.reset_lora_parameters(ADAPTER, init)
    for key, clone in full.items():
        for target, source in zip(_tensors(live[key][ADAPTER]), _tensors(clone), strict=True):
            copy_to_shard(target, source)


def _full_size_copy(entry: Any) -> Any:
    """A CPU copy of an adapter entry (a module of adapter weights, or a bare parameter) with full-size fp32 tensors."""

    def blank(p: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(torch.empty(p.shape, dtype=torch.float32), requires_grad=False)

    if not isinstance(entry, nn.Module):
        return blank(entry)
    shadow = copy.copy(entry)
    shadow._parameters = {key: None if p is None else blank(p) for key, p in entry._parameters.items()}
    return shadow


def _tensors(entry: Any) -> list[torch.Tensor]:
    """An adapter entry's tensors in a fixed order, so that a live entry and its copy pair up."""
    return list(entry.parameters()) if isinstance(entry, nn.Module) else [entry]


@torch.no_grad()
def load_adapter(model: nn.Module, folder: Path) -> None:
    """Fill each rank's adapter shards from a PEFT adapter folder; every key and shape is checked first. A file
    that peft saved with the base embeddings beside an embedding's adapter (its default) also fills them, as
    `PeftModel.from_pretrained` does."""
    from safetensors import safe_open

    expected = peft_state(model)
    file = folder / ADAPTER_WEIGHTS_FILE
    with safe_open(str(file), framework="pt") as handle:
        stored = set(handle.keys())
        if not stored <= set(expected):
            expected = peft_state(model, embedding_layers=True)
        missing = sorted(set(expected) - stored)
        unexpected = sorted(stored - set(expected))
        if missing or unexpected:
            which = f"lacks '{missing[0]}'" if missing else f"has '{unexpected[0]}', which this model has no place for"
            raise UserError(
                f"model.lora.adapter: '{file}' {which}; the adapter was trained on another model or configuration"
            )
        for key, param in expected.items():
            view = handle.get_slice(key)
            if tuple(view.get_shape()) != tuple(param.shape):
                raise UserError(
                    f"model.lora.adapter: tensor '{key}' in '{file}' has shape {tuple(view.get_shape())}, "
                    f"the model expects {tuple(param.shape)}"
                )
            copy_to_shard(param, view)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


@torch.no_grad()
def export_adapter(model: nn.Module, out_dir: Path, base_name_or_path: str, is_main: bool) -> None:
    """Write `out_dir` in PEFT's layout (adapter_config.json + adapter_model.safetensors), which
    `peft.PeftModel.from_pretrained(base, out_dir)` loads. The adapters are small: every rank gathers them whole,
    one at a time, and rank 0 keeps them on CPU."""
    tensors = {key: full_tensor(tensor).cpu() for key, tensor in peft_state(model).items()}
    if is_main:
        write_adapter_folder(out_dir, file_config(model, base_name_or_path), tensors)


def file_config(model: nn.Module, base_name_or_path: str) -> PeftConfig:
    """The adapter's peft config as written to files: it names its base model, as peft's own save does."""
    config = copy.deepcopy(adapter_settings(model))
    config.base_model_name_or_path = base_name_or_path
    config.inference_mode = True
    return config


def write_adapter_folder(out_dir: Path, config: PeftConfig, tensors: dict[str, torch.Tensor]) -> None:
    """The weights first, the config last, so a folder without its config is no adapter to peft; a write that
    fails or is interrupted removes both files, and the folder if it made it."""
    from safetensors.torch import save_file

    made_folder = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / ADAPTER_WEIGHTS_FILE, out_dir / ADAPTER_CONFIG_FILE]
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(written[0]), {"format": "pt"})
        config.save_pretrained(str(out_dir))
    except BaseException:  # an interrupt too
        for path in written:
            path.unlink(missing_ok=True)
        if made_folder and not any(out_dir.iterdir()):
            out_dir.rmdir()
        raise


@dataclass(frozen=True)
class AdaptedTensor:
    """A base tensor that peft's `merge` of a LoRA layer writes: the layer and the tensor's name in its base module."""

    layer: nn.Module
    leaf: str


def _merged_leaves(layer: Any) -> list[str]:
    """The base module's tensors peft's `merge` of `layer` writes: a `ParamWrapper`'s parameter (`parameter_name`: a
    fused experts tensor, a router's weight; peft >= 0.17), else the weight, and the bias where the adapter trains one
    (`lora_bias`)."""
    wrapped = getattr(layer, "parameter_name", None)
    if wrapped is not None:
        return [wrapped]
    return ["weight", *(["bias"] if getattr(layer, "lora_bias", {}).get(ADAPTER) else [])]


def adapted_tensors(model: nn.Module) -> dict[str, AdaptedTensor]:
    """Each base tensor an adapter changes, by its state-dict key. peft nests a wrapper per targeted parameter
    (`experts.base_layer.base_layer.gate_up_proj` is adapted by `experts.base_layer`, `...down_proj` by `experts`):
    each layer's tensors belong to the module at the end of its `base_layer` chain."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    adapted: dict[str, AdaptedTensor] = {}
    for name, module in model.named_modules():
        layer: Any = module
        if not (isinstance(module, LoraLayer) and ADAPTER in layer.lora_A):
            continue
        path, base = f"{name}.base_layer", layer.base_layer
        while isinstance(base, BaseTunerLayer):  # nested: one wrapper per adapted parameter of the same module
            path, base = f"{path}.base_layer", cast(Any, base).base_layer
        adapted.update({f"{path}.{leaf}": AdaptedTensor(layer, leaf) for leaf in _merged_leaves(layer)})
    return adapted


def merged_state(model: nn.Module) -> dict[str, tuple[torch.Tensor, AdaptedTensor | None]]:
    """The base model's tensors under their own names, each with the LoRA layer whose `merge` changes it, if any;
    a module to save gives its trained copy."""
    rename = base_renamer(model)
    state = {key: plain_weight(tensor) for key, tensor in model.state_dict(keep_vars=True).items()}
    adapted = adapted_tensors(model)
    unknown = sorted(set(adapted) - set(state))
    if unknown:  # peft's MultiheadAttention; lora_bias over a layer without a bias
        owner, _, leaf = unknown[0].rpartition(".")
        raise UserError(
            f"model.lora: the {type(adapted[unknown[0]].layer).__name__} adapter on '{owner}' cannot be merged into "
            f"the model's weights (the module has no tensor '{leaf}' for it); use the adapter folder, not a merged one"
        )
    merged: dict[str, tuple[torch.Tensor, AdaptedTensor | None]] = {}
    for key, tensor in state.items():
        new = rename(key)
        if new is None:
            continue
        owner, _, leaf = key.rpartition(".")
        if owner.endswith(".original_module"):  # a module to save: its trained copy replaces it
            tensor = state[f"{owner.removesuffix('.original_module')}.modules_to_save.{ADAPTER}.{leaf}"]
        merged[new] = (tensor, adapted.get(key))
    return merged


def merged_full_tensor(tensor: torch.Tensor, adapted: AdaptedTensor | None) -> torch.Tensor:
    """The whole tensor with its adapter merged in (every rank joins the gathers), in the base tensor's dtype."""
    full = full_tensor(tensor)
    return full if adapted is None else merged_by_peft(adapted, full)


@torch.no_grad()
def merged_by_peft(adapted: AdaptedTensor, full: torch.Tensor) -> torch.Tensor:
    """peft's own `merge` of the layer, run on a copy of it that holds whole tensors: its adapter modules gathered,
    its base module reduced to the (fp32) tensors the merge writes. The sum is taken in fp32 and rounded once to the
    base's dtype. The live layer is left as it is (it stays unmerged)."""
    layer: Any = adapted.layer
    base = layer.get_base_layer()
    holder = nn.Module()
    for leaf in _merged_leaves(layer):
        whole = full if leaf == adapted.leaf else full_tensor(getattr(base, leaf))
        fp32_copy = whole.to(torch.float32, copy=True)  # never the live tensor: the merge adds in place
        holder.register_parameter(leaf, nn.Parameter(fp32_copy, requires_grad=False))
    shadow: Any = object.__new__(type(layer))
    shadow.__dict__.update(layer.__dict__)
    shadow._modules = {key: _gathered_copy(child) for key, child in layer._modules.items() if key != "base_layer"}
    shadow._modules["base_layer"] = holder
    shadow.merged_adapters = []  # the live layer's list and cache are not shared
    shadow._caches = {}
    shadow.merge(adapter_names=[ADAPTER])
    return getattr(holder, adapted.leaf).detach().to(full.dtype)


def _gathered_copy(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` and its children with every parameter and buffer whole (a collective)."""
    clone = copy.copy(module)
    clone._parameters = {
        key: None if p is None else nn.Parameter(full_tensor(p), requires_grad=False)
        for key, p in module._parameters.items()
    }
    clone._buffers = {key: None if b is None else full_tensor(b) for key, b in module._buffers.items()}
    clone._modules = {key: None if c is None else _gathered_copy(c) for key, c in module._modules.items()}
    return clone


def add_input_grad_hooks(model: nn.Module, names: list[str]) -> None:
    """Make these modules' outputs require grad: a reentrant-recomputed layer whose inputs do not would give its
    adapters no gradient when the embeddings below are frozen (transformers' `enable_input_require_grads`)."""
    for name in names:
        model.get_submodule(name).register_forward_hook(lambda _module, _inputs, output: output.requires_grad_(True))


def plan_adapters(model: nn.Module, plan: ShardingPlan, cfg: LoraConfig) -> AdapterPlan:
    """Where the adapters live and what they cost. Each trainable parameter belongs to the innermost shard group
    around it: a decoder layer's adapters are gathered, reduced and resharded with that layer."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    wrapped = sorted({name.rpartition(".")[0] for name in adapter_modules(model)}, key=order.__getitem__)
    frozen = set(plan.frozen_parameters)
    trainable = {n: p for n, p in model.named_parameters() if n not in frozen}
    group_of = {name: group[0] for group in plan.groups for name in group}
    per_group: dict[str, int] = {}
    for name, param in trainable.items():
        inner = group_of.get(max((g for g in group_of if name.startswith(g + ".")), key=len, default=""), "")
        per_group[inner] = per_group.get(inner, 0) + param.numel()
    param_bytes = sum(p.numel() * p.element_size() for p in trainable.values())
    hooks: list[str] = []
    for hook in cfg.register_forward_hook:  # MindSpeed-MM names modules by their last name
        hits = [n for n in order if n == hook or n.endswith("." + hook)]
        if not hits:
            raise UserError(f"model.lora.register_forward_hook: '{hook}' names no module of the model")
        hooks += hits
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    if plan.recompute_modules and plan.use_reentrant and embeddings is not None:
        hooks += [n for n, m in model.named_modules() if m is embeddings][:1]
    settings = adapter_settings(model)  # an existing adapter's own, where one is given
    return AdapterPlan(
        rank=settings.r,
        alpha=settings.lora_alpha,
        dtype=str(next(iter(trainable.values())).dtype).removeprefix("torch.") if trainable else "",
        modules=wrapped,
        groups=per_group,
        parameters=sum(p.numel() for p in trainable.values()),
        parameter_bytes=param_bytes,
        optimizer_state_bytes=2 * param_bytes,
        input_grad_hooks=sorted(set(hooks), key=order.__getitem__),
    )


@torch.no_grad()
def adapter_shards(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[WeightShard]:
    """This rank's block of each LoRA adapter tensor, under the keys of PEFT's adapter_model.safetensors (what peft's
    and vLLM's LoRA loaders read); none for a model without adapters. Gathers nothing."""
    for key, tensor in peft_state(model).items():
        yield shard_of(key, tensor.detach(), dtype)


@torch.no_grad()
def adapter_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each LoRA adapter tensor whole, under its key in PEFT's adapter_model.safetensors (a collective: every rank
    gathers each in turn)."""
    for key, tensor in peft_state(model).items():
        whole = full_tensor(tensor)
        yield key, whole.to(dtype or whole.dtype)


def adapter_config(model: nn.Module, base_name_or_path: str) -> dict[str, object]:
    """The adapter's adapter_config.json, as a dict (what a LoRA loader reads beside the tensors)."""
    return json.loads(json.dumps(file_config(model, base_name_or_path).to_dict(), default=_jsonable))


def _jsonable(value: object) -> object:
    """peft's config holds sets and enums, which its own save writes as lists and their values."""
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return getattr(value, "value", str(value))


@dataclass
class LoraPart(VariantPart):
    """model.lora: adapters injected on the meta model, planned with their layers' shard groups, initialised by
    peft's rules (or read from `adapter`), saved alone in checkpoints with their peft config, exported as a PEFT
    adapter folder."""

    cfg: LoraConfig
    adapters: AdapterPlan | None = None
    keeps_base_dtype = True
    replaces_hf_export = True

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        inject_lora(model, self.cfg, torch_dtype(self.cfg.dtype))

    def after_plan(self, model: nn.Module, plan: ShardingPlan) -> None:
        self.adapters = plan_adapters(model, plan, self.cfg)
        add_input_grad_hooks(model, self.adapters.input_grad_hooks)

    def split_modules(self, model: nn.Module, modules: dict[str, str]) -> dict[str, str]:
        return split_adapters(model, modules)

    def materialise(self, model: nn.Module, seed: int) -> None:
        if self.cfg.adapter:  # every adapter tensor is in its file
            load_adapter(model, Path(self.cfg.adapter))
        elif has_adapters(model):
            initialise_adapters(model, seed)

    def checkpoint_config(self, model: nn.Module, name_or_path: str) -> Any:
        return file_config(model, name_or_path)

    def export(self, model: nn.Module, output_dir: Path, name_or_path: str, tc: TrainingConfig, is_main: bool) -> None:
        if tc.export_hf:
            export_adapter(model, output_dir / "adapter", name_or_path, is_main)

    def describe(self) -> dict[str, Any]:
        return {"lora": dataclasses.asdict(self.adapters) if self.adapters else None}

    def synced_weights(self, model: nn.Module, name_or_path: str) -> SyncedWeights:
        return SyncedWeights(
            "adapter",
            lambda dtype: adapter_tensors(model, dtype),
            lambda dtype: adapter_shards(model, dtype),
            adapter_config(model, name_or_path),
        )
