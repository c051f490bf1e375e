"""What `fsdp2kit infer` scores, sample by sample: documents as the model's users tokenise them, or a VL model's
conversations (scored on their assistant turns). Each source gives this rank's sample indices and collates a list of
them into a shifted batch; an empty list gives a dummy batch, with which a rank out of samples still joins each
round's collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.dataset import Sample, collate
from fsdp2kit.data.samples import conversation_window
from fsdp2kit.data.store import TokenStore, token_store
from fsdp2kit.data.vl import VLEncoder, VLSample, load_conversations


class ScoringSource(Protocol):
    def indices(self, first: int, step: int) -> tuple[list[int], list[int]]:
        """(samples without a term, samples to score) among first, first + step, ..."""
        ...

    def batch_of(self, chunk: list[int]) -> dict[str, torch.Tensor]: ...

    def truncated(self, index: int) -> bool:
        """Whether the sample was cut at data.seq_len (asked after its batch)."""
        ...


@dataclass
class DocumentScoring:
    """As the model's users tokenise: default special tokens, no EOS (the store appends one for training), no
    packing, truncated at data.seq_len (a prompt/response record is the prompt's ids followed by the response's).
    A conversation is scored on its trained tokens only (the store's mask: what training's loss is on), so its
    `num_tokens` and `mean_logprob` are those of the answers. A document of fewer than 2 tokens (a conversation
    without a trained token) has no term: recorded as such, never sent to the model."""

    store: TokenStore
    lengths: np.ndarray
    pad_id: int

    @classmethod
    def open(cls, data: DataConfig, tokenizer: Any, pad_id: int) -> DocumentScoring:
        store = token_store(data, tokenizer)
        # A conversation as training cuts it (seq_len + 1 tokens at most, after a whole turn where one fits).
        limit = data.seq_len + 1 if store.masks is not None else data.seq_len
        lengths = np.minimum(np.diff(store.offsets) - int(store.eos_appended), limit)
        return cls(store, lengths, pad_id)

    def indices(self, first: int, step: int) -> tuple[list[int], list[int]]:
        mine = np.arange(first, self.store.num_documents, step)
        scored = self.lengths[mine] >= 2
        if self.store.masks is not None:
            scored &= np.array([self._trained(int(i))[1:].any() for i in mine], dtype=np.bool_)
        return mine[~scored].tolist(), mine[scored].tolist()

    def truncated(self, index: int) -> bool:
        whole = int(self.store.offsets[index + 1] - self.store.offsets[index]) - int(self.store.eos_appended)
        return whole > int(self.lengths[index])

    def _trained(self, index: int) -> np.ndarray:
        return conversation_window(self.store, index, int(self.lengths[index]))[1]

    def batch_of(self, chunk: list[int]) -> dict[str, torch.Tensor]:
        documents: list[Sample | torch.Tensor] = []
        for i in chunk:
            trained = self._trained(i) if self.store.masks is not None else None
            length = len(trained) if trained is not None else int(self.lengths[i])
            tokens = torch.from_numpy(self.store.document(i)[:length].astype(np.int64))
            documents.append(tokens if trained is None else Sample(tokens, torch.from_numpy(trained)))
        return collate(documents or [torch.tensor([self.pad_id, self.pad_id])], self.pad_id)


@dataclass
class ConversationScoring:
    """A VL model's conversations, encoded (images read) batch by batch; scored on their assistant turns."""

    encoder: VLEncoder
    conversations: list[Any]
    pad_id: int
    cut: set[int] = field(default_factory=set)  # the samples encoding cut at data.seq_len

    def indices(self, first: int, step: int) -> tuple[list[int], list[int]]:
        return [], list(range(first, len(self.conversations), step))

    def truncated(self, index: int) -> bool:
        return index in self.cut

    def batch_of(self, chunk: list[int]) -> dict[str, torch.Tensor]:
        samples = [self.encoder.encode(self.conversations[i]) for i in chunk]
        self.cut.update(i for i, sample in zip(chunk, samples, strict=True) if sample.cut)
        dummy = VLSample(torch.tensor([self.pad_id, self.pad_id]), torch.zeros(2) > 0)
        return self.encoder.collate(samples or [dummy], self.pad_id)

    @classmethod
    def open(cls, data: DataConfig, encoder: VLEncoder, pad_id: int) -> ConversationScoring:
        return cls(encoder, load_conversations(data), pad_id)
