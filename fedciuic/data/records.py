"""A region's records: their shapes, checked field by field, and the text each trains on.

Four shapes, told apart per row by the fields present (names from the run config):

- ``text``: ``{"text"}``; every token is trained on (continued pre-training).
- ``prompt-response``: ``{"prompt", "response"}``, joined as they are; loss on the response.
- ``alpaca``: ``{"instruction", "input", "output"}`` in Alpaca's prompt; loss on the output.
- ``chat``: ``{"messages": [{"role", "content"}, ...]}`` rendered with the tokenizer's
  chat template; loss on the assistant turns only.

A record renders to pieces of text, each with or without loss.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from fedciuic.config import RunConfig
from fedciuic.errors import DataError

Shape = Literal["text", "prompt-response", "alpaca", "chat"]
TEXT: Shape = "text"
PROMPT_RESPONSE: Shape = "prompt-response"
ALPACA: Shape = "alpaca"
CHAT: Shape = "chat"
SHAPES: tuple[Shape, ...] = (TEXT, PROMPT_RESPONSE, ALPACA, CHAT)

#: Alpaca's field names (the Stanford Alpaca release) and its prompt.
INSTRUCTION, INPUT, OUTPUT = "instruction", "input", "output"
ALPACA_PREAMBLE = "Below is an instruction that describes a task"
ALPACA_PROMPT = (
    ALPACA_PREAMBLE + ". Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    ALPACA_PREAMBLE + ", paired with an input that provides further context. Write a "
    "response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
#: Chat roles (the assistant's turns are trained on), and the keys of a chat message.
SYSTEM, USER, ASSISTANT = "system", "user", "assistant"
ROLES = (SYSTEM, USER, ASSISTANT)
ROLE, CONTENT = "role", "content"
#: What a problem about the record as a whole names as its field.
WHOLE_RECORD = "record"


class BadRecord(ValueError):
    """One row's problem: ``field: message``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


_DEFAULTS = RunConfig.model_fields


@dataclass(frozen=True)
class Fields:
    """The field names of each shape in this federation's records (run config)."""

    text: str = _DEFAULTS["text_field"].default
    prompt: str = _DEFAULTS["prompt_field"].default
    response: str = _DEFAULTS["response_field"].default
    messages: str = _DEFAULTS["messages_field"].default
    user_id: str = _DEFAULTS["user_id_field"].default

    @classmethod
    def from_run(cls, run: RunConfig) -> Fields:
        return cls(
            text=run.text_field,
            prompt=run.prompt_field,
            response=run.response_field,
            messages=run.messages_field,
            user_id=run.user_id_field,
        )


@dataclass(frozen=True)
class Record:
    """A validated record: its shape, its strings, and the person it belongs to."""

    shape: Shape
    parts: tuple[str, ...] = ()  # text: (text,); prompt-response: (p, r); alpaca: (i, in, o)
    messages: tuple[tuple[str, str], ...] = ()  # chat: (role, content) per turn
    user: str | None = None

    def digest(self) -> bytes:
        """SHA-256 of the record's content: the held-out split is drawn from it."""
        canonical = json.dumps([self.shape, self.parts, self.messages, self.user])
        return hashlib.sha256(canonical.encode()).digest()


def parse_record(values: Mapping[str, Any], fields: Fields) -> Record:
    """Check one row and say what it is; :class:`BadRecord` names the field at fault."""
    user = _user(values, fields.user_id)

    def present(name: str) -> bool:
        return values.get(name) is not None

    if present(fields.messages):
        return Record(CHAT, messages=_messages(values[fields.messages], fields.messages), user=user)
    if present(fields.prompt) or present(fields.response):
        prompt = _string(values, fields.prompt)
        return Record(PROMPT_RESPONSE, (prompt, _string(values, fields.response)), user=user)
    if present(INSTRUCTION) or present(OUTPUT):
        extra = values.get(INPUT)
        if extra is not None and not isinstance(extra, str):
            raise BadRecord(INPUT, f"expected a string, got {json_kind(extra)}")
        return Record(
            ALPACA,
            (_string(values, INSTRUCTION), extra or "", _string(values, OUTPUT)),
            user=user,
        )
    if present(fields.text):
        return Record(TEXT, (_string(values, fields.text),), user=user)
    has = ", ".join(sorted(values)) or "no fields"
    raise BadRecord(
        WHOLE_RECORD,
        f"no {fields.text}, {fields.prompt}/{fields.response}, {INSTRUCTION}/{OUTPUT} or "
        f"{fields.messages} field (it has {has}); name your fields with the run config's "
        "text-field, prompt-field, response-field or messages-field",
    )


def _string(values: Mapping[str, Any], name: str) -> str:
    value = values.get(name)
    if value is None:
        raise BadRecord(name, "missing")
    if not isinstance(value, str):
        raise BadRecord(name, f"expected a string, got {json_kind(value)}")
    if not value.strip():
        raise BadRecord(name, "empty")
    return value


def _user(values: Mapping[str, Any], name: str) -> str | None:
    value = values.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise BadRecord(name, f"expected a string or an integer, got {json_kind(value)}")
    text = str(value)
    if not text.strip():
        raise BadRecord(name, "empty")
    return text


def _messages(value: Any, name: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise BadRecord(name, f"expected a non-empty array of turns, got {json_kind(value)}")
    turns = []
    for i, turn in enumerate(value):
        at = f"{name}[{i}]"
        if not isinstance(turn, Mapping):
            raise BadRecord(
                at, f'expected {{"{ROLE}": ..., "{CONTENT}": ...}}, got {json_kind(turn)}'
            )
        role, content = turn.get(ROLE), turn.get(CONTENT)
        if role not in ROLES:
            # The value is not repeated: a refusal's reason leaves the region.
            raise BadRecord(f"{at}.{ROLE}", f"not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise BadRecord(f"{at}.{CONTENT}", f"expected a string, got {json_kind(content)}")
        turns.append((str(role), content))
    if not any(role == ASSISTANT and content.strip() for role, content in turns):
        raise BadRecord(name, "no assistant turn with content: nothing to learn from")
    return tuple(turns)


@dataclass(frozen=True)
class Rendered:
    """A record as the model reads it: consecutive pieces of text, each with or without
    loss. Pieces are tokenised one by one (as a prompt is at inference), so that no token
    straddles the prompt and the response."""

    pieces: tuple[tuple[str, bool], ...]  # (text, trained)
    #: Text records longer than seq-len are split into chunks; the others are cut.
    chunked: bool

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)


class Renderer:
    """Renders records for one tokenizer: its BOS/EOS tokens and its chat template."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.bos = str(tokenizer.bos_token or "")
        self.eos = str(tokenizer.eos_token or "")

    def render(self, record: Record) -> Rendered:
        if record.shape == CHAT:
            return self._chat(record.messages)
        if record.shape == TEXT:
            prompt, response = self.bos, record.parts[0]
        elif record.shape == PROMPT_RESPONSE:
            prompt, response = self.bos + record.parts[0], record.parts[1]
        else:
            instruction, extra, output = record.parts
            template = ALPACA_PROMPT_WITH_INPUT if extra.strip() else ALPACA_PROMPT
            prompt, response = (
                self.bos + template.format(instruction=instruction, input=extra),
                output,
            )
        pieces = ((prompt, False), (response + self.eos, True))
        return Rendered(pieces, chunked=record.shape == TEXT)

    def _template(self, turns: list[dict[str, str]], *, generation: bool) -> str:
        try:
            rendered = self.tokenizer.apply_chat_template(
                turns, tokenize=False, add_generation_prompt=generation
            )
        except ValueError as err:  # no template: a problem of the model, not of the row
            raise DataError(
                f"the model's tokenizer has no usable chat template ({err}); chat records "
                "need one: use a checkpoint whose tokenizer_config.json or "
                "chat_template.jinja has it, or write the records as prompt/response"
            ) from None
        except Exception as err:
            raise BadRecord(WHOLE_RECORD, f"the chat template refuses it ({err})") from None
        return str(rendered)

    def _chat(self, messages: tuple[tuple[str, str], ...]) -> Rendered:
        turns = [{ROLE: role, CONTENT: content} for role, content in messages]
        full = self._template(turns, generation=False)
        pieces: list[tuple[str, bool]] = []
        done = 0  # characters of ``full`` already in pieces
        for i, (role, _) in enumerate(messages):
            if role != ASSISTANT:
                continue
            before = self._template(turns[:i], generation=True) if i else ""
            through = self._template(turns[: i + 1], generation=False)
            if not (full.startswith(through) and through.startswith(before)):
                raise DataError(
                    "the model's chat template does not render a conversation's first turns "
                    "as a prefix of the whole, so its assistant turns cannot be located for "
                    "the loss; use a prefix-stable template (docs/data.md)"
                )
            pieces += [(full[done : len(before)], False), (full[len(before) : len(through)], True)]
            done = len(through)
        pieces.append((full[done:], False))
        return Rendered(tuple((text, trained) for text, trained in pieces if text), chunked=False)


def json_kind(value: object) -> str:
    """How JSON would name ``value``'s type, for messages."""
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    if value is None:
        return "null"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return names.get(type(value), type(value).__name__)
