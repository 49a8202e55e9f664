"""Deterministic demo data per region, made from documentation that ships with CPython.

Each region gets a different family of standard-library modules (non-IID by topic) and
made-up users asking about them in every record shape, each record naming its user; a
generator seeded by the region's name makes the same files on every run.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import random
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

from fedciuic.config import Fields
from fedciuic.data.demo_pii import DEMO_DICTIONARIES, sign_questions
from fedciuic.data.records import ASSISTANT, CONTENT, INPUT, INSTRUCTION, OUTPUT, ROLE, SYSTEM, USER
from fedciuic.errors import ConfigError


def _family(modules: str) -> tuple[str, ...]:
    return tuple(modules.split())


#: Module families per region; each region's corpus is the docstrings of its family.
FAMILIES: dict[str, tuple[str, ...]] = {
    "eu": _family(
        "email http urllib html json xml mailbox smtplib imaplib poplib ftplib base64 quopri "
        "mimetypes codecs gettext locale csv configparser"
    ),
    "cn": _family(
        "decimal fractions statistics random math cmath numbers array heapq bisect itertools "
        "functools operator collections struct hashlib hmac secrets zlib datetime calendar enum "
        "dataclasses copy pprint"
    ),
    "us": _family(
        "os shutil pathlib subprocess threading multiprocessing asyncio concurrent socket "
        "selectors signal logging tempfile glob fnmatch io sched queue argparse"
    ),
    "sg": _family("unittest doctest pdb trace timeit cProfile inspect dis"),
    "in": _family("sqlite3 dbm shelve pickle zipfile tarfile gzip bz2 lzma"),
}

#: Upper bound on the docstrings read per region (also the BPE tokenizer's training text).
MAX_CHARS = 200_000
#: Upper bound on the text of a region's records: tokenising takes seconds on one core.
MAX_RECORD_CHARS = 300_000

#: The record fields as the run config names them by default.
_FIELDS = Fields()
TEXT, PROMPT, RESPONSE = _FIELDS.text_field, _FIELDS.prompt_field, _FIELDS.response_field
MESSAGES, USER_ID = _FIELDS.messages_field, _FIELDS.user_id_field

#: A region's files: plain text, chat, and instruction records (Alpaca or prompt/response).
DOCS_FILE, CHAT_FILE, INSTRUCTIONS_FILE = "docs.jsonl", "chat.jsonl", "instructions.jsonl"
#: Regions whose ``instructions.jsonl`` holds Alpaca records (the others: prompt/response).
ALPACA_REGIONS = frozenset({"eu", "sg", "in"})

#: Users per region, and the records one user gives (log-normal, median about 6: heavy-tailed).
USERS_PER_REGION = (110, 170)
RECORDS_PER_USER = (1, 40)
_LOG_MEDIAN, _LOG_SIGMA = 1.8, 1.0
#: How often a user writes each kind of record.
_KIND_WEIGHTS = {CHAT_FILE: 0.45, INSTRUCTIONS_FILE: 0.35, DOCS_FILE: 0.2}
#: How often a chat opens with a system prompt, and how often it has a second exchange.
_SYSTEM_SHARE, _TWO_EXCHANGES = 0.2, 0.2
#: How often a user asks about their favourite module rather than anything else.
_FOCUS = 0.7
#: Answers are a docstring's first paragraphs, at most this long (seq-len is short).
ANSWER_CHARS = 600
#: How far an answer may grow beyond its first paragraph (mostly not: MAX_RECORD_CHARS).
_ANSWER_LIMITS = (0, 0, 0, 0, 0, 250, ANSWER_CHARS)

_QUESTIONS = {
    "module": (
        "What is the {name} module for?",
        "How do I use {name}?",
        "What does the `{name}` module do?",
        "Can you give me an overview of {name}?",
        "When should I reach for `{name}`?",
    ),
    "class": (
        "What is `{name}`?",
        "How do I use {name}?",
        "What does the {name} class represent?",
        "Explain `{name}` to me.",
        "when would i create a {name}",
    ),
    "function": (
        "What does `{name}` do?",
        "How do I use {name}?",
        "What does {name}() return?",
        "Explain `{name}` briefly.",
        "I'm reading code that calls {name}. What does it do?",
    ),
}
_SYSTEM_PROMPTS = (
    "You are a helpful assistant who knows Python's standard library well.",
    "Answer briefly, in the words of the Python documentation.",
    "You help programmers read unfamiliar Python code.",
)
_MORE = ("Can you tell me more?", "Anything else I should know?", "Go on.")
_RELATED = ("And what about `{name}`?", "How does that relate to {name}?", "What about {name}?")
_EXPLAIN = (
    "Explain what the following Python object does.",
    "Summarise the documentation of this standard-library object.",
)
_DESCRIBE = ("Summarise the documentation of `{name}`.", "Describe {name} in a few sentences.")
_IDENTIFY = "Name the standard-library object this documentation describes."
_SENTENCE_END = re.compile(r"[.!?](?=\s)")


class Documented(NamedTuple):
    name: str  # dotted, e.g. "json.dumps"
    kind: str  # a key of _QUESTIONS
    doc: str


def module_docs(names: tuple[str, ...], max_chars: int = MAX_CHARS) -> list[str]:
    return [item.doc for item in documented(names, max_chars)]


def documented(names: tuple[str, ...], max_chars: int = MAX_CHARS) -> list[Documented]:
    """The named modules, public submodules and members with a docstring of 40 characters
    or more, in a fixed order, until their docstrings reach ``max_chars``."""
    found: list[Documented] = []
    total = 0
    for module in _modules(names):
        members = [(module.__name__, module)] + [
            (f"{module.__name__}.{attr}", obj)
            for attr, obj in sorted(vars(module).items())
            if not attr.startswith("_") and getattr(obj, "__module__", None) == module.__name__
        ]
        for name, obj in members:
            doc = inspect.getdoc(obj)
            if not doc or len(doc) < 40:
                continue
            found.append(Documented(name, _kind(obj), doc))
            total += len(doc)
            if total >= max_chars:
                return found
    return found


def _kind(obj: object) -> str:
    if inspect.ismodule(obj):
        return "module"
    return "class" if inspect.isclass(obj) else "function"


def _modules(names: tuple[str, ...]) -> list[ModuleType]:
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue  # e.g. a CPython built without this optional module
            found.append(module)
            subs = sorted(
                info.name
                for info in pkgutil.iter_modules(getattr(module, "__path__", []), f"{name}.")
                if not info.name.rsplit(".", 1)[-1].startswith("_")
                and "test" not in info.name
                and "__main__" not in info.name
            )
            for sub in subs:
                try:
                    found.append(importlib.import_module(sub))
                except Exception:
                    continue
    return found


def write_demo_corpora(root: Path, regions: tuple[str, ...]) -> dict[str, Path]:
    """Write each region's files and synthetic names' dictionary under ``root``; the folders."""
    if unknown := [r for r in regions if r not in FAMILIES]:
        raise ConfigError(
            [f"demo data:regions: no demo corpus for {unknown}; known: {', '.join(FAMILIES)}"]
        )
    folders = {}
    for region in regions:
        folder = root / region
        folder.mkdir(parents=True, exist_ok=True)
        records = demo_records(region)
        names = sign_questions(region, records[CHAT_FILE], USER_ID)
        for name, rows in records.items():
            lines = [json.dumps(record, ensure_ascii=False) for record in rows]
            (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
        dictionaries = root / DEMO_DICTIONARIES
        dictionaries.mkdir(exist_ok=True)
        (dictionaries / f"{region}.txt").write_text(
            f"# Demo customers of region {region} (synthetic), one per line\n"
            + "".join(f"{n}\n" for n in names),
            encoding="utf-8",
        )
        folders[region] = folder
    return folders


def demo_records(region: str) -> dict[str, list[dict[str, Any]]]:
    return _Writer(region, documented(FAMILIES[region])).records()


class _Writer:
    """Makes one region's users and records from one generator seeded by the region's name."""

    def __init__(self, region: str, pool: list[Documented]) -> None:
        self.region = region
        self.pool = pool
        self.rng = random.Random(f"fedciuic-demo:{region}")
        self.by_module: dict[str, list[Documented]] = {}
        for item in pool:
            self.by_module.setdefault(item.name.split(".")[0], []).append(item)
        self.instruction: Callable[[Documented], dict[str, Any]] = (
            self._alpaca if region in ALPACA_REGIONS else self._prompt_response
        )
        self.chars = 0

    def records(self) -> dict[str, list[dict[str, Any]]]:
        rng = self.rng
        files: dict[str, list[dict[str, Any]]] = {name: [] for name in _KIND_WEIGHTS}
        make = {CHAT_FILE: self._chat, INSTRUCTIONS_FILE: self.instruction, DOCS_FILE: self._text}
        kinds, weights = list(_KIND_WEIGHTS), list(_KIND_WEIGHTS.values())
        for index in range(rng.randint(*USERS_PER_REGION)):
            user = f"{self.region}-u{index:04d}"
            focus = self.by_module[rng.choice(sorted(self.by_module))]
            low, high = RECORDS_PER_USER
            count = min(high, max(low, round(rng.lognormvariate(_LOG_MEDIAN, _LOG_SIGMA))))
            for _ in range(count):
                item = rng.choice(focus if rng.random() < _FOCUS else self.pool)
                kind = rng.choices(kinds, weights)[0]
                record = make[kind](item)
                size = _chars(record)
                if self.chars + size > MAX_RECORD_CHARS:
                    break  # a guard: the figures above keep a region well within it
                self.chars += size
                files[kind].append({**record, USER_ID: user})
        for records in files.values():
            rng.shuffle(records)  # users' records interleave, as in a real export
        return files

    def _answer(self, doc: str) -> str:
        return summary(doc, self.rng.choice(_ANSWER_LIMITS))

    def _question(self, item: Documented) -> str:
        return self.rng.choice(_QUESTIONS[item.kind]).format(name=item.name)

    def _chat(self, item: Documented) -> dict[str, Any]:
        rng = self.rng
        answer = self._answer(item.doc)
        turns: list[dict[str, str]] = []
        if rng.random() < _SYSTEM_SHARE:
            turns.append(_turn(SYSTEM, rng.choice(_SYSTEM_PROMPTS)))
        turns += [_turn(USER, self._question(item)), _turn(ASSISTANT, answer)]
        if rng.random() < _TWO_EXCHANGES:
            told = len(answer) if item.doc.startswith(answer) else len(item.doc)
            rest = self._answer(item.doc[told:])
            if rest and rng.random() < 0.5:
                turns += [_turn(USER, rng.choice(_MORE)), _turn(ASSISTANT, rest)]
            else:
                other = rng.choice(self.by_module[item.name.split(".")[0]])
                question = rng.choice(_RELATED).format(name=other.name)
                turns += [_turn(USER, question), _turn(ASSISTANT, self._answer(other.doc))]
        return {MESSAGES: turns}

    def _alpaca(self, item: Documented) -> dict[str, Any]:
        rng = self.rng
        answer = self._answer(item.doc)
        choice = rng.random()
        if choice < 0.4:
            return {INSTRUCTION: rng.choice(_EXPLAIN), INPUT: item.name, OUTPUT: answer}
        if choice < 0.8:
            instruction = rng.choice(_DESCRIBE).format(name=item.name)
            return {INSTRUCTION: instruction, INPUT: "", OUTPUT: answer}
        return {INSTRUCTION: _IDENTIFY, INPUT: answer, OUTPUT: item.name}

    def _prompt_response(self, item: Documented) -> dict[str, Any]:
        answer = self._answer(item.doc)
        if self.rng.random() < 0.2:
            return {PROMPT: f"{_IDENTIFY}\n\n{answer}", RESPONSE: item.name}
        return {PROMPT: self._question(item), RESPONSE: answer}

    def _text(self, item: Documented) -> dict[str, Any]:
        return {TEXT: f"{item.name}\n\n{self._answer(item.doc)}"}


def _turn(role: str, content: str) -> dict[str, str]:
    return {ROLE: role, CONTENT: content}


def _chars(value: object) -> int:
    """The characters of every string in ``value``."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0


def summary(doc: str, limit: int = ANSWER_CHARS) -> str:
    """The first paragraph of ``doc`` (cut to ANSWER_CHARS), then what fits in ``limit``."""
    paragraphs = [p.strip() for p in doc.strip().split("\n\n") if p.strip()]
    if not paragraphs:
        return ""
    text = _cut(paragraphs[0])
    for paragraph in paragraphs[1:]:
        if len(text) + 2 + len(paragraph) > limit:
            break
        text += "\n\n" + paragraph
    return text


def _cut(text: str) -> str:
    if len(text) <= ANSWER_CHARS:
        return text
    head = text[:ANSWER_CHARS]
    sentence = max((m.end() for m in _SENTENCE_END.finditer(head)), default=0)
    for cut in (sentence, head.rfind("\n"), head.rfind(" ")):
        if cut > ANSWER_CHARS // 3:
            return head[:cut].rstrip()
    return head
