"""A region's records: their shapes, checked field by field, and the text each trains on.

Shapes, told apart per row by the fields present (names from the run config): ``text``
(every token trained on), ``prompt``/``response`` and Alpaca's ``instruction``/``input``/
``output`` (loss on the response), and ``messages`` of ``role``/``content`` turns (the
tokenizer's chat template; loss on the assistant turns only).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from fedciuic.config import Fields
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
    user = _user(values, fields.user_id_field)

    def present(name: str) -> bool:
        return values.get(name) is not None

    if present(fields.messages_field):
        messages = _messages(values[fields.messages_field], fields.messages_field)
        return Record(CHAT, messages=messages, user=user)
    if present(fields.prompt_field) or present(fields.response_field):
        prompt = _string(values, fields.prompt_field)
        return Record(PROMPT_RESPONSE, (prompt, _string(values, fields.response_field)), user=user)
    if present(INSTRUCTION) or present(OUTPUT):
        extra = values.get(INPUT)
        if extra is not None and not isinstance(extra, str):
            raise BadRecord(INPUT, f"expected a string, got {json_kind(extra)}")
        parts = (_string(values, INSTRUCTION), extra or "", _string(values, OUTPUT))
        return Record(ALPACA, parts, user=user)
    if present(fields.text_field):
        return Record(TEXT, (_string(values, fields.text_field),), user=user)
    has = ", ".join(sorted(values)) or "no fields"
    raise BadRecord(
        WHOLE_RECORD,
        f"no {fields.text_field}, {fields.prompt_field}/{fields.response_field}, "
        f"{INSTRUCTION}/{OUTPUT} or "
        f"{fields.messages_field} field (it has {has}); name your fields with the run config's "
        "text-field, prompt-field, response-field or messages-field",
    )


def _string(values: Mapping[str, Any], name: str) -> str:
    if (value := values.get(name)) is None:
        raise BadRecord(name, "missing")
    if not isinstance(value, str):
        raise BadRecord(name, f"expected a string, got {json_kind(value)}")
    if not value.strip():
        raise BadRecord(name, "empty")
    return value


def _user(values: Mapping[str, Any], name: str) -> str | None:
    if (value := values.get(name)) is None:
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


#: A reasoning block, as DeepSeek-R1 and Qwen3 write one before their answer.
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: An answer without reasoning after a prompt that opens a block gets an empty one, as
#: Qwen3 writes it with ``enable_thinking=False`` and R1 answers when it does not reason.
EMPTY_REASONING, AFTER_REASONING = "\n\n", "\n\n"
#: Stands in for an assistant turn's content, to find where a template writes it.
_SENTINEL = "fedciuic-assistant-turn-7c1e"
#: The rule a chat template must follow for its assistant turns to be trained on.
TEMPLATE_RULE = (
    "rendered up to an assistant turn with add_generation_prompt=True, a template must give "
    "the text it writes before that turn, or that text with a <think> block opened (which "
    "the turn's reasoning then continues)"
)

Piece = tuple[str, bool]  # (text, trained)


@dataclass(frozen=True)
class Rendered:
    """A record's rows (training examples) of pieces with or without loss, tokenised one by
    one (as a prompt is at inference) so that no token straddles prompt and response."""

    rows: tuple[tuple[Piece, ...], ...]
    #: Text records longer than seq-len are split into chunks; the others are cut.
    chunked: bool


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
            prompt = self.bos + template.format(instruction=instruction, input=extra)
            response = output
        pieces = ((prompt, False), (response + self.eos, True))
        return Rendered((pieces,), chunked=record.shape == TEXT)

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
        """Each assistant turn follows the very prompt the template gives it at inference;
        a turn whose prompt does not continue the row (dropped reasoning) starts a new row."""
        turns = [{ROLE: role, CONTENT: content} for role, content in messages]
        rows: list[list[Piece]] = []
        text = ""  # the current row's text
        for i, (role, _) in enumerate(messages):
            if role != ASSISTANT:
                continue
            prompt, answer = self._turn(turns, i)
            if rows and prompt.startswith(text):
                rows[-1] += [(prompt[len(text) :], False), (answer, True)]
            else:
                rows.append([(prompt, False), (answer, True)])
            text = prompt + answer
        return Rendered(tuple(tuple(p for p in row if p[0]) for row in rows), chunked=False)

    def _turn(self, turns: list[dict[str, str]], i: int) -> tuple[str, str]:
        """The prompt before assistant turn ``i`` and what the model writes for it."""
        content = turns[i][CONTENT]
        before = turns[:i]
        whole = self._template(turns[: i + 1], generation=False)
        prompt = self._template(before, generation=True) if before else None
        if prompt is not None and whole.startswith(prompt) and THINK_CLOSE not in content:
            return prompt, whole[len(prompt) :]  # the common case: two renderings
        # Where the template writes a turn's content (not found if it changes it).
        probe = self._template([*before, {ROLE: ASSISTANT, CONTENT: _SENTINEL}], generation=False)
        found = probe.count(_SENTINEL) == 1
        head, _, end = probe.partition(_SENTINEL)
        if prompt is None:  # a conversation that opens with the assistant: no prompt
            prompt = head if found else ""
        if whole.startswith(prompt):
            # The turn continues its prompt (perhaps with Qwen3's reasoning block added):
            # train on the template's rendering of it.
            answer = whole[len(prompt) :]
            if (
                THINK_CLOSE in content
                and THINK_CLOSE not in answer
                and found
                and head == prompt
                and whole.endswith(end)
            ):
                # The template drops the reasoning of the very turn being written (as
                # R1's did before its prompt opened a block): the model still writes it.
                answer = content + end
            return prompt, answer
        opened = prompt[len(head) :] if found and prompt.startswith(head) else ""
        if opened.strip() != THINK_OPEN:
            raise _unmaskable("its generation prompt is not how it begins an assistant turn")
        return prompt, _after_opened(opened, content) + end


def _after_opened(opened: str, content: str) -> str:
    """What the model writes for ``content`` after a prompt that opened a reasoning block
    with ``opened``: the rest of the reasoning, ``</think>``, the answer."""
    if THINK_CLOSE in content:
        reasoning, _, answer = content.rpartition(THINK_CLOSE)
        reasoning = reasoning.lstrip().removeprefix(THINK_OPEN)
    else:
        reasoning, answer = EMPTY_REASONING, AFTER_REASONING + content
    written = opened[opened.index(THINK_OPEN) + len(THINK_OPEN) :]  # after the tag: a newline
    return reasoning.removeprefix(written) + THINK_CLOSE + answer


def _unmaskable(problem: str) -> DataError:
    return DataError(
        "the model's chat template cannot be masked for training (the loss must fall on the "
        f"assistant turns only): {problem}. The rule: {TEMPLATE_RULE}. Fix: give the "
        "checkpoint the chat template it was trained with (tokenizer_config.json's "
        "chat_template, or chat_template.jinja), or write the records as prompt/response "
        '(docs/data.md, "Chat templates")'
    )


#: Conversations a chat template is tried on before any data is read (some refuse a system turn).
_PROBE = (
    (USER, "Where does the data stay?"),
    (ASSISTANT, f"{THINK_OPEN}\nThe policy says.\n{THINK_CLOSE}\n\nAt home."),
    (USER, "And the relay?"),
    (ASSISTANT, "It sees ciphertext."),
)
_PROBES = (((SYSTEM, "Be brief."), *_PROBE), _PROBE)


def check_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    """Refuse, before any record is read, a model whose chat template cannot be trained on."""
    renderer = Renderer(tokenizer)
    refused: BadRecord | None = None
    for messages in _PROBES:
        try:
            renderer.render(Record(CHAT, messages=messages))
            return
        except BadRecord as err:  # the template refuses the conversation, e.g. its system turn
            refused = err
    raise DataError(
        f"the model's chat template refuses a plain conversation ({refused}); give the "
        "checkpoint the chat template it was trained with, or write the records as "
        "prompt/response"
    )


def json_kind(value: object) -> str:
    names = {str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    if value is None:
        return "null"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return names.get(type(value), type(value).__name__)
