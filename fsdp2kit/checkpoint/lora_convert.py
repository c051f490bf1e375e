"""`fsdp2kit convert` for LoRA: a LoRA checkpoint (adapters only) -> PEFT adapter folder, and an HF folder with a
PEFT adapter (`--adapter`) -> the merged HF folder. `lora_conversion` says which of them a conversion is, if any."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdp2kit.checkpoint.dcp_io import is_dcp, model_tensors, read_dcp_model
from fsdp2kit.errors import UserError
from fsdp2kit.models.export import TOKENIZER_FILES, copy_present_files
from fsdp2kit.models.lora import ADAPTER_CONFIG_FILE

Conversion = Callable[[Path, torch.dtype | None], None]


def lora_conversion(src: Path, to: str, adapter: Path | None) -> Conversion | None:
    """The LoRA conversion of SRC (writing DST in a given dtype), or None when SRC is a whole model."""
    if adapter is not None:
        if to != "hf" or is_dcp(src):
            raise UserError(
                "convert --adapter: merges a PEFT adapter into an HF model folder; give --to hf and an HF SRC"
            )
        return lambda dst, dtype: merge_adapter(src, adapter, dst, dtype)
    if is_dcp(src) and (src / ADAPTER_CONFIG_FILE).is_file():
        if to != "hf":
            raise UserError(f"convert --to {to}: '{src}' is a LoRA checkpoint (adapters only); convert it --to hf")
        return lambda dst, dtype: adapter_checkpoint_to_peft(src, dst, dtype)
    return None


def adapter_checkpoint_to_peft(src: Path, dst: Path, dtype: torch.dtype | None) -> None:
    """The adapters of a LoRA checkpoint in PEFT's layout. peft names the keys: it gets the base model (from the
    adapter config) built on the meta device with the adapters injected, which costs no memory."""
    from fsdp2kit.config.schema import ModelConfig
    from fsdp2kit.models.build import build_meta_model, resolve_model
    from fsdp2kit.models.lora import inject_peft, peft_keys, read_adapter_config, write_adapter_folder

    config = read_adapter_config(src, "convert", weights=False)
    base = ModelConfig.model_validate({"name_or_path": config.base_model_name_or_path or ""})
    model = build_meta_model(resolve_model(base), base)
    inject_peft(model, config)
    file_keys = peft_keys(model)
    tensors = model_tensors(src)
    unknown = sorted(set(tensors) - set(file_keys))
    if unknown:
        raise UserError(f"convert: '{src}' holds '{unknown[0]}', which is no adapter of '{base.name_or_path}'")
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    weights = {file_keys[name]: cast(tensor) for name, tensor in read_dcp_model(src, list(tensors), tensors)}
    write_adapter_folder(dst, config, weights)


def merge_adapter(src: Path, adapter: Path, dst: Path, dtype: torch.dtype | None) -> None:
    """peft's own merge, in one process: the base model is held once in CPU memory."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdp2kit.models.lora import read_adapter_config

    read_adapter_config(adapter, "convert --adapter")
    if not (src / "config.json").is_file():
        raise UserError(f"convert --adapter: '{src}' is not an HF model folder (config.json + *.safetensors)")
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # the output is our phase lines and, on a mistake, one error line
    base = AutoModelForCausalLM.from_pretrained(src, dtype=dtype or "auto")
    try:
        with warnings.catch_warnings():  # peft warns of adapter keys it did not find: checked below, in one line
            warnings.simplefilter("ignore")
            model = PeftModel.from_pretrained(base, adapter)
    except (RuntimeError, ValueError, KeyError) as exc:  # shapes that do not fit the base
        reason = str(exc).strip().splitlines()[-1].strip()
        raise UserError(f"convert --adapter: '{adapter}' does not fit the model '{src}': {reason}") from None
    _refuse_unloaded_adapter(model, adapter, src)
    merged = model.merge_and_unload()
    merged.save_pretrained(dst)
    copy_present_files(src, dst, TOKENIZER_FILES)


def _refuse_unloaded_adapter(model: Any, adapter: Path, src: Path) -> None:
    """peft loads an adapter whose tensors do not match its own config with a warning and merges nothing: the
    output would equal the base model. Every tensor the config asks for must be in the file, and nothing else."""
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    from fsdp2kit.models.lora import ADAPTER_WEIGHTS_FILE

    expected = set(get_peft_model_state_dict(model))
    with safe_open(str(adapter / ADAPTER_WEIGHTS_FILE), framework="pt") as handle:
        stored = set(handle.keys())
    missing, unexpected = sorted(expected - stored), sorted(stored - expected)
    if missing or unexpected:
        which = f"lacks '{missing[0]}'" if missing else f"has '{unexpected[0]}', which its config has no place for"
        raise UserError(
            f"convert --adapter: '{adapter / ADAPTER_WEIGHTS_FILE}' {which} (on the model '{src}'); its "
            "adapter_config.json and tensors disagree"
        )
