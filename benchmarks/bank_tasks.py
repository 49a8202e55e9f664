"""A bank's transaction categorisation per region: a task with a large gain to keep.

A quality benchmark needs a gain that fine-tuning makes and a compressed or noised
update may lose, scored exactly rather than read from eval loss. Here each region's
bank files card payments under its own ledger categories: its own label words (``eu``
German, ``cn`` pinyin, ``us`` upper-case English, any other region pseudo-words drawn
from a generator seeded by its name) and its own grouping of merchant types into them,
drawn at random, so that a label's meaning says nothing of which merchants it holds: a
base model is expected to score about chance (1 / the number of labels), and
fine-tuning learns the grouping from the merchant type word in each description. The
same description has a different answer in each region (non-IID). Descriptions are
synthetic (a payment channel, a brand, a city, an amount, a reference and the
merchant type, from the word lists below); everything is written offline, the same bytes
for the same seed.

    from bank_tasks import write_task_corpora
    splits = write_task_corpora(Path("bank-data"), ["eu", "cn", "us"], 400, 50, 200, seed=0)

Each region's training records go to ``root/<region>/transactions.jsonl`` (chat records
with a ``user_id``, which a region reads as ``data-root/<region>``), and its held-out
records to ``root/<region>/.bench/`` (a hidden folder, which a region does not read:
docs/data.md) or ``heldout_dir/<region>/``.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from fedciuic.data.records import (
    ASSISTANT,
    CHAT,
    CONTENT,
    ROLE,
    THINK_CLOSE,
    USER,
    Record,
    Renderer,
)

#: A record as written: ``{"messages": [...], "user_id": ...}`` (the run config's default
#: field names).
ChatRecord = dict[str, Any]
MESSAGES, USER_ID = "messages", "user_id"

#: A region's training file (under ``root/<region>/``), and where its held-out records go
#: when no ``heldout_dir`` is given: hidden, so that the region does not read them.
TRAIN_FILE = "transactions.jsonl"
HELDOUT_FOLDER = ".bench"
VALIDATION_FILE, TEST_FILE, SCHEME_FILE = "validation.jsonl", "test.jsonl", "scheme.json"

#: Merchant types and the word each description names it by; the only signal of the
#: answer (brands, cities and amounts are drawn independently of it).
KINDS: tuple[str, ...] = (
    "BAKERY",
    "PHARMACY",
    "SUPERMARKET",
    "BUTCHER",
    "FUEL",
    "GARAGE",
    "CINEMA",
    "THEATRE",
    "AIRLINE",
    "HOTEL",
    "RAILWAY",
    "TAXI",
    "PARKING",
    "DENTIST",
    "CLINIC",
    "OPTICIAN",
    "GYM",
    "BOOKSHOP",
    "FLORIST",
    "TELECOM",
    "POWER",
    "WATERWORKS",
    "INSURER",
    "PROPERTIES",
)
_KIND_SET = frozenset(KINDS)
BRANDS: tuple[str, ...] = (
    "NORDWIND",
    "LUMEN",
    "ALDER",
    "KESTREL",
    "ORION",
    "MERIDIAN",
    "BLUEWATER",
    "SILVERLINE",
    "PINECREST",
    "CEDAR",
    "HARBOUR",
    "SUMMIT",
    "RIVERSIDE",
    "MAPLE",
    "STERLING",
    "APEX",
    "NOVA",
    "CORAL",
    "AURORA",
    "FALKE",
    "LINDEN",
    "HUAXIA",
    "JINLONG",
    "TIANFU",
    "LIBERTY",
    "FRONTIER",
    "EAGLE",
    "BIRCHWOOD",
)


@dataclass(frozen=True)
class Style:
    """How a region's bank writes a transaction: payment channels, cities, currency."""

    channels: tuple[str, ...]
    cities: tuple[str, ...]
    currency: str
    decimal_comma: bool = False


#: The labels, the bank's name in prompts and the description style of known regions.
KNOWN_LABELS: dict[str, tuple[str, ...]] = {
    "eu": (
        "Lebensmittel",
        "Miete",
        "Freizeit",
        "Gesundheit",
        "Versicherung",
        "Haushalt",
        "Verkehr",
    ),
    "cn": ("canyin", "jiaotong", "yule", "yiliao", "zhufang", "riyong"),
    "us": (
        "GROCERIES",
        "RENT",
        "TRAVEL",
        "DINING",
        "HEALTH",
        "UTILITIES",
        "ENTERTAINMENT",
        "INSURANCE",
    ),
}
BANKS = {"eu": "Nordbank", "cn": "Huaxin Bank", "us": "Liberty Savings"}
STYLES = {
    "eu": Style(
        ("KARTENZAHLUNG", "LASTSCHRIFT", "SEPA", "UEBERWEISUNG"),
        (
            "BERLIN",
            "MUENCHEN",
            "HAMBURG",
            "KOELN",
            "WIEN",
            "ZUERICH",
            "PARIS",
            "LYON",
            "MADRID",
            "MILANO",
            "AMSTERDAM",
            "LISBOA",
            "PRAHA",
            "DUBLIN",
        ),
        "EUR",
        decimal_comma=True,
    ),
    "cn": Style(
        ("XIAOFEI", "ZHIFU", "KUAIJIE", "POS"),
        (
            "BEIJING",
            "SHANGHAI",
            "SHENZHEN",
            "GUANGZHOU",
            "CHENGDU",
            "HANGZHOU",
            "WUHAN",
            "NANJING",
            "XIAN",
            "TIANJIN",
            "SUZHOU",
        ),
        "CNY",
    ),
    "us": Style(
        ("POS DEBIT", "ACH", "CHECKCARD", "ONLINE PMT"),
        (
            "NEW YORK NY",
            "CHICAGO IL",
            "AUSTIN TX",
            "SEATTLE WA",
            "DENVER CO",
            "BOSTON MA",
            "MIAMI FL",
            "PHOENIX AZ",
            "PORTLAND OR",
            "ATLANTA GA",
        ),
        "USD",
    ),
}
#: Categories of a region not listed above: drawn from this range.
CATEGORIES = (6, 8)
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
_REF = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
_REGION = re.compile(r"[a-z][a-z0-9_-]*")
#: Records per customer (each record names its customer, for privacy-unit = "user").
_PER_CUSTOMER = 5
_TRANSACTION = "Transaction: "


@dataclass(frozen=True)
class Scheme:
    """A region's categories: its labels and the label of each merchant type."""

    region: str
    bank: str
    labels: tuple[str, ...]
    category: Mapping[str, str]  # merchant type (a word of KINDS) -> label
    style: Style

    def answer(self, description: str) -> str:
        """The label of ``description`` (any region's) under this scheme."""
        return self.category[kind_of(description)]

    def prompt(self, description: str) -> str:
        """The user turn: the bank's question and the transaction. The labels are not
        listed: a score ranks the region's labels, and a short prompt is a cheap step
        (a byte-level tiny base reads every character)."""
        return f"{self.bank} ledger category? {_TRANSACTION}{description}"


@dataclass(frozen=True)
class TaskSplits:
    """A region's records, and where they were written."""

    region: str
    labels: tuple[str, ...]
    train: list[ChatRecord]
    validation: list[ChatRecord]
    test: list[ChatRecord]
    train_file: Path
    heldout: Path  # holds VALIDATION_FILE, TEST_FILE and SCHEME_FILE


def kind_of(description: str) -> str:
    """The merchant type a description names (its one word from :data:`KINDS`)."""
    found = [word for word in description.split() if word in _KIND_SET]
    if len(found) != 1:
        raise ValueError(f"not one merchant type in {description!r}: {found}")
    return found[0]


@cache
def scheme(region: str) -> Scheme:
    """The region's categories, the same on every run (a generator seeded by its name;
    the seed of :func:`write_task_corpora` draws records, not the scheme)."""
    if not _REGION.fullmatch(region):
        raise ValueError(f"region {region!r}: expected a lower-case name such as eu")
    rng = random.Random(f"fedciuic-bank-scheme:{region}")
    count = len(KNOWN_LABELS.get(region, ())) or rng.randint(*CATEGORIES)
    words = _pseudo_words(rng, count + 13, 2, 3)  # labels, cities, the bank: all different
    labels = KNOWN_LABELS.get(region) or words[:count]
    style = STYLES.get(region) or Style(
        ("CARD", "DEBIT", "PAYMENT"),
        tuple(word.upper() for word in words[count : count + 12]),
        rng.choice(("GBP", "CHF", "SGD", "INR", "JPY", "AUD", "BRL", "ZAR")),
    )
    kinds = list(KINDS)
    rng.shuffle(kinds)
    shuffled = list(labels)
    rng.shuffle(shuffled)
    # Round robin: every label holds 3 or 4 merchant types.
    category = {kind: shuffled[i % len(shuffled)] for i, kind in enumerate(kinds)}
    bank = BANKS.get(region) or f"{words[-1]} Bank"
    return Scheme(region, bank, tuple(labels), category, style)


def _pseudo_words(rng: random.Random, n: int, low: int, high: int) -> tuple[str, ...]:
    words: list[str] = []
    while len(words) < n:
        word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(low, high))).title()
        if word.upper() not in {w.upper() for w in words} | _KIND_SET:
            words.append(word)
    return tuple(words)


def chance(region: str) -> float:
    """Accuracy by guessing: 1 / the region's number of labels (each is as common)."""
    return 1.0 / len(scheme(region).labels)


def descriptions(region: str, n: int, seed: int) -> list[str]:
    """``n`` different transaction descriptions in the region's style, each label's
    as common as another's (a label drawn, then one of its merchant types)."""
    found_scheme = scheme(region)
    style = found_scheme.style
    members = {
        label: [k for k in KINDS if found_scheme.category[k] == label]
        for label in found_scheme.labels
    }
    rng = random.Random(f"fedciuic-bank-tasks:{region}:{seed}")
    found: dict[str, None] = {}  # ordered and unique
    while len(found) < n:
        amount = round(math.exp(rng.uniform(math.log(2.0), math.log(2500.0))), 2)
        money = f"{amount:.2f}"
        if style.decimal_comma:
            money = money.replace(".", ",")
        ref = "".join(rng.choice(_REF) for _ in range(8))
        # The merchant type last, as card statements put the merchant's category code
        # after the merchant: the one word the answer depends on sits next to it.
        parts = (
            rng.choice(style.channels),
            rng.choice(BRANDS),
            rng.choice(style.cities),
            f"{money} {style.currency}",
            f"REF {ref}",
            rng.choice(members[rng.choice(found_scheme.labels)]),
        )
        found[" ".join(parts)] = None
    return list(found)


def task_records(
    region: str, n: int, seed: int, per_customer: int = _PER_CUSTOMER
) -> list[ChatRecord]:
    """``n`` chat records: a user turn asking for the category, the label as the answer,
    each naming its customer (about ``per_customer`` records each)."""
    found = scheme(region)
    rng = random.Random(f"fedciuic-bank-customers:{region}:{seed}")
    customers = max(1, n // per_customer)
    return [
        {
            MESSAGES: [
                {ROLE: USER, CONTENT: found.prompt(text)},
                {ROLE: ASSISTANT, CONTENT: found.answer(text)},
            ],
            USER_ID: f"{region}-c{rng.randrange(customers):05d}",
        }
        for text in descriptions(region, n, seed)
    ]


def write_task_corpora(
    root: Path,
    regions: Sequence[str],
    train: int,
    validation: int,
    test: int,
    seed: int,
    heldout_dir: Path | None = None,
    per_customer: int = _PER_CUSTOMER,
) -> dict[str, TaskSplits]:
    """Write each region's training records to ``root/<region>/TRAIN_FILE``, and its
    validation and test records (no description shared with training or each other)
    and its scheme to ``root/<region>/.bench/`` (or ``heldout_dir/<region>/``)."""
    out = {}
    for region in regions:
        records = task_records(region, train + validation + test, seed, per_customer)
        folder = root / region
        heldout = (heldout_dir / region) if heldout_dir is not None else folder / HELDOUT_FOLDER
        heldout.mkdir(parents=True, exist_ok=True)
        splits = TaskSplits(
            region,
            scheme(region).labels,
            records[:train],
            records[train : train + validation],
            records[train + validation :],
            folder / TRAIN_FILE,
            heldout,
        )
        write_records(splits.train_file, splits.train)
        write_records(heldout / VALIDATION_FILE, splits.validation)
        write_records(heldout / TEST_FILE, splits.test)
        found = scheme(region)
        described = {"region": region, "labels": found.labels, "category": found.category}
        (heldout / SCHEME_FILE).write_text(
            json.dumps(described, ensure_ascii=False, indent=1) + "\n", encoding="utf-8"
        )
        out[region] = splits
    return out


def write_records(path: Path, records: Iterable[ChatRecord]) -> None:
    """Write ``records`` as JSON Lines (UTF-8, one per line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    path.write_text(lines, encoding="utf-8")


def read_records(path: Path) -> list[ChatRecord]:
    """The records of a JSON Lines file written by :func:`write_records`."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def description_of(record: ChatRecord) -> str:
    """The transaction a record asks about."""
    return str(record[MESSAGES][0][CONTENT]).rpartition(_TRANSACTION)[2]


def answer_of(record: ChatRecord) -> str:
    """A record's gold label: its last (assistant) turn."""
    return str(record[MESSAGES][-1][CONTENT])


# --- Scoring -----------------------------------------------------------------------


def _split(renderer: Renderer, record: ChatRecord, label: str) -> tuple[str, str]:
    """The prompt and the trained text of ``record`` answered with ``label``, exactly as
    a region renders it for training (for a template that opens a reasoning block, the
    answer after an empty one)."""
    turns = [(str(t[ROLE]), str(t[CONTENT])) for t in record[MESSAGES][:-1]]
    rendered = renderer.render(Record(CHAT, messages=(*turns, (ASSISTANT, label))))
    row = rendered.rows[-1]
    prompt = "".join(text for text, trained in row if not trained)
    answer = "".join(text for text, trained in row if trained)
    return prompt, answer


def _ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    # As training tokenises each piece: the template writes the special tokens.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _device(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


@contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode without gradients, the model's own mode back afterwards."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def _checked(records: Sequence[ChatRecord], labels: Sequence[str]) -> None:
    if not records:
        raise ValueError("no records to score")
    unknown = {answer_of(r) for r in records} - set(labels)
    if unknown:
        raise ValueError(f"answers not among the labels: {sorted(unknown)}")


def score_exact(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[ChatRecord],
    labels: Sequence[str],
    max_new_tokens: int = 8,
) -> float:
    """Accuracy of greedy answers: the model writes after each record's prompt (and
    what the template puts before an answer, such as an empty reasoning block) up to
    its end of turn; the text, without a reasoning block and stripped, must be the
    gold label exactly. ``model`` is a transformers causal LM."""
    _checked(records, labels)
    renderer = Renderer(tokenizer)
    device = _device(model)
    stops = (tokenizer.eos_token_id, model.generation_config.eos_token_id)
    eos = [int(i) for t in stops if t is not None for i in (t if isinstance(t, list) else [t])]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or [0])[0]
    right = 0
    with _evaluating(model):
        for record in records:
            gold = answer_of(record)
            prompt, answer = _split(renderer, record, gold)
            head, _, tail = answer.partition(gold)
            ids = _ids(tokenizer, prompt) + _ids(tokenizer, head)
            inputs = torch.tensor([ids], device=device)
            written = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=eos or None,
                pad_token_id=pad,
            )
            text = str(tokenizer.decode(written[0, len(ids) :], skip_special_tokens=False))
            for end in (tail.strip(), tokenizer.eos_token):
                if end:
                    text = text.split(str(end))[0]
            text = text.rpartition(THINK_CLOSE)[2]
            right += text.strip() == gold
    return right / len(records)


def reply_ids(
    tokenizer: PreTrainedTokenizerBase, record: ChatRecord, label: str
) -> tuple[list[int], list[int]]:
    """The token ids of ``record``'s prompt and of ``label`` as its reply (with what the
    template writes around it), each tokenised as training tokenises them."""
    prompt, answer = _split(Renderer(tokenizer), record, label)
    return _ids(tokenizer, prompt), _ids(tokenizer, answer)


def answer_logprob(
    model: Any, tokenizer: PreTrainedTokenizerBase, record: ChatRecord, label: str
) -> float:
    """The total log-likelihood of ``label`` as the assistant's reply to ``record``:
    of every token trained on (the label and the end of the turn)."""
    head, tail = reply_ids(tokenizer, record, label)
    ids = torch.tensor([head + tail], device=_device(model))
    logits = model(input_ids=ids).logits[0, len(head) - 1 : -1].float()
    targets = ids[0, len(head) :]
    picked = torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])
    return float(picked.sum())


def score_ranked(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    records: Sequence[ChatRecord],
    labels: Sequence[str],
) -> float:
    """Accuracy of choosing, for each record, the label whose reply the model finds most
    likely (:func:`answer_logprob`; a tie goes to the first in ``labels``)."""
    _checked(records, labels)
    right = 0
    with _evaluating(model):
        for record in records:
            scores = [answer_logprob(model, tokenizer, record, label) for label in labels]
            best = labels[max(range(len(labels)), key=scores.__getitem__)]
            right += best == answer_of(record)
    return right / len(records)
