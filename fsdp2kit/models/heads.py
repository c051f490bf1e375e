"""What a model's forward gives the back-end API, by the head on top of its decoder: a causal LM's next-token
log-probs (its LM head answers chunked token requests, parallel/token_logprobs.py), a critic's value per token
(`model.model_class` naming a transformers `...ForTokenClassification` with one label) or a reward model's score
per sequence (`...ForSequenceClassification` with one label), read at the rightmost token that is not the pad token,
as transformers reads it. `models/variant.py:pick_variant` picks the head; the Strategy asks it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from fsdp2kit.config.schema import ModelConfig
from fsdp2kit.data.dataset import model_inputs
from fsdp2kit.errors import UserError
from fsdp2kit.models.variant_part import VariantPart
from fsdp2kit.parallel.token_logprobs import install_token_head, probe_token_head

Batch = dict[str, torch.Tensor]

_PER_TOKEN = "_fsdp2kit_per_token_scores"


SERVED = (
    "fsdp2kit serves causal LMs (...ForCausalLM, vision-language ...ForConditionalGeneration), critics "
    "(...ForTokenClassification) and reward models (...ForSequenceClassification), the last two with "
    "model.config.num_labels: 1"
)


class LanguageModelHead(VariantPart):
    """A causal LM: forward_step gives `log_probs` [B, T-1], and the loss receives them."""

    output = "log_probs"

    def check_model(self, model: nn.Module) -> None:
        """The model built on the meta device has an LM head (its output embeddings) to answer token requests: any
        other head (question answering, a base model without a head) is refused before anything is loaded."""
        get_head = getattr(model, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if not isinstance(head, nn.Module) or not any(module is head for module in model.modules()):
            raise UserError(
                f"model.model_class: {type(model).__name__} has no LM head (output embeddings) to give next-token "
                f"log-probs; {SERVED}"
            )

    def install(self, model: nn.Module, device: torch.device, where: str) -> None:
        """The LM head answers chunked token requests, checked once against the model's own logits."""
        install_token_head(model)
        probe_token_head(model, device, where)

    def require_log_probs(self, what: str) -> None:
        """Next-token log-probs are what this head gives."""


class ValueHead(VariantPart):
    """A critic: one value per token, `values` [B, T] (every position, no shift), from the `score` layer of a
    transformers `...ForTokenClassification` with one label. Its dropout before the head is off unless the config
    names `classifier_dropout` (transformers' default would be 0.1; verl's critics turn it off too): a value target
    that changes from one forward to the next is noise."""

    output = "values"
    # A critic or reward model starts from a causal LM's folder (its actor's SFT checkpoint, as in verl and ROLL):
    # the shared backbone is read, the LM head left unread, the new score layer initialised fresh.
    fresh_tensors = ("score.",)
    unused_tensors = ("lm_head.",)

    def __init__(self, class_name: str, hf_config: Any) -> None:
        self.class_name = class_name
        labels = getattr(hf_config, "num_labels", None)
        if labels != 1:
            raise UserError(
                f"model.config.num_labels: {class_name} gives the API one {self.output[:-1]} per "
                f"{self._per}, so it needs num_labels: 1, not {labels}"
            )

    _per = "token"

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        config: Any = model.config
        if getattr(config, "classifier_dropout", None) is None:
            config.classifier_dropout = 0.0  # written into the export: transformers loads the same head
        dropout = getattr(model, "dropout", None)
        if isinstance(dropout, nn.Dropout):
            dropout.p = float(config.classifier_dropout)

    def check_model(self, model: nn.Module) -> None:
        if not isinstance(getattr(model, "score", None), nn.Linear):
            raise UserError(
                f"model.model_class: {self.class_name} has no `score` layer to read its outputs from; {SERVED}"
            )

    def install(self, model: nn.Module, device: torch.device, where: str) -> None:
        """Nothing to install: the `score` layer's outputs are read as they are (`check_model` found it)."""

    def require_log_probs(self, what: str) -> None:
        raise UserError(
            f"{what}: model.model_class {self.class_name} gives {self.output}, not next-token log-probs; "
            f"use forward_step for its {self.output} and train_step with a loss_fn({self.output}, batch)"
        )

    def model_batch(self, batch: Batch, model_keys: set[str]) -> Batch:
        """The model's inputs at every position; `labels` only mark the positions that sequence parallel slices."""
        inputs = {k: v for k, v in batch.items() if k in model_keys and isinstance(v, torch.Tensor)}
        inputs["labels"] = torch.zeros_like(batch["input_ids"])
        return inputs

    def local_outputs(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        """This rank's per-token outputs [B, t] float32 (with autograd) and the model's outputs."""
        outputs = model(**model_inputs(batch), use_cache=False)
        return outputs.logits[..., 0].float(), outputs

    def whole(self, per_token: torch.Tensor, batch: Batch) -> torch.Tensor:
        """What the API returns for the batch as given, from the per-token outputs of (at least) its positions."""
        return per_token[:, : batch["input_ids"].shape[1]]

    def check_padding_unread(self, batch: Batch, real: torch.Tensor, computed: str, remedy: str) -> None:
        """Where only the `real` tokens [B, T] are computed as the padded batch computes them (packed, or split
        over a sequence-parallel group): a value per real token is all a critic gives (its outputs at padding are
        masked by the caller's loss). `computed` says why, `remedy` how else to run, for a refusal."""


class ScoreHead(ValueHead):
    """A reward model: `scores` [B], the `score` layer of a transformers `...ForSequenceClassification` (one label)
    at each row's rightmost token that is not `pad_token_id`, as transformers picks it. The layer's per-token output
    is kept and picked here, on the whole sequence: under sequence parallel a rank's slice has no last token."""

    output = "scores"
    _per = "sequence"

    def __init__(self, class_name: str, hf_config: Any) -> None:
        super().__init__(class_name, hf_config)
        self.pad_token_id = hf_config.get_text_config().pad_token_id
        if self.pad_token_id is None:
            raise UserError(
                f"model.config.pad_token_id: {class_name} reads its score at the last token that is not padding, "
                "which needs the pad token's id; set it"
            )

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        """Nothing: a sequence classifier has no dropout before its head."""

    def install(self, model: nn.Module, device: torch.device, where: str) -> None:
        model.get_submodule("score").register_forward_hook(_keep_per_token)

    def local_outputs(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        outputs = model(**model_inputs(batch), use_cache=False)
        return model.get_submodule("score").__dict__.pop(_PER_TOKEN)[..., 0].float(), outputs

    def whole(self, per_token: torch.Tensor, batch: Batch) -> torch.Tensor:
        ids = batch["input_ids"]
        return per_token[torch.arange(ids.shape[0], device=ids.device), self._scored(ids)]

    def _scored(self, ids: torch.Tensor) -> torch.Tensor:
        """Each row's position its score is read at: the rightmost token that is not pad_token_id (transformers')."""
        positions = torch.arange(ids.shape[1], device=ids.device, dtype=torch.int32)
        return (positions * (ids != self.pad_token_id).int()).argmax(-1)

    def check_padding_unread(self, batch: Batch, real: torch.Tensor, computed: str, remedy: str) -> None:
        """A row whose score position is padding by its attention_mask (padded with another id than pad_token_id,
        as collators pad with 0) has a score only the padded computation gives: packed it would be a silent 0, and
        split over ranks a value that depends on the split."""
        ids = batch["input_ids"]
        scored = self._scored(ids)
        unread = (~real.gather(1, scored[:, None].long())).squeeze(1).nonzero().flatten().tolist()
        if unread:
            row, position = unread[0], int(scored[unread[0]])
            raise UserError(
                f"{computed}, but row {row}'s score is read at its last token that is not pad_token_id "
                f"{self.pad_token_id} (position {position}), which attention_mask marks as padding; pad with "
                f"pad_token_id {self.pad_token_id}, as transformers reads the score, or {remedy}"
            )


def _keep_per_token(module: nn.Module, args: Any, output: torch.Tensor) -> None:
    """The score layer's output at every position, before transformers keeps only the last token's."""
    module.__dict__[_PER_TOKEN] = output


HEADS = {"ForTokenClassification": ValueHead, "ForSequenceClassification": ScoreHead}
OutputHead = LanguageModelHead | ValueHead


def pick_head(model_cfg: ModelConfig, hf_config: Any) -> OutputHead:
    """The head model.model_class names: a value or reward model by its class's name, else a causal LM."""
    if model_cfg.model_class is None:
        _refuse_unnamed_head(model_cfg, hf_config)
    class_name = (model_cfg.model_class or "").rpartition(":")[2]
    kind = _head_kind(class_name)
    return LanguageModelHead() if kind is None else HEADS[kind](class_name, hf_config)


def _head_kind(class_name: str) -> str | None:
    return next((suffix for suffix in HEADS if class_name.endswith(suffix)), None)


def _refuse_unnamed_head(model_cfg: ModelConfig, hf_config: Any) -> None:
    """A critic's or reward model's folder (its config.json's `architectures`, as our export writes it) without
    model.model_class: a causal LM would be built, whose LM head the folder lacks. The head that changes what the
    API gives (values, scores) is the config's word, never taken from the folder behind the user's back."""
    stored = (getattr(hf_config, "architectures", None) or [""])[0] or ""
    kind = _head_kind(stored)
    if kind is not None:
        raise UserError(
            f"model.model_class: '{model_cfg.name_or_path}' holds a {stored} (its config.json's architectures) and "
            f"model.model_class is not set, so a causal LM would be built on it; set model.model_class: "
            f"transformers:{stored} to load it as it is (forward_step then gives its {HEADS[kind].output})"
        )
