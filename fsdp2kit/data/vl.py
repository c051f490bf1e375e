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

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.chat import Chat, ChatTemplate, part_text, to_chat, with_messages_key
from fsdp2kit.data.dataset import json_records, named_dataset, single_source
from fsdp2kit.data.mixture import named_as
from fsdp2kit.data.registry import RegistryEntry, dataset_names
from fsdp2kit.data.samples import GlobalBatches
from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PretrainedConfig

IMAGE_PLACEHOLDER = "<image>"


@dataclass(frozen=True)
class Conversation:
    """One record: messages in transformers' chat form, each image entry `{"type": "image", "image": path}`, and the
    tools it offers."""

    messages: list[dict]
    where: str  # "record 3 of 'data.jsonl'", for errors
    tools: list | None = None

    @property
    def images(self) -> list[Path]:
        return [
            Path(item["image"])
            for message in self.messages
            if isinstance(message["content"], list)
            for item in message["content"]
            if item["type"] == "image"
        ]

    @property
    def chat(self) -> Chat:
        return Chat(self.messages, self.tools, self.where)


@dataclass
class VLSample:
    """A sample as `Sample` (tokens, trained) plus its images' pixel rows and [t, h, w] patch grids."""

    tokens: torch.Tensor
    trained: torch.Tensor
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    cut: bool = False  # longer than data.seq_len + 1 tokens: cut there


def _image_path(item: dict) -> str | None:
    path = item.get("image") or item.get("path") or item.get("url")
    if isinstance(path, dict):  # OpenAI's image_url: {"url": ...}
        path = path.get("url")
    return path if isinstance(path, str) else None


def _with_placeholders(record: dict, where: str) -> tuple[dict, list[str]]:
    """The record with each image part of a message's content replaced by an `<image>` placeholder in its text, and
    the images in placeholder order: those parts' paths, else the record's `images` (or LLaVA's `image`)."""
    listed = record.get("images") or record.get("image") or []
    listed = [listed] if isinstance(listed, str) else list(listed)
    if not isinstance(record.get("messages"), list):
        return record, listed
    found: list[str | None] = []
    messages = []
    for message in record["messages"]:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            text = ""
            for part in content:
                image = part.get("type") in ("image", "image_url") or "image" in part
                found += [_image_path(part)] if image else []
                text += IMAGE_PLACEHOLDER if image else part_text(part, where)
            message = {**message, "content": text}
        messages.append(message)
    paths = [p for p in found if p is not None]
    return {**record, "messages": messages}, paths if paths and len(paths) == len(found) else listed


def _split_images(messages: list[dict], images: list[str], folder: Path, where: str) -> list[dict]:
    """Each `<image>` placeholder in the messages' text made an image entry (all at the start of the first turn
    where the text has none)."""
    if images and not any(IMAGE_PLACEHOLDER in m["content"] for m in messages):
        messages = [{**messages[0], "content": IMAGE_PLACEHOLDER * len(images) + messages[0]["content"]}, *messages[1:]]
    pending = iter(images)
    out = []
    for message in messages:
        pieces = message["content"].split(IMAGE_PLACEHOLDER)
        if len(pieces) == 1:
            out.append(message)
            continue
        content: list[dict] = []
        for i, piece in enumerate(pieces):
            if i:
                path = next(pending, None)
                if path is None:
                    raise UserError(f"data.source: {where} has more '<image>' placeholders than images")
                content.append({"type": "image", "image": str(folder / path)})
            if piece.strip():
                content.append({"type": "text", "text": piece.strip("\n")})
        out.append({**message, "content": content})
    if next(pending, None) is not None:
        raise UserError(f"data.source: {where} has more images than '<image>' placeholders")
    return out


def load_conversations(cfg: DataConfig) -> list[Conversation]:
    """The source's records (the first `max_samples`); every image must exist (read later, when batched)."""
    if cfg.pack and "pack" in cfg.model_fields_set:
        raise UserError(
            "data.pack: vision-language samples are not packed (each sample's image features stay with its own "
            "tokens); set data.pack: false"
        )
    conversations: list[Conversation] = []
    for source, read, entry in _sources(cfg):
        if source.suffix not in (".jsonl", ".json") or not source.is_file():
            raise UserError(
                "data.source: a vision-language model trains on .jsonl or .json files of conversations; "
                f"'{source}' is not one"
            )
        conversations += _read_conversations(source, read, entry)
    return conversations[: cfg.max_samples]


def load_eval_conversations(cfg: DataConfig) -> list[Conversation]:
    """The evaluation set of `data.eval_source`, read as a source of its own (as the text path's `split_samples`
    does): its refusals name `data.eval_source`, and one without a conversation is refused, as it evaluates
    nothing."""
    with named_as("data.eval_source"):
        conversations = load_conversations(cfg.model_copy(update={"source": cfg.eval_source, "eval_source": None}))
    if not conversations:
        raise UserError(
            "data.eval_source: it holds no conversation to evaluate (its files have no record); give .jsonl or "
            ".json files of conversations"
        )
    return conversations


def _sources(cfg: DataConfig) -> list[tuple[Path, DataConfig, RegistryEntry | None]]:
    """Each file of the source, with the config that reads it and, for a dataset named in data.dataset_dir, its
    registry entry (its images are then beside its file, LLaMA-Factory's media_dir by default)."""
    given = single_source(cfg.source)
    if cfg.dataset_dir is not None:
        named = [named_dataset(cfg.model_copy(update={"source": [name]})) for name in dataset_names(given)]
        return [(Path(str(read.source)), read, entry) for read, entry in named]
    return [(Path(f), cfg, None) for f in ([given] if isinstance(given, str) else given)]


def _read_conversations(source: Path, cfg: DataConfig, entry: RegistryEntry | None) -> list[Conversation]:
    conversations = []
    for where, record in json_records([source], cfg.max_document_bytes):
        if not isinstance(record, dict):
            raise UserError(f"data.source: {where} is not a JSON object")
        record = entry.canonical(record, where) if entry else with_messages_key(record, cfg.messages_key)
        record, images = _with_placeholders(record, where)
        chat = to_chat(record, cfg.format, where)
        if not any(m["role"] == "assistant" for m in chat.messages):
            raise UserError(f"data.source: {where} has no assistant turn to train on")
        messages = _split_images(chat.messages, images, source.parent, where)
        conversation = Conversation(messages, where, chat.tools)
        for path in conversation.images:
            if not path.is_file():
                raise UserError(f"data.source: {where} names image '{path}', which does not exist")
            _read_image(path, where, decode=False)
        conversations.append(conversation)
    return conversations


# Decoding an image costs width x height x 3 bytes before the processor resizes it: past 100M pixels (a 10000 x 10000
# photo) the decode alone is 300 MB, and Pillow refuses twice its own warning size as a decompression bomb. Vision
# towers cut images into patches: a side 200 times the other leaves one of them under a patch.
MAX_IMAGE_PIXELS = 100_000_000
MAX_IMAGE_ASPECT = 200


def _read_image(path: Path, where: str, decode: bool = True) -> Any:
    """The image as RGB; without `decode`, only its header is read and checked (every image a dataset names is
    checked so when the data is read, not first when a sample is drawn)."""
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
            return image.convert("RGB") if decode else None
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise UserError(f"data.source: {where}: image '{path}' cannot be read: {exc}") from None


@dataclass
class VLEncoder:
    """The model's tokenizer with the chat template and mask options (`ChatTemplate`, as for text conversations)
    and its image processor, from the model's folder."""

    template: ChatTemplate
    image_processor: Any
    image_token_id: int
    video_token_id: int
    seq_len: int

    @property
    def tokenizer(self) -> Any:
        return self.template.tokenizer

    @classmethod
    def load(cls, path: Path, hf_config: PretrainedConfig, seq_len: int, data: DataConfig | None = None) -> VLEncoder:
        from transformers import AutoTokenizer

        # From its module: transformers 5.10's top-level name is a placeholder that asks for torchvision, which the
        # PIL image processors do not need.
        from transformers.models.auto.image_processing_auto import AutoImageProcessor

        tokenizer = AutoTokenizer.from_pretrained(path)
        template = ChatTemplate.from_config(data or DataConfig(), tokenizer, hf_config.model_type)
        if not (path / "preprocessor_config.json").is_file():
            raise UserError(f"data.tokenizer: '{path}' has no preprocessor_config.json (the image processor)")
        image_processor = AutoImageProcessor.from_pretrained(path)
        return cls(template, image_processor, hf_config.image_token_id, hf_config.video_token_id, seq_len)

    def encode(self, conversation: Conversation) -> VLSample:
        """Token ids with each image's placeholder repeated once per merged patch, which tokens are trained on
        (those of assistant turns, as `ChatTemplate` finds them), and the images' pixel rows and grids."""
        ids, trained = self.template.encode(conversation.chat)
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
            sample.tokens, sample.trained, sample.cut = sample.tokens[:width], sample.trained[:width], True
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
