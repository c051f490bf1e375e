"""Image+text conversations for vision-language models: records -> (lazily, as each batch is built) token ids with
image placeholders, pixel values, image grids and loss masks -> micro-batches.

Records are jsonl lines in one of two forms:
- transformers' chat form: `{"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"},
  {"type": "text", "text": "..."}]}, {"role": "assistant", "content": "..."}]}`;
- LLaVA/ShareGPT: `{"image": "a.png" | [...], "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "..."}]}`, each `<image>` marking where the next image goes (all in the first turn if
  there is none).
Relative image paths are read from the jsonl file's folder. The model's chat template renders the conversation; the
loss is on the assistant turns (their text and end-of-turn token) only. Samples are never packed: a sample's image
features must stay with its placeholder tokens, and each image's patches attend only to each other in the tower.
Unlike text data, nothing is tokenised up front: a sample is built (its images read with Pillow) when a batch needs
it, so memory holds the records, not the pixels.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.dataset import line_problem, single_source
from fsdp2kit.data.samples import GlobalBatches
from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class Conversation:
    """One record: messages in transformers' chat form, each image entry `{"type": "image", "image": path}`."""

    messages: list[dict]
    where: str  # "record 3 of 'data.jsonl'", for errors

    @property
    def images(self) -> list[Path]:
        return [
            Path(item["image"])
            for message in self.messages
            if isinstance(message["content"], list)
            for item in message["content"]
            if item["type"] == "image"
        ]


@dataclass
class VLSample:
    """A sample as `Sample` (tokens, trained) plus its images' pixel rows and [t, h, w] patch grids."""

    tokens: torch.Tensor
    trained: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


def _image_entry(item: dict, folder: Path, where: str) -> dict:
    path = item.get("image") or item.get("path") or item.get("url")
    if not isinstance(path, str):
        raise UserError(f"data.source: {where} has an image entry without a path ('image': 'file.png')")
    return {"type": "image", "image": str(folder / path)}


def _from_messages(messages: list, folder: Path, where: str) -> list[dict]:
    normalised = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = [
                _image_entry(item, folder, where)
                if item.get("type") in ("image", "image_url") or "image" in item
                else {"type": "text", "text": item.get("text", "")}
                for item in content
            ]
        elif not isinstance(content, str):
            raise UserError(f"data.source: {where} has a message whose content is neither text nor a list")
        normalised.append({"role": message.get("role"), "content": content})
    return normalised


def _from_sharegpt(record: dict, folder: Path, where: str) -> list[dict]:
    images = record.get("image") or record.get("images") or []
    images = [images] if isinstance(images, str) else list(images)
    turns = record["conversations"]
    if images and not any(IMAGE_PLACEHOLDER in turn.get("value", "") for turn in turns):
        turns = [{**turns[0], "value": IMAGE_PLACEHOLDER * len(images) + turns[0].get("value", "")}, *turns[1:]]
    pending = iter(images)
    messages = []
    for turn in turns:
        role = _SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise UserError(
                f"data.source: {where} has a turn from '{turn.get('from')}'; valid: {', '.join(_SHAREGPT_ROLES)}"
            )
        pieces = turn.get("value", "").split(IMAGE_PLACEHOLDER)
        content: list[dict] = []
        for i, piece in enumerate(pieces):
            if i:
                path = next(pending, None)
                if path is None:
                    raise UserError(f"data.source: {where} has more '<image>' placeholders than images")
                content.append(_image_entry({"image": path}, folder, where))
            if piece.strip():
                content.append({"type": "text", "text": piece.strip("\n")})
        messages.append({"role": role, "content": content})
    if next(pending, None) is not None:
        raise UserError(f"data.source: {where} has more images than '<image>' placeholders")
    return messages


def load_conversations(cfg: DataConfig) -> list[Conversation]:
    """The source's records (the first `max_samples`); every image must exist (read later, when batched)."""
    if cfg.pack and "pack" in cfg.model_fields_set:
        raise UserError(
            "data.pack: vision-language samples are not packed (each sample's image features stay with its own "
            "tokens); set data.pack: false"
        )
    given = single_source(cfg.source)
    sources = [Path(given)] if isinstance(given, str) else [Path(f) for f in given]
    conversations: list[Conversation] = []
    for source in sources:
        if source.suffix != ".jsonl" or not source.is_file():
            raise UserError(
                f"data.source: a vision-language model trains on .jsonl files of conversations; '{source}' is not one"
            )
        conversations += _read_conversations(source, cfg.max_document_bytes)
    return conversations[: cfg.max_samples]


def _records(source: Path, max_bytes: int) -> Iterator[tuple[int, dict]]:
    """(line number, record) of a jsonl file, each line checked first: size, UTF-8, nesting, a JSON object."""
    with source.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            problem = line_problem(raw, "json", max_bytes)
            if problem is not None:
                raise UserError(f"data.source: '{source}' line {number} {problem}")
            yield number, json.loads(raw)


def _read_conversations(source: Path, max_bytes: int) -> list[Conversation]:
    conversations = []
    for number, record in _records(source, max_bytes):
        where = f"record {number} of '{source}'"
        if isinstance(record.get("messages"), list):
            messages = _from_messages(record["messages"], source.parent, where)
        elif isinstance(record.get("conversations"), list):
            messages = _from_sharegpt(record, source.parent, where)
        else:
            raise UserError(
                f"data.source: {where} has neither 'messages' (chat form) nor 'conversations' (LLaVA/ShareGPT form)"
            )
        if not any(m["role"] == "assistant" for m in messages):
            raise UserError(f"data.source: {where} has no assistant turn to train on")
        conversation = Conversation(messages, where)
        for path in conversation.images:
            if not path.is_file():
                raise UserError(f"data.source: {where} names image '{path}', which does not exist")
        conversations.append(conversation)
    return conversations


# Decoding an image costs width x height x 3 bytes before the processor resizes it: past 100M pixels (a 10000 x 10000
# photo) the decode alone is 300 MB, and Pillow refuses twice its own warning size as a decompression bomb. Vision
# towers cut images into patches: a side 200 times the other leaves one of them under a patch.
MAX_IMAGE_PIXELS = 100_000_000
MAX_IMAGE_ASPECT = 200


def _read_image(path: Path, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:  # reads the header only
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise UserError(
                    f"data.source: {where}: image '{path}' is {width} x {height} pixels, more than "
                    f"{MAX_IMAGE_PIXELS:,}; downscale it"
                )
            if max(width, height) > MAX_IMAGE_ASPECT * min(width, height):
                raise UserError(
                    f"data.source: {where}: image '{path}' is {width} x {height} pixels, one side more than "
                    f"{MAX_IMAGE_ASPECT} times the other; crop or pad it"
                )
            return image.convert("RGB")
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise UserError(f"data.source: {where}: image '{path}' cannot be read: {exc}") from None


@dataclass
class VLEncoder:
    """The model's tokenizer (with its chat template) and image processor, from the model's folder."""

    tokenizer: Any
    image_processor: Any
    image_token_id: int
    video_token_id: int
    seq_len: int
    _templates: dict = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path, hf_config: PretrainedConfig, seq_len: int) -> VLEncoder:
        from transformers import AutoImageProcessor, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        if not tokenizer.chat_template:
            raise UserError(f"data.tokenizer: '{path}' has no chat template to render conversations with")
        if not (path / "preprocessor_config.json").is_file():
            raise UserError(f"data.tokenizer: '{path}' has no preprocessor_config.json (the image processor)")
        image_processor = AutoImageProcessor.from_pretrained(path)
        return cls(tokenizer, image_processor, hf_config.image_token_id, hf_config.video_token_id, seq_len)

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _assistant_spans(self, conversation: Conversation, text: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in `text`: from the end of the conversation rendered up to the
        turn with a generation prompt, to the end of it rendered through the turn."""
        spans = []
        messages = conversation.messages
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before, through = self._render(messages[:i], True), self._render(messages[: i + 1])
            if not (text.startswith(before) and text.startswith(through)):
                raise UserError(
                    f"data.tokenizer: the chat template does not render {conversation.where} as a continuation of "
                    "its first turns, so its assistant turns cannot be found"
                )
            spans.append((len(before), len(through)))
        return spans

    def encode(self, conversation: Conversation) -> VLSample:
        """Token ids with each image's placeholder repeated once per merged patch, which tokens are trained on
        (those of assistant turns), and the images' pixel rows and grids."""
        text = self._render(conversation.messages)
        spans = self._assistant_spans(conversation, text)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        trained = [any(a < end and b > start for start, end in spans) for a, b in encoded["offset_mapping"]]
        images = [_read_image(path, conversation.where) for path in conversation.images]
        sample = VLSample(torch.tensor(ids), torch.tensor(trained))
        if images:
            pixels = self.image_processor(images=images, return_tensors="pt")
            sample.pixel_values, sample.image_grid_thw = pixels["pixel_values"], pixels["image_grid_thw"]
            merge = self.image_processor.merge_size**2
            repeats = torch.ones(len(ids), dtype=torch.long)
            placeholders = (sample.tokens == self.image_token_id).nonzero().flatten()
            if len(placeholders) != len(images):
                raise UserError(
                    f"data.source: {conversation.where} has {len(images)} images but its rendered text has "
                    f"{len(placeholders)} image placeholders"
                )
            repeats[placeholders] = sample.image_grid_thw.prod(-1) // merge
            sample.tokens = sample.tokens.repeat_interleave(repeats)
            sample.trained = sample.trained.repeat_interleave(repeats)
        width = self.seq_len + 1
        if len(sample.tokens) > width:
            if (sample.tokens[width:] == self.image_token_id).any():
                raise UserError(
                    f"data.seq_len: {conversation.where} needs {len(sample.tokens)} tokens and its images would be "
                    f"cut at data.seq_len = {self.seq_len}; raise data.seq_len or use smaller images"
                )
            sample.tokens, sample.trained = sample.tokens[:width], sample.trained[:width]
        return sample

    def collate(self, samples: list[VLSample], pad_id: int) -> dict[str, torch.Tensor]:
        """Right-padded ids, attention mask, labels and the modality of each token (mrope positions need it); the
        pixel rows and grids of all the micro-batch's images, in order, where it has any."""
        length = max(len(s.tokens) for s in samples) - 1
        input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
        labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
        for i, sample in enumerate(samples):
            n = len(sample.tokens) - 1
            input_ids[i, :n] = sample.tokens[:-1]
            labels[i, :n] = sample.tokens[1:].masked_fill(~sample.trained[1:], IGNORE_INDEX)
            attention_mask[i, :n] = 1
        modality = (input_ids == self.image_token_id).long() + 2 * (input_ids == self.video_token_id).long()
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "mm_token_type_ids": modality,
            "labels": labels,
        }
        with_images = [s for s in samples if s.pixel_values is not None]
        if with_images:
            batch["pixel_values"] = torch.cat([s.pixel_values for s in with_images])  # type: ignore[misc]
            batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images])  # type: ignore[misc]
        return batch


@dataclass
class VLGlobalBatches(GlobalBatches):
    """GlobalBatches over conversations, each encoded (its images read) when its micro-batch is built."""

    encoder: VLEncoder = field(kw_only=True)  # after the base's defaulted fields

    def collate_indices(self, indices: list[int], samples: Any = None) -> dict[str, torch.Tensor]:
        samples = self.samples if samples is None else samples
        return self.encoder.collate([self.encoder.encode(samples[i]) for i in indices], self.pad_id)
