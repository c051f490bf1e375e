"""Conversations: records of the common chat forms read as transformers' messages, rendered with a chat template, and
which of their tokens are trained on.

Forms (`data.format: auto` detects each record's from its fields):
- `messages` (OpenAI/TRL, LLaMA-Factory v1): `{"messages": [{"role": ..., "content": "..." | [parts]}], "tools": ...}`,
  with `tool_calls` on assistant turns and an optional per-message `loss_weight` (0 or 1);
- `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system"|"function_call"|"observation", "value": ...}],
  "system": ..., "tools": "<JSON>"}`;
- `alpaca`: `{"instruction", "input", "output", "system", "history": [[query, answer], ...]}`.

The mask is found by rendering, for any template: the conversation is rendered once; an assistant turn starts where
the conversation up to it, rendered with a generation prompt, ends (or, for templates that render earlier turns
differently, where its text is found after the previous turn), and ends after the template's end-of-turn text, found
once by rendering a probe conversation. A token is trained when its characters overlap a trained span. The same code
serves text and vision-language conversations (`data/vl.py`)."""

from __future__ import annotations

import json
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.sandbox import ImmutableSandboxedEnvironment

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.errors import UserError
from fsdp2kit.transformers_compat import chat_template_environment, chat_template_messages, chat_template_value

CHAT_FORMATS = ("alpaca", "sharegpt", "messages")
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
# A template is code from a file: what one rendering may cost. Jinja's sandbox blocks escapes, not loops (nested
# range(100000) runs for hours) nor {{ 'x' * 10**9 }}; a conversation is at most data.max_document_bytes of JSON.
# The length bounds both the text rendered and each string, list or number the template builds (`_BoundedSandbox`).
RENDER_SECONDS = 10
MAX_RENDERED_CHARS = 256 << 20


class _RenderTimeout(BaseException):
    """Raised by the alarm inside a rendering; a BaseException so that no `except Exception` in between eats it."""


@contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    """An alarm that interrupts the block after `seconds`, where signals can be used (the main thread). An alarm set
    by someone else (a harness's timeout) is kept: it is re-armed afterwards with what was left of it, and where it
    comes first, it alone bounds the block."""
    start = time.monotonic()
    remaining, interval = signal.getitimer(signal.ITIMER_REAL)
    if threading.current_thread() is not threading.main_thread() or 0 < remaining <= seconds:
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise _RenderTimeout

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if remaining:
            signal.setitimer(signal.ITIMER_REAL, max(remaining - (time.monotonic() - start), 1e-3), interval)


class _ValueTooLong(Exception):
    """Raised by the sandbox for an operation whose value would be longer than a rendering may be."""


def _operation_size(operator: str, left: Any, right: Any) -> tuple[int, str]:
    """How long the value of `left operator right` would be, and in what, without computing it: repeated or joined
    strings and lists, and powers of whole numbers (in digits); 0 for anything else."""
    if operator == "*" and isinstance(right, int) and isinstance(left, (str, list, tuple)):
        left, right = right, left
    if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
        return len(right) * left, "characters" if isinstance(right, str) else "items"
    if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
        return len(left) + len(right), "characters" if isinstance(left, str) else "items"
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return math.ceil(right * math.log10(abs(left))), "digits"
    if operator == "%" and isinstance(left, str):  # printf widths and precisions pad: '%999999999d' % 1
        return len(left) + sum(int(n) for sizes in _PRINTF_SIZES.findall(left) for n in sizes if n), "characters"
    return 0, ""


_PRINTF_SIZES = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\d*)(?:\.(\d*))?")  # each conversion's width and precision


def _refuse_past_bound(size: int, what: str, unit: str = "characters") -> None:
    if size > MAX_RENDERED_CHARS:
        raise _ValueTooLong(f"a value of {size:,} {unit} ({what}), more than {MAX_RENDERED_CHARS:,}")


class _BoundedText(list):
    """A rendering's buffer (a `{% set %}` block, a macro's body, the pieces a loop writes) that refuses to hold more
    characters than a rendering may be: they would be joined into one string."""

    def __init__(self, what: str = "text written into a block") -> None:
        super().__init__()
        self.size, self.what = 0, what

    def append(self, piece: Any) -> None:
        self.size += len(str(piece))
        _refuse_past_bound(self.size, self.what)
        super().append(piece)

    def extend(self, pieces: Any) -> None:
        for piece in pieces:
            self.append(piece)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator with the sandbox's bounds on what it builds without a binary operator: `a ~ b`, block
    buffers and the rendering's own output."""

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.bounded_text()")

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:  # the join Jinja's own visit_Concat picks
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"environment.bounded_concat({join}, (")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox for chat templates whose `*`, `**`, `+` and `%` refuse a value longer than a rendering may
    be. Jinja computes constant operations while compiling (`{{ 'x' * 10**9 }}` took 4 GB before the rendering's
    bounds applied) except those the sandbox intercepts, which run here, when rendering."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    @staticmethod
    def concat(pieces: Iterator[str]) -> str:  # type: ignore[override]
        """The rendering's output, joined as Jinja joins it, refusing more characters than a rendering may be."""
        text = _BoundedText("the text it renders")
        text.extend(pieces)
        return "".join(text)

    @staticmethod
    def bounded_text() -> _BoundedText:
        return _BoundedText()

    @staticmethod
    def bounded_concat(join: Callable[[Any], str], parts: tuple) -> str:
        """`a ~ b`: the length of the parts' text checked before it is joined."""
        _refuse_past_bound(sum(len(str(part)) for part in parts), "~")
        return join(parts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        size, unit = _operation_size(operator, left, right)
        _refuse_past_bound(size, f"{type(left).__name__} {operator} {type(right).__name__}", unit)
        return super().call_binop(context, operator, left, right)


@lru_cache
def _compiled(template: str) -> Any:
    """The template compiled as transformers compiles it (the same sandbox options, extensions, filters, tests and
    globals: `raise_exception`, `tojson`, `{% generation %}`...), in the bounded sandbox."""
    theirs = chat_template_environment()
    environment = _BoundedSandbox(
        trim_blocks=theirs.trim_blocks,
        lstrip_blocks=theirs.lstrip_blocks,
        extensions=[type(extension) for extension in theirs.extensions.values()],
    )
    for own, given in ((environment.filters, theirs.filters), (environment.tests, theirs.tests)):
        own.update(given)
    environment.globals.update(theirs.globals)
    environment.policies.update(theirs.policies)
    environment.filters.update({name: _bounded_filter(name, environment.filters[name]) for name in _FILTER_SIZES})
    return environment.from_string(template)


def _indent_size(text: Any, width: Any = 4, *_: Any) -> int:
    return len(str(text)) + (str(text).count("\n") + 1) * (width if isinstance(width, int) else len(str(width)))


def _json_size(value: Any, ensure_ascii: bool = False, indent: Any = None, *_: Any, **__: Any) -> int:
    """An upper bound of the indented JSON's length: every line indented to the deepest level."""
    compact = json.dumps(value, ensure_ascii=ensure_ascii, default=str)
    step = indent if isinstance(indent, int) else len(str(indent or ""))
    return len(compact) * (1 + step * (compact.count("[") + compact.count("{")))


def _replace_size(text: Any, old: Any, new: Any, count: Any = None, *_: Any) -> int:
    text, old, new = str(text), str(old), str(new)
    return len(text) + (len(text) + 1 if not old else text.count(old)) * len(new)


def _join_size(items: Any, separator: Any = "", *_: Any, **__: Any) -> int:
    items = list(items) if not isinstance(items, (str, bytes)) else [items]
    return sum(len(str(item)) for item in items) + len(str(separator)) * len(items)


# The built-in filters whose result can be far longer than their inputs, with an upper bound of its length.
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80, *_: max(len(str(value)), width if isinstance(width, int) else 0),
    "indent": _indent_size,
    "format": lambda value, *args, **kwargs: _operation_size("%", str(value), args or kwargs)[0],
    "tojson": _json_size,
    "replace": _replace_size,
    "join": _join_size,
}


def _bounded_filter(name: str, apply: Callable[..., Any]) -> Callable[..., Any]:
    """`apply` (a filter), refused where its result would be longer than a rendering may be."""
    size = _FILTER_SIZES[name]

    def bounded(*args: Any, **kwargs: Any) -> Any:
        shown = args[1:] if getattr(apply, "jinja_pass_arg", None) else args  # a context or environment first
        _refuse_past_bound(size(*shown, **kwargs), f"the {name} filter")
        return apply(*args, **kwargs)

    if hasattr(apply, "jinja_pass_arg"):  # how Jinja calls it: with the environment or context first
        bounded.jinja_pass_arg = apply.jinja_pass_arg  # type: ignore[attr-defined]
    return bounded


def _render(tokenizer: Any, template: str, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
    """`tokenizer.apply_chat_template(messages, tools, chat_template=template, tokenize=False)` step for step (the
    messages and tools prepared as the installed transformers prepares them, the special tokens as variables), in the
    bounded sandbox."""
    variables = chat_template_value(dict(tokenizer.special_tokens_map))
    return _compiled(template).render(
        messages=chat_template_messages(messages),
        tools=chat_template_value(tools),
        documents=None,
        add_generation_prompt=generation_prompt,
        **variables,
    )


_PROBE_QUESTION, _PROBE_ANSWER = "fsdp2kit-probe-question", "fsdp2kit-probe-answer"

# ROLL's, MindSpeed-MM's and LLaMA-Factory's template names, and the model types (config.json) whose own template
# each one is.
TEMPLATE_FAMILIES = {
    "qwen": ("qwen2", "qwen2_moe"),
    "qwen2_5": ("qwen2", "qwen2_moe"),
    "qwen2_vl": ("qwen2_vl", "qwen2_5_vl"),
    "qwen2-vl": ("qwen2_vl", "qwen2_5_vl"),
    "qwen2_5_vl": ("qwen2_5_vl", "qwen2_vl"),
    "qwen3": ("qwen3", "qwen3_moe"),
    "qwen3_nothink": ("qwen3", "qwen3_moe"),
    "qwen3_vl": ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
    "qwen3_vl_nothink": ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
    "qwen3_5": ("qwen3_5", "qwen3_5_moe"),
    "llama3": ("llama",),
    "llama2": ("llama",),
    "mistral": ("mistral", "mixtral"),
    "gemma": ("gemma", "gemma2", "gemma3", "gemma3_text"),
    "phi": ("phi3",),
    "deepseek3": ("deepseek_v3",),
}


@dataclass(frozen=True)
class Chat:
    """One conversation in transformers' form: messages (string content; `tool_calls` on assistant turns; an optional
    `loss_weight`), the tools offered, and where it came from (for errors)."""

    messages: list[dict]
    tools: list | None
    where: str


def record_format(record: dict, fmt: str) -> str | None:
    """The chat form of a record (`data.format`, or detected from its fields), or None for text/prompt-response."""
    if fmt != "auto":
        return fmt if fmt in CHAT_FORMATS else None
    if isinstance(record.get("messages"), list):
        return "messages"
    if isinstance(record.get("conversations"), list):
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    return None


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or the text parts of a list (`text` or LLaMA-Factory v1's `value`) joined. A part
    of another kind (audio, an image on a text model) is refused: dropped, it would leave its turn empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part_text(part, where) for part in content)
    raise UserError(f"data.source: {where} has a message whose content is neither text nor a list of parts")


def part_text(part: Any, where: str) -> str:
    """A content part's text; a part of another kind is one line naming its type."""
    if not isinstance(part, dict):
        raise UserError(f"data.source: {where} has a content part that is not a JSON object")
    kind = part.get("type", "text")
    text = part.get("text", part.get("value"))
    if kind != "text" or not isinstance(text, str):
        raise UserError(
            f"data.source: {where} has a content part of type '{kind}', which this model cannot read (text parts "
            "only; images with a vision-language model, docs/vl.md)"
        )
    return text


def _loss_weight(value: Any, where: str) -> float:
    """LLaMA-Factory v1's per-message weight: 0 makes a message context, > 0 a target."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise UserError(
            f"data.source: {where} has a message with loss_weight {value!r}; give a number >= 0 (0: context, 1: "
            "trained on)"
        )
    return float(value)


def _json_value(value: Any) -> Any:
    """A JSON string (tools, tool-call arguments) as the value it encodes; anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def _tool_call(call: dict) -> dict:
    function = call.get("function") or call
    return {
        "type": "function",
        "function": {"name": function.get("name"), "arguments": _json_value(function.get("arguments"))},
    }


def _from_messages(record: dict, where: str) -> list[dict]:
    messages = []
    for message in record["messages"]:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UserError(f"data.source: {where} has a message without a 'role'")
        out: dict = {"role": message["role"], "content": _text(message.get("content"), where)}
        if message.get("tool_calls"):
            out["tool_calls"] = [_tool_call(c) for c in message["tool_calls"]]
        for key in ("name", "tool_call_id"):
            if message.get(key) is not None:
                out[key] = message[key]
        if message.get("loss_weight") is not None:
            out["loss_weight"] = _loss_weight(message["loss_weight"], where)
        messages.append(out)
    return messages


def _from_sharegpt(record: dict, where: str) -> list[dict]:
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for turn in record["conversations"]:
        if not isinstance(turn, dict):
            raise UserError(f"data.source: {where} has a turn that is not a JSON object")
        speaker = turn.get("from", turn.get("role"))  # some files write ShareGPT turns with role/content
        role = _SHAREGPT_ROLES.get(str(speaker))
        if role is None:
            raise UserError(f"data.source: {where} has a turn from '{speaker}'; valid: {', '.join(_SHAREGPT_ROLES)}")
        value = _text(turn.get("value", turn.get("content")), where)
        if speaker == "function_call":
            calls = _json_value(value)
            calls = calls if isinstance(calls, list) else [calls]
            if not all(isinstance(c, dict) for c in calls):
                raise UserError(f"data.source: {where} has a function_call whose value is not JSON {{name, arguments}}")
            messages.append({"role": "assistant", "content": "", "tool_calls": [_tool_call(c) for c in calls]})
        else:
            messages.append({"role": role, "content": value})
    return messages


def _from_alpaca(record: dict, where: str) -> list[dict]:
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for pair in record.get("history") or []:
        if not (isinstance(pair, list | tuple) and len(pair) == 2):
            raise UserError(f"data.source: {where} has a 'history' entry that is not a [query, answer] pair")
        messages += [{"role": "user", "content": str(pair[0])}, {"role": "assistant", "content": str(pair[1])}]
    query = "\n".join(str(part) for part in (record.get("instruction"), record.get("input")) if part)
    return [*messages, {"role": "user", "content": query}, {"role": "assistant", "content": record.get("output") or ""}]


_READERS: dict[str, Callable[[dict, str], list[dict]]] = {
    "messages": _from_messages,
    "sharegpt": _from_sharegpt,
    "alpaca": _from_alpaca,
}


MEDIA_FIELDS = ("images", "image", "videos", "audios")


def with_messages_key(record: dict, messages_key: str) -> dict:
    """The record with its chat messages under `messages` when `data.messages_key` names another field."""
    if messages_key == "messages" or messages_key not in record:
        return record
    renamed = {k: v for k, v in record.items() if k not in ("messages", messages_key)}
    return {**renamed, "messages": record[messages_key]}


def to_chat(record: dict, fmt: str, where: str) -> Chat:
    """A record of a chat form as a `Chat`; a record with nothing to train on is an error naming it."""
    form = record_format(record, fmt)
    if form is None:
        raise UserError(
            f"data.source: {where} is not a conversation (no 'messages', 'conversations' or 'instruction'/'output')"
        )
    if form != "alpaca" and not isinstance(record.get(_FIELD[form]), list):
        raise UserError(f"data.source: {where} has no '{_FIELD[form]}' list (data.format: {fmt})")
    missing = [key for key in _REQUIRED.get(form, ()) if key not in record]
    if missing:
        raise UserError(
            f"data.source: {where} has no '{missing[0]}' field, which data.format: {form} reads"
            + (f" (it looks like {record_format(record, 'auto')})" if record_format(record, "auto") else "")
        )
    messages = _READERS[form](record, where)
    tools = _json_value(record.get("tools")) or None
    if tools is not None and not isinstance(tools, list):
        raise UserError(f"data.source: {where} has 'tools' that are not a JSON list of tool definitions")
    # A conversation without an assistant turn (system-only, empty) has no target: the token store leaves it out
    # and counts it (store.py), as it does any conversation with nothing to train on.
    return Chat(messages, tools, where)


# What each form reads, when data.format names it rather than detecting it from the record's fields.
_REQUIRED = {"alpaca": ("instruction", "output")}


_FIELD = {"messages": "messages", "sharegpt": "conversations"}


def _has_answer(message: dict) -> bool:
    """An assistant turn with text or tool calls; an empty one (a null `content`, Alpaca's null `output`) would
    train the end-of-turn token alone, so it is context."""
    return message["role"] == "assistant" and bool(_plain(message["content"]).strip() or message.get("tool_calls"))


def _plain(content: str | list) -> str:
    """A message's text for finding it in the rendered conversation: a list's last text part (parts of other
    kinds render as the template's own placeholders)."""
    if isinstance(content, str):
        return content
    texts = [p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return texts[-1] if texts else ""


def given_template(given: str) -> str:
    """`data.chat_template` as template text: inline where it holds Jinja markers, else the file it names."""
    if "{{" in given or "{%" in given:
        return given
    path = Path(given).expanduser()
    if not path.is_file():
        raise UserError(f"data.chat_template: no such file '{given}' (give a Jinja file or the template inline)")
    return path.read_text(encoding="utf-8")


def template_text(cfg: DataConfig, tokenizer: Any, model_type: str | None) -> str:
    """The chat template conversations are rendered with: `data.chat_template` (a file or inline), else the
    tokenizer's own; `data.template` must name the model's family."""
    if cfg.template is not None:
        check_template_name(cfg.template, model_type)
    if cfg.chat_template is not None:
        return given_template(cfg.chat_template)
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: the default one
        own = own.get("default")
    if not own:
        raise UserError(
            f"data.chat_template: the tokenizer '{getattr(tokenizer, 'name_or_path', '')}' has no chat template to "
            "render conversations with; set data.chat_template to a Jinja file or template"
        )
    return str(own)


def check_template_name(name: str, model_type: str | None) -> None:
    """A dialect's `template:` name is read as the model's own template only where it names the model's family."""
    families = TEMPLATE_FAMILIES.get(name)
    if families is None or (model_type is not None and model_type not in families):
        valid = sorted(n for n, types in TEMPLATE_FAMILIES.items() if model_type is None or model_type in types)
        raise UserError(
            f"data.template: '{name}' is not the chat template of this model ({model_type or 'unknown family'}); "
            f"valid: {', '.join(valid) or 'none (leave data.template unset)'} (the model's own template is used)"
        )


def model_type_of(folder: Path) -> str | None:
    """The model type in a model (or tokenizer) folder's config.json, where it has one."""
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


@dataclass
class ChatTemplate:
    """A tokenizer with the template it renders with and the mask options; `spans` and `encode` are the one place
    that decides which characters and tokens of a conversation are trained on."""

    tokenizer: Any
    template: str
    train_on_prompt: bool = False
    mask_history: bool = False
    train_on_eos: bool = True

    def __post_init__(self) -> None:
        self.end_of_turn = self._end_of_turn()
        self.writes_generation_prompt = self._writes_generation_prompt()

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer: Any, model_type: str | None = None) -> ChatTemplate:
        folder = getattr(tokenizer, "name_or_path", "")
        text = template_text(cfg, tokenizer, model_type or (model_type_of(Path(folder)) if folder else None))
        return cls(tokenizer, text, cfg.train_on_prompt, cfg.mask_history, cfg.train_on_eos)

    def render(self, messages: list[dict], tools: list | None = None, generation_prompt: bool = False) -> str:
        try:
            with _time_limit(RENDER_SECONDS):
                text = _render(self.tokenizer, self.template, messages, tools, generation_prompt)
        except _RenderTimeout:
            raise UserError(
                f"data.chat_template: rendering one conversation took more than {RENDER_SECONDS} s; the template "
                "loops without bound"
            ) from None
        except _ValueTooLong as exc:
            raise UserError(
                f"data.chat_template: the template builds {exc}; it writes text of its own without bound"
            ) from None
        except Exception as exc:  # jinja raises TemplateError, and templates raise_exception with their own words
            raise UserError(f"data.chat_template: rendering a conversation failed: {exc}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise UserError(
                f"data.chat_template: the template renders one conversation as {len(text):,} characters, more than "
                f"{MAX_RENDERED_CHARS:,}; it writes text of its own without bound"
            )
        return text

    def _end_of_turn(self) -> str:
        """What the template writes after an assistant turn's text (`<|im_end|>`, `<|eot_id|>`, EOS), without the
        whitespace before the next turn; empty when it writes nothing."""
        probe = [{"role": "user", "content": _PROBE_QUESTION}, {"role": "assistant", "content": _PROBE_ANSWER}]
        text = self.render(probe)
        at = text.rfind(_PROBE_ANSWER)
        return text[at + len(_PROBE_ANSWER) :].strip() if at >= 0 else ""

    def _writes_generation_prompt(self) -> bool:
        """Whether the template writes the assistant's header when asked (`add_generation_prompt`). One that ignores
        the flag renders the turns before an answer without the header; that prefix would put the header in the
        answer's span, so its answers are found by their text instead (`_turn_start`)."""
        probe = [{"role": "user", "content": _PROBE_QUESTION}]
        try:
            return self.render(probe, generation_prompt=True) != self.render(probe)
        except UserError:  # it refuses a lone question: the prefix is never rendered either, the text decides
            return False

    def _targets(self, messages: list[dict]) -> list[int]:
        """Indices of the messages trained on: assistant turns (the last only with mask_history), or as each
        message's `loss_weight` says where the record gives one."""
        weights = [m.get("loss_weight", 1.0 if _has_answer(m) else 0.0) for m in messages]
        targets = [i for i, w in enumerate(weights) if w > 0]
        return targets[-1:] if self.mask_history else targets

    def spans(self, chat: Chat, text: str) -> list[tuple[int, int]]:
        """Character spans of `text` (the conversation rendered) that are trained on."""
        if self.train_on_prompt:
            return [(0, len(text))]
        spans, cursor = [], 0
        for i in self._targets(chat.messages):
            start = self._turn_start(chat, i, text, cursor)
            end = self._turn_end(chat, i, text, start)
            spans.append((start, end))
            cursor = max(cursor, end)
        return spans

    def _turn_start(self, chat: Chat, i: int, text: str, cursor: int) -> int:
        assistant = chat.messages[i]["role"] == "assistant"
        try:  # a template may refuse a conversation cut short (roles that must alternate): then the text decides
            before = self.render(chat.messages[:i], chat.tools, generation_prompt=assistant) if i else ""
        except UserError:
            before = None
        content = _plain(chat.messages[i]["content"]).strip()
        if before is not None and text.startswith(before) and len(before) >= cursor:
            if not (assistant and content) or self.writes_generation_prompt:
                return len(before)
            cursor = len(before)  # the header the template writes in any case comes first: the answer is its text
        found = text.find(content, cursor) if content else -1
        if found < 0:
            raise UserError(
                f"data.chat_template: the template does not render {chat.where} so that turn {i + 1} can be found "
                "(neither as a continuation of the turns before it nor by its text)"
            )
        return found

    def _turn_end(self, chat: Chat, i: int, text: str, start: int) -> int:
        message = chat.messages[i]
        content = _plain(message["content"]).strip()
        found = text.find(content, start) if content else -1
        content_end = found + len(content) if found >= 0 else start
        if message["role"] == "assistant" and self.end_of_turn:
            eot = text.find(self.end_of_turn, content_end)
            if eot >= 0:
                return eot + len(self.end_of_turn) if self.train_on_eos else max(eot, content_end)
        try:
            through = self.render(chat.messages[: i + 1], chat.tools)
        except UserError:
            through = ""
        return len(through) if text.startswith(through) and len(through) > start else max(content_end, start)

    def encode(self, chat: Chat) -> tuple[list[int], list[bool]]:
        """The conversation's token ids (as the template renders it, no special tokens added) and which are trained
        on: those whose characters overlap a trained span. An empty conversation is no tokens (templates refuse to
        render one), left out and counted like any other with nothing to train on."""
        if not chat.messages:
            return [], []
        text = self.render(chat.messages, chat.tools)
        spans = self.spans(chat, text)
        if not getattr(self.tokenizer, "is_fast", False):
            raise UserError(
                "data.tokenizer: conversations need a fast (Rust) tokenizer, whose offsets place the trained turns; "
                f"'{getattr(self.tokenizer, 'name_or_path', '')}' has only a Python one"
            )
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        trained = [any(a < end and b > start for start, end in spans) for a, b in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), trained
