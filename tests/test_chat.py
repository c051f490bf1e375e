"""Conversations: every record form read as written, and the trained tokens of each conversation compared with an
independent reference — transformers' own assistant mask (`apply_chat_template(..., return_assistant_tokens_mask=
True)`) of the same template with `{% generation %}` markers inserted — for seven template families, and with
train_on_prompt, mask_history and per-message loss_weight."""

from __future__ import annotations

import json
import re
import time
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.builtin import tokenizer_dir
from fsdp2kit.data.chat import Chat, ChatTemplate, to_chat
from fsdp2kit.data.dataset import open_source
from fsdp2kit.data.samples import TrainingSamples
from fsdp2kit.data.scoring import DocumentScoring
from fsdp2kit.data.store import token_store
from fsdp2kit.errors import UserError

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
LLAMAFACTORY = Path(__file__).parent / "fixtures" / "llamafactory"

# Each family's special tokens, and the (original, marked) text that puts `{% generation %}` around an assistant
# turn's content and end-of-turn token (not the newline after it).
_GEN = "{% generation %}"
_END = "{% endgeneration %}"
FAMILIES = {
    "chatml": (
        ["<|im_start|>", "<|im_end|>"],
        "{{ '<|im_start|>' + message['role']",
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
        + _GEN
        + "{{ message['content'] | trim + '<|im_end|>' }}"
        + _END
        + "{{ '\\n' }}{% else %}"
        "{{ '<|im_start|>' + message['role']",
    ),
    "qwen2.5": (
        ["<|im_start|>", "<|im_end|>"],
        '{%-  if (message.role == "user") or',
        "{%- if message.role == 'assistant' and not message.tool_calls %}{{- '<|im_start|>assistant\\n' }}"
        + _GEN
        + "{{- message.content + '<|im_end|>' }}"
        + _END
        + "{{- '\\n' }}"
        '{%-  elif (message.role == "user") or',
    ),
    "llama-3": (
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "{{ '<|start_header_id|>' + message['role']",
        "{% if message['role'] == 'assistant' %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        + _GEN
        + "{{ message['content'] | trim + '<|eot_id|>' }}"
        + _END
        + "{% else %}"
        "{{ '<|start_header_id|>' + message['role']",
    ),
    "mistral": (
        [],
        "{{ ' ' + message['content'] | trim + eos_token }}",
        _GEN + "{{ ' ' + message['content'] | trim + eos_token }}" + _END,
    ),
    "gemma": (
        ["<start_of_turn>", "<end_of_turn>"],
        "{{ '<start_of_turn>' + role",
        "{% if role == 'model' %}{{ '<start_of_turn>model\\n' }}"
        + _GEN
        + "{{ content | trim + '<end_of_turn>' }}"
        + _END
        + "{{ '\\n' }}{% else %}{{ '<start_of_turn>' + role",
    ),
    "phi-3": (
        ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
        "{{ '<|' + message['role']",
        "{% if message['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}"
        + _GEN
        + "{{ message['content'] | trim + '<|end|>' }}"
        + _END
        + "{{ '\\n' }}{% else %}{{ '<|' + message['role']",
    ),
    "zephyr": (
        ["<|user|>", "<|assistant|>", "<|system|>"],
        "{{ '<|' + message['role']",
        "{% if message['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}"
        + _GEN
        + "{{ message['content'] | trim + eos_token }}"
        + _END
        + "{{ '\\n' }}{% else %}{{ '<|' + message['role']",
    ),
}


@cache
def family_tokenizer(family: str):
    """The built-in tokenizer with the family's special tokens and its template."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    tokens, _, _ = FAMILIES[family]
    if tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return tokenizer


def marked_template(family: str) -> str:
    """The family's template with generation markers; where the marked text opens an `if` before the original
    output tag, an `endif` closes it after that tag."""
    _, original, marked = FAMILIES[family]
    text = (TEMPLATES / f"{family}.jinja").read_text()
    assert text.count(original) == 1, family
    at = text.index(original)
    text = text[:at] + marked + text[at + len(original) :]
    if "{% else %}" in marked:
        close = text.index("}}", at + len(marked)) + 2
        text = text[:close] + "{% endif %}" + text[close:]
    return text


CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris, on the Seine."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome.\nIt has been since 1871."},
]


def reference_mask(family: str, messages: list[dict]) -> tuple[list[int], list[int]]:
    out = family_tokenizer(family).apply_chat_template(
        messages,
        chat_template=marked_template(family),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, stop) of each run of 1s."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def computed(family: str, messages: list[dict], **options) -> tuple[list[int], list[int]]:
    template = ChatTemplate(family_tokenizer(family), (TEMPLATES / f"{family}.jinja").read_text(), **options)
    ids, trained = template.encode(Chat(messages, None, "test"))
    return ids, [int(t) for t in trained]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trained_tokens_are_the_assistant_turns_as_transformers_marks_them(family):
    ids, reference = reference_mask(family, CONVERSATION)
    mine_ids, mine = computed(family, CONVERSATION)
    assert mine_ids == ids
    assert len(runs(reference)) == 2 and mine == reference, family_tokenizer(family).decode(
        [t for t, m in zip(ids, mine, strict=True) if m]
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_mask_history_loss_weight_and_train_on_prompt_match_the_reference(family):
    ids, reference = reference_mask(family, CONVERSATION)
    first, last = runs(reference)
    only_last = [int(last[0] <= k < last[1]) for k in range(len(ids))]
    assert computed(family, CONVERSATION, mask_history=True)[1] == only_last
    weighted = [dict(m) for m in CONVERSATION]
    weighted[2]["loss_weight"] = 0.0  # LLaMA-Factory v1: the first answer is context only
    weighted[4]["loss_weight"] = 1.0
    assert computed(family, weighted)[1] == only_last
    assert computed(family, CONVERSATION, train_on_prompt=True)[1] == [1] * len(ids)
    without_eos = computed(family, CONVERSATION, train_on_eos=False)[1]
    assert sum(without_eos) == sum(reference) - 2  # each turn's end-of-turn token is left out


def test_tool_calls_and_tool_results_render_and_only_the_calls_and_answers_train():
    record = json.loads((LLAMAFACTORY / "glaive_toolcall_en_demo.json").read_text())[0]
    chat = to_chat(record, "auto", "record 1")
    roles = [m["role"] for m in chat.messages]
    assert roles[:6] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    assert chat.tools and chat.messages[3]["tool_calls"][0]["function"]["name"] == "search_recipes"
    tokenizer = family_tokenizer("qwen2.5")
    template = ChatTemplate(tokenizer, tokenizer.chat_template)
    ids, trained = template.encode(chat)
    text = tokenizer.decode([t for t, m in zip(ids, trained, strict=True) if m])
    answers = [m["content"] for m in chat.messages if m["role"] == "assistant" and m["content"]]
    call = '<tool_call>\n{"name": "search_recipes", "arguments": {"ingredients": ["chicken", "bell peppers", "rice"]}}'
    expected = f"{answers[0]}<|im_end|>{call}\n</tool_call><|im_end|>{answers[1]}<|im_end|>"
    assert text.startswith(expected) and "<tool_response>" not in text and chat.messages[2]["content"] not in text


def test_every_record_form_reads_as_the_same_messages(tmp_path):
    alpaca = json.loads((LLAMAFACTORY / "alpaca_en_demo.json").read_text())[1]
    chat = to_chat({**alpaca, "input": "extra", "system": "S", "history": [["q", "a"]]}, "auto", "r")
    assert [m["content"] for m in chat.messages] == [
        "S",
        "q",
        "a",
        alpaca["instruction"] + "\nextra",
        alpaca["output"],
    ]
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}], "system": "S"}
    messages = {
        "messages": [
            {"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": "hello"},
        ]
    }
    v1 = {
        "messages": [
            {"role": "system", "content": [{"type": "text", "value": "S"}]},
            {"role": "user", "content": [{"type": "text", "value": "hi"}]},
            {"role": "assistant", "content": [{"type": "text", "value": "hello"}]},
        ]
    }
    expected = [("system", "S"), ("user", "hi"), ("assistant", "hello")]
    for record in (sharegpt, messages, v1):
        assert [(m["role"], m["content"]) for m in to_chat(record, "auto", "r").messages] == expected
    with pytest.raises(UserError, match="turn from 'robot'"):
        to_chat({"conversations": [{"from": "robot", "value": "hi"}]}, "auto", "record 1")


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """The built-in tokenizer with Qwen2.5's template saved as a folder (a model's tokenizer as users have it)."""
    folder = tmp_path_factory.mktemp("qwen-tokenizer")
    family_tokenizer("qwen2.5").save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "name, count", [("alpaca_en_demo.json", 50), ("identity.json", 50), ("glaive_toolcall_en_demo.json", 20)]
)
def test_llamafactory_files_build_a_store_whose_masks_are_the_template_masks(name, count, chat_folder, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(chat_folder)
    cfg = DataConfig(source=str(LLAMAFACTORY / name), cache_dir=str(tmp_path), seq_len=4096, pack=False)
    documents = open_source(cfg)
    assert len(documents) == count and documents.chat_format == "auto"
    store = token_store(cfg, tokenizer)
    assert store.masks is not None and store.num_documents == count and not store.eos_appended
    template = ChatTemplate(tokenizer, tokenizer.chat_template)
    for index, chat in enumerate(documents.read(0, 3)):
        ids, trained = template.encode(chat)
        assert store.document(index).tolist() == ids
        assert store.masks[store.offsets[index] : store.offsets[index + 1]].tolist() == [0, *map(int, trained[1:])]
    samples = TrainingSamples.from_config(cfg, tokenizer)
    assert len(samples) == count
    assert samples[2].trained.tolist() == [False, *trained[1:]] and samples[2].tokens.tolist() == ids


def test_long_conversations_are_cut_after_a_whole_turn_and_untrainable_ones_left_out(chat_folder, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(chat_folder)
    long_turns = [{"role": "user", "content": "question " * 5}, {"role": "assistant", "content": "answer " * 5}] * 3
    rows = [
        {"messages": long_turns},
        {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "late"}]},
    ]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = ChatTemplate(tokenizer, tokenizer.chat_template)
    ids, trained = template.encode(Chat(long_turns, None, "r"))
    ends = [b for _, b in runs([int(t) for t in trained])]
    seq_len = ends[1] + 3  # the second answer fits whole, the third does not
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path), seq_len=seq_len, pack=False)
    samples = TrainingSamples.from_config(cfg, tokenizer)
    assert len(samples) == 1 and "1 of 2 conversations have no token to train on" in capsys.readouterr().out
    sample = samples[0]
    assert len(sample.tokens) == ends[1] and sample.tokens.tolist() == ids[: ends[1]]
    assert sample.trained.tolist() == [False, *trained[1 : ends[1]]]
    scoring = DocumentScoring.open(cfg, tokenizer, 0)  # infer scores what training trains
    assert scoring.indices(0, 1) == ([1], [0])
    assert scoring.truncated(0) and scoring.truncated(1)  # both are longer than seq_len + 1 tokens
    batch = scoring.batch_of([0])
    assert batch["input_ids"][0].tolist() == ids[: ends[1] - 1]
    assert (batch["labels"][0] >= 0).tolist() == trained[1 : ends[1]]
    packed = TrainingSamples.from_config(cfg.model_copy(update={"pack": True}), tokenizer)
    assert sum(int(packed[i].trained.sum()) for i in range(len(packed))) > 0


def test_a_tokenizer_without_template_and_a_wrong_template_name_are_one_sentence(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    with pytest.raises(UserError, match="has no chat template"):
        ChatTemplate.from_config(DataConfig(), tokenizer)
    inline = (TEMPLATES / "chatml.jinja").read_text()
    assert ChatTemplate.from_config(DataConfig(chat_template=inline), tokenizer).end_of_turn == "<|im_end|>"
    file = ChatTemplate.from_config(DataConfig(chat_template=str(TEMPLATES / "zephyr.jinja")), tokenizer)
    assert file.end_of_turn == tokenizer.eos_token
    with pytest.raises(UserError, match="valid: qwen, qwen2_5"):
        ChatTemplate.from_config(DataConfig(template="llama3", chat_template=inline), tokenizer, "qwen2")
    ChatTemplate.from_config(DataConfig(template="qwen2_5", chat_template=inline), tokenizer, "qwen2")


# Like Qwen3's: the last assistant turn alone gets an (empty) think block, so the conversation rendered through an
# earlier turn is not a prefix of the whole; the think block is the model's output (a target).
LAST_TURN_THINKS = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def ours_and_transformers(marked: str) -> tuple[ChatTemplate, tuple[list[int], list[int]], tuple[list[int], list[int]]]:
    """CONVERSATION through a chatml template: `marked` (with generation tags) through transformers' assistant mask,
    and its plain form (the tags taken out) through ChatTemplate: (our template, our (ids, trained), transformers'
    (ids, mask))."""
    tokenizer = family_tokenizer("chatml")
    reference = tokenizer.apply_chat_template(
        CONVERSATION, chat_template=marked, return_dict=True, return_assistant_tokens_mask=True
    )
    template = ChatTemplate(tokenizer, marked.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    ids, trained = template.encode(Chat(CONVERSATION, None, "r"))
    ours = (ids, [int(t) for t in trained])
    return template, ours, (list(reference["input_ids"]), list(reference["assistant_masks"]))


def test_a_template_that_renders_the_last_turn_differently_is_masked_like_the_reference():
    _, ours, theirs = ours_and_transformers(LAST_TURN_THINKS)
    assert ours == theirs


def test_parquet_and_saved_dataset_conversations_read_like_jsonl(tmp_path):
    import datasets

    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "loss_weight": 1}]},
    ]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "a.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    read = {
        name: open_source(DataConfig(source=str(tmp_path / name))).read(0, 2)
        for name in ("a.jsonl", "a.parquet", "saved")
    }
    assert [c.messages for c in read["a.parquet"]] == [c.messages for c in read["a.jsonl"]]
    assert [c.messages for c in read["saved"]] == [c.messages for c in read["a.jsonl"]]


def test_the_example_files_read_and_train_on_their_answers():
    from fsdp2kit.data.vl import load_conversations

    examples = Path(__file__).parents[1] / "examples" / "data"
    tokenizer = family_tokenizer("qwen2.5")
    template = ChatTemplate(tokenizer, tokenizer.chat_template)
    trained_text = {}
    for name in ("alpaca.json", "sharegpt.json", "messages.jsonl"):
        chats = open_source(DataConfig(source=str(examples / name))).read(0, 10)
        for chat in chats:
            ids, trained = template.encode(chat)
            trained_text[(name, chat.where)] = tokenizer.decode([t for t, m in zip(ids, trained, strict=True) if m])
    assert trained_text[("alpaca.json", "record 2 of '" + str(examples / "alpaca.json") + "'")] == (
        "Green.<|im_end|>Blue.<|im_end|>"
    )
    assert trained_text[("messages.jsonl", "record 3 of '" + str(examples / "messages.jsonl") + "'")] == (
        "Goodbye.<|im_end|>"
    )
    assert "get_weather" in trained_text[("sharegpt.json", "record 1 of '" + str(examples / "sharegpt.json") + "'")]
    assert open_source(DataConfig(source=str(examples / "text.jsonl"))).chat_format is None
    (image,) = load_conversations(DataConfig(source=str(examples / "multimodal.json"), pack=False))[0].images
    assert image == examples / "images" / "red.png"


def test_media_for_a_text_model_and_sharegpt_with_role_content_turns(tmp_path):
    with pytest.raises(UserError, match=r"record 1 of '.*mllm_demo.json' has 'images', which a text-only model"):
        open_source(DataConfig(source=str(LLAMAFACTORY / "mllm_demo.json"))).read(0, 1)
    turns = {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    assert [m["role"] for m in to_chat(turns, "auto", "r").messages] == ["user", "assistant"]


def test_a_folder_of_files_in_different_forms_reads_each_record_as_written(tmp_path):
    import shutil

    examples = Path(__file__).parents[1] / "examples" / "data"
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name in ("alpaca.json", "sharegpt.json", "messages.jsonl"):
        shutil.copy(examples / name, folder / name)
    (folder / "test.jsonl").write_text('{"messages": []}\n')  # another split: left out, as load_dataset does
    documents = open_source(DataConfig(source=str(folder)))
    chats = documents.read(0, len(documents))
    assert len(chats) == 2 + 2 + 3
    assert chats[0].messages[-1]["content"] == "98.6 F is 37 C." and chats[-2].tools is not None
    assert chats[-1].where == f"record 2 of '{folder / 'sharegpt.json'}'"


def test_messages_under_another_field_read_with_messages_key(tmp_path):
    source = tmp_path / "prompts.jsonl"
    record = {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "id": 3}
    source.write_text(json.dumps(record) + "\n")
    (chat,) = open_source(DataConfig(source=str(source), messages_key="prompt")).read(0, 1)
    assert [m["content"] for m in chat.messages] == ["hi", "hello"]


@pytest.mark.slow
def test_a_pool_of_processes_builds_the_same_conversation_store(chat_folder, tmp_path, monkeypatch):
    from fsdp2kit.data import store as store_module

    tokenizer = AutoTokenizer.from_pretrained(chat_folder)
    source = str(LLAMAFACTORY / "identity.json")
    alone = token_store(DataConfig(source=source, cache_dir=str(tmp_path / "one"), num_proc=1), tokenizer)
    monkeypatch.setattr(store_module, "_ROWS_PER_PROCESS", 10)
    monkeypatch.setattr(store_module, "_BATCH_ROWS", 10)
    pooled = token_store(DataConfig(source=source, cache_dir=str(tmp_path / "two"), num_proc=2), tokenizer)
    assert pooled.meta["workers"] == "2 processes"
    assert pooled.tokens.tolist() == alone.tokens.tolist() and pooled.masks.tolist() == alone.masks.tolist()


def test_llamafactory_v1_records_with_loss_weight_read_as_written(tmp_path):
    documents = open_source(DataConfig(source=str(LLAMAFACTORY / "v1_sft_demo.jsonl")))
    tokenizer = family_tokenizer("qwen2.5")
    template = ChatTemplate(tokenizer, tokenizer.chat_template)
    for chat in documents.read(0, 5):
        ids, trained = template.encode(chat)
        answers = [m["content"] for m in chat.messages if float(m.get("loss_weight", 0)) > 0]
        text = tokenizer.decode([t for t, m in zip(ids, trained, strict=True) if m])
        assert text == "".join(f"{a}<|im_end|>" for a in answers)


ANSWER = {"role": "assistant", "content": "fine"}


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "a", "loss_weight": "yes"},
                ]
            },
            "has a message with loss_weight 'yes'; give a number >= 0",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "loss_weight": -5}]},
            "has a message with loss_weight -5; give a number >= 0",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]}, ANSWER]},
            "has a content part of type 'audio', which this model cannot read",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, ANSWER]},
            "has a content part of type 'image_url', which this model cannot read",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, ANSWER], "tools": "[{oops"},
            "has 'tools' that are not a JSON",
        ),
    ],
    ids=["weight_yes", "weight_negative", "audio", "image_url_on_text", "tools_not_json"],
)
def test_content_that_would_be_dropped_or_misread_is_one_line(record, message):
    """Each of these trained something else than the record says (an empty user turn, a dropped tool list, a
    climbing loss) or crashed in prepare while check passed."""
    with pytest.raises(UserError, match=f"^data.source: record 3 of 'x.jsonl' {re.escape(message)}"):
        to_chat(record, "auto", "record 3 of 'x.jsonl'")


def test_a_forced_format_whose_fields_the_record_lacks_is_one_line():
    """`--set data.format=alpaca` on a ShareGPT file trained empty user and assistant turns for every record."""
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    with pytest.raises(UserError, match="record 1 has no 'instruction' field, which data.format: alpaca reads "):
        to_chat(sharegpt, "alpaca", "record 1")
    with pytest.raises(UserError, match=r"\(it looks like sharegpt\)$"):
        to_chat(sharegpt, "alpaca", "record 1")


def test_empty_answers_and_system_only_conversations_train_nothing_and_are_counted(chat_folder, tmp_path, capsys):
    """A null assistant content (or Alpaca output) trained the end-of-turn token alone; a system-only or empty
    conversation stopped the whole dataset, though data.md says such conversations are left out and counted."""
    tokenizer = AutoTokenizer.from_pretrained(chat_folder)
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]},
        {"messages": [{"role": "system", "content": "only a system prompt"}]},
        {"instruction": "say hi", "output": None},
        {"messages": []},
        {"conversations": []},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a real answer"}]},
    ]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = TrainingSamples.from_config(
        DataConfig(source=str(source), cache_dir=str(tmp_path), pack=False), tokenizer
    )
    assert len(samples) == 1 and "5 conversations have no token to train on" in capsys.readouterr().out
    trained = tokenizer.decode(samples[0].tokens[samples[0].trained])
    assert trained.startswith("a real answer")


@pytest.mark.parametrize(
    "template, seconds, message",
    [
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
            1,
            "took more than 1 s; the template loops without bound",
        ),
        ("{{ 'x' * 3000000 }}", 60, "more than 1,000,000; it writes text of its own without bound"),
        ("{{ 'x' * 1000000000 }}", 60, "builds a value of 1,000,000,000 characters (str * int), more than 1,000,000"),
        ("{{ 'x' * 10 ** 9 }}", 60, "builds a value of 1,000,000,000 characters (str * int), more than 1,000,000"),
        (
            "{{ ([0] * 10 ** 9) | length }}",
            60,
            "builds a value of 1,000,000,000 items (list * int), more than 1,000,000",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
            60,
            "characters (str + str), more than 1,000,000",
        ),
        ("{{ '%999999999d' % 1 }}", 60, "builds a value of 1,000,000,010 characters (str % int), more than 1,000,000"),
        ("{{ '%(a).999999999f' % {'a': 1} }}", 60, "builds a value of 1,000,000,014 characters (str % dict)"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            60,
            "characters (~), more than 1,000,000",
        ),
        ("{% for i in range(1000) %}{{ 'x' * 999999 }}{% endfor %}", 60, "characters (the text it renders), more"),
        (
            "{% set s %}{% for i in range(1000) %}{{ 'x' * 999999 }}{% endfor %}{% endset %}",
            60,
            "characters (text written into a block), more than 1,000,000",
        ),
        ("{{ 'x' | center(10 ** 9) }}", 60, "characters (the center filter), more than 1,000,000"),
        ("{{ 'a\nb' | indent(10 ** 9, true) }}", 60, "characters (the indent filter), more than 1,000,000"),
        ("{{ '%999999999d' | format(1) }}", 60, "characters (the format filter), more than 1,000,000"),
        ("{{ {'a': [1]} | tojson(indent=10 ** 9) }}", 60, "characters (the tojson filter), more than 1,000,000"),
        ("{{ ('x' * 999999) | replace('', 'yy') }}", 60, "characters (the replace filter), more than 1,000,000"),
        ("{{ (['ab'] * 900000) | join('x' * 999) }}", 60, "characters (the join filter), more than 1,000,000"),
    ],
    ids=[
        "nested_loops",
        "huge_string",
        "constant_string",
        "constant_power",
        "constant_list",
        "doubling",
        "printf_width",
        "printf_precision",
        "tilde_doubling",
        "output_loop",
        "block_loop",
        "center",
        "indent",
        "format",
        "tojson_indent",
        "replace_empty",
        "join_separator",
    ],
)
def test_a_template_that_renders_without_bound_is_one_line(template, seconds, message, monkeypatch):
    """Jinja's sandbox blocks escapes, not work: nested range(100000) loops ran for hours and a huge string was
    killed for memory. Each rendering is bounded in time (10 s; 1 s here for the loops) and in length (256M
    characters; 1M here), and so is each value it builds: Jinja computed constant ones (`'x' * 10 ** 9`, even where
    never rendered) while compiling, before those bounds, in 4 GB and 20 s; they are refused at once."""
    import fsdp2kit.data.chat as chat

    monkeypatch.setattr(chat, "RENDER_SECONDS", seconds)
    monkeypatch.setattr(chat, "MAX_RENDERED_CHARS", 1_000_000)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    start = time.monotonic()
    with pytest.raises(UserError, match=re.escape(message)) as refused:
        ChatTemplate(tokenizer, template + "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert "\n" not in str(refused.value) and time.monotonic() - start < seconds + 2
    if seconds == 60:  # the values are refused before they are built, not after a rendering's 10 s
        assert time.monotonic() - start < 2


def test_a_huge_constant_that_a_template_never_renders_costs_nothing():
    """Jinja computed `'y' * 10 ** 9` while compiling, though the template never renders it: 4 GB and 20 s, then
    refused as a template that loops. It is computed where it is rendered, so here never."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    start = time.monotonic()
    template = ChatTemplate(tokenizer, "{% if false %}{{ 'y' * 10 ** 9 }}{% endif %}{{ messages[0]['content'] }}")
    assert template.render([{"role": "user", "content": "hi"}]) == "hi" and time.monotonic() - start < 2


# A template that writes no header when asked (add_generation_prompt ignored): the turns before an answer render
# without the assistant's header, which then must not be trained as the answer's.
IGNORES_GENERATION_PROMPT = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.role == 'assistant' %}"
    "{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}{{- message.content + '<|im_end|>' }}{%- endif %}{{- '\\n' }}{%- endfor %}"
)


def test_a_template_that_ignores_add_generation_prompt_trains_no_assistant_header():
    template, ours, theirs = ours_and_transformers(IGNORES_GENERATION_PROMPT)
    assert not template.writes_generation_prompt
    assert ours == theirs


# Shows what a template is handed: each message's keys and values (None ones included), reasoning under each name
# templates read it by, the tools and a special token.
SHOWS_ITS_INPUTS = (
    "{% for m in messages %}{{ m | length }}:{{ m.role }}|{{ m.content }}|{{ m.name }}|{{ m.reasoning_content }}|"
    "{{ m.thinking }}|{{ m.reasoning }}\n{% endfor %}{{ tools | tojson }}{{ eos_token }}"
)


def test_a_template_sees_what_the_installed_transformers_hands_it():
    """transformers' own preparation of a template's inputs differs by release: 5.24 drops None values and copies
    `reasoning` under `reasoning_content` and `thinking`; 5.2 and 5.10 hand the messages as they are. Rendering with
    fsdp2kit's sandbox (transformers_compat) gives what `apply_chat_template` of the installed release gives."""
    tokenizer = family_tokenizer("chatml")
    messages = [
        {"role": "system", "content": "be brief", "name": None},
        {"role": "user", "content": "why?", "name": "ann"},
        {"role": "assistant", "content": "so", "reasoning": "because"},
        {"role": "assistant", "content": "and", "thinking": "then"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    theirs = tokenizer.apply_chat_template(messages, tools=tools, chat_template=SHOWS_ITS_INPUTS, tokenize=False)
    assert ChatTemplate(tokenizer, SHOWS_ITS_INPUTS).render(messages, tools) == theirs
    assert '"name": "f"' in theirs and tokenizer.eos_token in theirs
