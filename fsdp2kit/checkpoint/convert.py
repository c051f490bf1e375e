"""`fsdp2kit convert SRC DST --to hf|torch|dcp`, in one process, without a process group.

- DCP checkpoint (from any world size or mesh) -> HF safetensors folder, streamed group by group;
- DCP checkpoint -> one `torch.save` file holding the model's state dict (HF names);
- HF safetensors folder -> DCP checkpoint usable as `model.name_or_path`;
- LoRA checkpoint (adapters only) -> PEFT adapter folder (`--to hf`), its base model named in its adapter config;
- HF folder + PEFT adapter (`--adapter`) -> HF folder with the adapter merged in, by peft's `merge_and_unload`.
"""

from __future__ import annotations

import errno
import json
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from fsdp2kit.checkpoint.dcp_io import (
    is_dcp,
    model_tensors,
    read_dcp_model,
)
from fsdp2kit.checkpoint.lora_convert import lora_conversion
from fsdp2kit.durable import disk_full_message, folder_bytes, ran_out_of_space
from fsdp2kit.errors import RunFault, UserError
from fsdp2kit.models.build import open_safetensors, safetensors_index, tied_weight_names
from fsdp2kit.models.export import TOKENIZER_FILES, SafetensorsWriter, copy_present_files
from fsdp2kit.models.hf_layout import ModelShapes, checkpoint_conversions, model_views, stored_tensors
from fsdp2kit.models.vl import auto_model_class

MODEL_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)  # copied verbatim, so round trips are exact


def _meta_model(src: Path) -> torch.nn.Module:
    """The model of a folder's config.json, on the meta device (names only, no memory): the transformers class its
    `architectures` names where that class takes this config (a critic's ...ForTokenClassification, a reward
    model's ...ForSequenceClassification, with their `score` heads), else its family's auto class."""
    import transformers
    from transformers import AutoConfig, PreTrainedModel

    config = AutoConfig.from_pretrained(src, trust_remote_code=False)  # a checkpoint of ours: plain transformers
    named = getattr(transformers, (getattr(config, "architectures", None) or [""])[0], None)
    config_class = getattr(named, "config_class", None)
    own = isinstance(named, type) and issubclass(named, PreTrainedModel) and isinstance(config_class, type)
    own = own and isinstance(config, config_class)  # type: ignore[arg-type]
    with torch.device("meta"):
        if own:
            return named._from_config(config)  # type: ignore[union-attr]
        return auto_model_class(config).from_config(config, trust_remote_code=False)


SAFETENSORS_OS_ERROR = re.compile(r"I/O error: (?P<reason>[^(]+?) \(os error (?P<number>\d+)\)")
# A write refused for what the destination is (read-only, not a folder, not ours), not for the space it has.
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST, errno.ENOENT, errno.EISDIR)


def convert(src: Path, dst: Path, to: str, dtype: torch.dtype | None = None, adapter: Path | None = None) -> None:
    """All of `dst` or nothing: a conversion that fails (a full or read-only disk, an interrupt) removes what it
    wrote (the folder itself unless it was there, empty, before) and says why in one sentence."""
    existed = dst.exists()
    ours = not existed or (dst.is_dir() and not any(dst.iterdir()))  # else refused before anything is written
    try:
        with warnings.catch_warnings():  # DCP warns that it runs without a process group: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _convert(src, dst, to, dtype, adapter)
    except Exception as exc:
        written = ours and dst.is_dir() and (not existed or any(dst.iterdir()))
        os_error = _os_error(exc)
        if os_error is not None and os_error.filename and not str(os_error.filename).startswith(str(dst)):
            os_error = None  # a file it read, not one it wrote
        full = written and _disk_full(dst, exc, os_error)
        if written:
            _remove_written(dst, existed)
        if full:
            needed = sum(folder_bytes(folder) for folder in (src, adapter) if folder is not None)
            raise RunFault(disk_full_message(dst, f"convert --to {to}", needed, "nothing was left there")) from None
        if os_error is not None:
            reason = os_error.strerror or str(os_error)
            raise UserError(f"convert: '{dst}' cannot be written ({reason}); nothing was left there") from None
        raise


def _disk_full(dst: Path, exc: Exception, os_error: OSError | None) -> bool:
    """ENOSPC, or a disk left (almost) without space, unless the write was refused for what the destination is: a
    filesystem that cannot hold files (/proc, /sys) reports no free space either."""
    if os_error is not None and os_error.errno in NOT_WRITABLE:
        return False
    return (os_error is not None and os_error.errno == errno.ENOSPC) or ran_out_of_space(dst, exc)


def _os_error(exc: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError behind a failed write: the exception itself, its cause, or one of DCP's per-rank failures."""
    if exc is None or depth > 20:
        return None
    if isinstance(exc, OSError):
        return exc
    os_error = SAFETENSORS_OS_ERROR.search(str(exc))  # safetensors' writer raises its own type, errno in the text
    if os_error is not None:
        return OSError(int(os_error["number"]), os_error["reason"])
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: each rank's exception
    for failure in failures.values() if isinstance(failures, dict) else ():
        found = _os_error(failure[0], depth + 1)
        if found is not None:
            return found
    return _os_error(exc.__cause__ or exc.__context__, depth + 1)


def _remove_written(dst: Path, existed: bool) -> None:
    """What a failed conversion wrote: the folder it made, or the contents of the empty folder it was given."""
    if not existed:
        shutil.rmtree(dst, ignore_errors=True)
        return
    for entry in dst.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def _convert(src: Path, dst: Path, to: str, dtype: torch.dtype | None, adapter: Path | None) -> None:
    if not src.is_dir():
        raise UserError(f"convert: '{src}' is not a folder")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise UserError(f"convert: '{dst}' exists and is not an empty folder; give a new folder")
    conversion = lora_conversion(src, to, adapter)  # a LoRA checkpoint, or an adapter to merge
    if conversion is not None:
        conversion(dst, dtype)
        return
    if to == "dcp":
        _hf_to_dcp(src, dst, dtype)
        return
    if not is_dcp(src):
        raise UserError(f"convert --to {to}: '{src}' is not a DCP checkpoint (it has no .metadata)")
    if not (src / "config.json").is_file():
        raise UserError(f"convert: '{src}' has no config.json; it was not written by fsdp2kit")
    tensors = model_tensors(src)
    model = _meta_model(src)
    tied = tied_weight_names(model)
    names = [n for n in tensors if n not in tied]
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    dst.mkdir(parents=True, exist_ok=True)
    if to == "hf":
        writer = SafetensorsWriter(dst)
        layout = ModelShapes(checkpoint_conversions(model), model.config, {n: t.size for n, t in tensors.items()})
        for name, tensor in stored_tensors(read_dcp_model(src, names, tensors), names, layout):  # save_pretrained's
            writer.add(name, cast(tensor))
        writer.close()
    else:  # torch
        state = {name: cast(tensor) for name, tensor in read_dcp_model(src, list(tensors), tensors)}
        torch.save(state, dst / "model.pt")
    copy_present_files(src, dst, MODEL_FILES)
    _record_dtype(dst, dtype)


def _record_dtype(dst: Path, dtype: torch.dtype | None) -> None:
    """config.json says which dtype the weights are stored in (transformers loads them as that by default): after a
    cast it must name the new one. Only that key changes, so a conversion without --dtype stays byte-exact."""
    config_file = dst / "config.json"
    if dtype is None or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    name = str(dtype).removeprefix("torch.")
    for key in ("dtype", "torch_dtype"):  # transformers >= 4.56 writes `dtype`, older versions `torch_dtype`
        if key in config:
            config[key] = name
    if "dtype" not in config and "torch_dtype" not in config:
        config["dtype"] = name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _hf_to_dcp(src: Path, dst: Path, dtype: torch.dtype | None) -> None:
    if not (src / "config.json").is_file() or not any(src.glob("*.safetensors")):
        raise UserError(f"convert --to dcp: '{src}' is not an HF model folder (config.json + *.safetensors)")
    model = _meta_model(src)
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    layout = ModelShapes(checkpoint_conversions(model), model.config, expected)  # DCP holds the model's own names
    index = safetensors_index(src)  # the index decides; a tensor in two files is refused
    handles = {file: open_safetensors(file) for file in sorted(set(index.values()))}
    try:  # safetensors memory-maps: pages are read as DCP writes them (converted tensors: when converted)
        views = model_views(index, lambda key: handles[index[key]].get_slice(key), layout, index)
        state = {name: view.open()[:] for name, view in views.items()}
        _check_against_config(src, state, model)
        if dtype is not None:
            state = {key: tensor.to(dtype) for key, tensor in state.items()}
        dst.mkdir(parents=True, exist_ok=True)
        dcp.save({"model": state}, checkpoint_id=str(dst), no_dist=True)
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    copy_present_files(src, dst, MODEL_FILES)
    _record_dtype(dst, dtype)


def _check_against_config(src: Path, state: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    """The files' tensors are the config's model's: none extra, none missing (a tied head aside), every shape."""
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    tied = tied_weight_names(model)
    extra = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state) - set(tied))
    wrong = sorted(name for name in set(state) & set(expected) if state[name].shape != expected[name])
    if extra or missing or wrong:
        problem = (
            f"holds '{extra[0]}', which its config.json's model lacks"
            if extra
            else f"lacks '{missing[0]}'"
            if missing
            else f"holds '{wrong[0]}' as {tuple(state[wrong[0]].shape)}, not {tuple(expected[wrong[0]])}"
        )
        raise UserError(f"convert --to dcp: '{src}' {problem}; its weights and config.json do not match")
