"""Payment card numbers by network: each network's IIN ranges and lengths, the Luhn check,
and where card numbers sit in a text. No Presidio, so that tests and benchmarks make valid
numbers from the recognizer's own table. A number is found whole, grouped as printed or
not, word boundary or not (``卡号6222021234567890123``), never inside a longer run of digits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Network:
    """A card network: its numbers' leading digits (inclusive ranges) and lengths."""

    name: str
    prefixes: tuple[tuple[int, int], ...]
    lengths: tuple[int, ...]
    #: Every number ends in a Luhn check digit (UnionPay's do not all).
    luhn: bool = True

    def issues(self, digits: str) -> bool:
        return len(digits) in self.lengths and any(
            low <= int(digits[: len(str(low))]) <= high for low, high in self.prefixes
        )


_ANY = tuple(range(12, 20))

#: Current IIN ranges and lengths (ISO/IEC 7812; the networks' published tables), the
#: narrow ones first: a number is named by the first network that issues it.
NETWORKS: tuple[Network, ...] = (
    Network("Visa", ((4, 4),), _ANY[1:]),
    Network("Mastercard", ((51, 55), (2221, 2720)), (16,)),
    Network("Mir", ((2200, 2204),), _ANY[4:]),
    Network("American Express", ((34, 34), (37, 37)), (15,)),
    Network("JCB", ((3528, 3589),), _ANY[4:]),
    Network("JCB", ((2131, 2131), (1800, 1800)), (15,)),
    Network("Diners Club", ((300, 305), (3095, 3095), (36, 36), (38, 39)), _ANY[2:]),
    Network("UnionPay", ((62, 62),), _ANY[4:], luhn=False),
    Network("Discover", ((6011, 6011), (644, 649), (65, 65), (622126, 622925)), _ANY[4:]),
    Network("Maestro", ((50, 50), (56, 69)), _ANY),
)

#: Words before a number that name it a card (a UnionPay number without a Luhn digit is
#: a card only so named, or printed in a card's 4-4-4-4 grouping).
_CARD_WORDS = re.compile(
    r"(?i)(?:card|karte|carte|tarjeta|carta|cart[aã]o|unionpay|银联|卡|[账帐]号)[^\n\d]{0,12}$"
)
#: Runs of digits joined by single spaces or hyphens (\d: full-width digits too).
_RUN = re.compile(r"\d+(?:[ \-]\d+)*")
_GROUP = re.compile(r"\d+")
#: Separators that join a number to a digit beside it (a decimal, a DOI, a date).
_JOINERS = "./"


def luhn_valid(digits: str) -> bool:
    """Whether ``digits`` ends in its Luhn check digit.

    >>> luhn_valid("4111111111111111"), luhn_valid("4111111111111112")
    (True, False)
    """
    return _luhn_sum(digits) % 10 == 0


def luhn_digit(payload: str) -> str:
    """The check digit that makes ``payload + digit`` Luhn-valid.

    >>> luhn_digit("411111111111111")
    '1'
    """
    return str((10 - _luhn_sum(payload + "0") % 10) % 10)


def _luhn_sum(digits: str) -> int:
    return sum(
        (2 * int(c) - 9 if int(c) > 4 else 2 * int(c)) if i % 2 else int(c)
        for i, c in enumerate(reversed(digits))
    )


def network_of(digits: str, *, luhn_waived: bool = False) -> str | None:
    """The network that issues ``digits`` (12 to 19 of them), or ``None``; Luhn may fail
    only where the network waives it and so does ``luhn_waived`` (named or printed a card).

    >>> network_of("2221000000000009"), network_of("6222021234567890123")
    ('Mastercard', None)
    """
    checked = luhn_valid(digits)
    for network in NETWORKS:
        if network.issues(digits) and (checked or (luhn_waived and not network.luhn)):
            return network.name
    return None


def _printed_shape(widths: list[int]) -> bool:
    """Whether group widths are a card's: one, 4s with a shorter last, or 4-6-5 / 4-6-4."""
    return (
        len(widths) == 1
        or widths in ([4, 6, 5], [4, 6, 4])
        or (len(widths) >= 3 and set(widths[:-1]) == {4} and 1 <= widths[-1] <= 4)
    )


@dataclass(frozen=True)
class Card:
    """A card number found in a text: ``text[start:end]``."""

    start: int
    end: int
    network: str


def find_cards(text: str) -> list[Card]:
    """Every card number in ``text`` (see the module's docstring for what counts).

    >>> [c.network for c in find_cards("信用卡4111111111111111, 5555-5555-5555-4444")]
    ['Visa', 'Mastercard']
    >>> find_cards("order 4111111111111111111111, pi 3.4111111111111111")
    []
    """
    found: list[Card] = []
    for run in _RUN.finditer(text):
        groups = [(run.start() + g.start(), run.start() + g.end()) for g in _GROUP.finditer(run[0])]
        seps = [text[a_end] for (_, a_end) in groups[:-1]]
        found += _cards_in_run(text, groups, seps)
    return _longest_apart(found)


def _cards_in_run(text: str, groups: list[tuple[int, int]], seps: list[str]) -> list[Card]:
    """The card numbers among the consecutive groups of one run of digits."""
    cards: list[Card] = []
    for i in range(len(groups)):
        widths: list[int] = []
        for j in range(i, len(groups)):
            widths.append(groups[j][1] - groups[j][0])
            if sum(widths) > 19:
                break
            inner = set(seps[i:j])
            if len(inner) > 1 or sum(widths) < 12 or not _printed_shape(widths):
                continue
            sep = next(iter(inner), None)
            if not _whole(text, groups, seps, i, j, sep):
                continue
            start, end = groups[i][0], groups[j][1]
            digits = "".join(text[a:b] for a, b in groups[i : j + 1])
            waived = (sep is not None and widths[0] == 4 and len(widths) >= 4) or bool(
                _CARD_WORDS.search(text, max(0, start - 24), start)
            )
            if (name := network_of(digits, luhn_waived=waived)) is not None:
                cards.append(Card(start, end, name))
    return cards


def _whole(
    text: str, groups: list[tuple[int, int]], seps: list[str], i: int, j: int, sep: str | None
) -> bool:
    """Whether groups ``i..j`` (joined by ``sep``) stand alone (a trailing expiry date is apart)."""
    if i > 0 and seps[i - 1] in ("-", sep):
        return False
    if j < len(groups) - 1 and (
        seps[j] == "-" or (seps[j] == sep and not _expiry_at(text, groups[j + 1][1]))
    ):
        return False
    start, end = groups[i][0], groups[j][1]
    if i == 0 and start >= 2 and text[start - 1] in _JOINERS and text[start - 2].isdecimal():
        return False
    after = text[end : end + 2]
    return not (
        j == len(groups) - 1 and len(after) == 2 and after[0] in _JOINERS and after[1].isdecimal()
    )


def _expiry_at(text: str, end: int) -> bool:
    """Whether the group ending at ``end`` is an expiry's month (``12/26``)."""
    return text[end : end + 1] == "/" and text[end + 1 : end + 2].isdecimal()


def _longest_apart(cards: list[Card]) -> list[Card]:
    """The longest of overlapping findings, in text order."""
    kept: list[Card] = []
    for card in sorted(cards, key=lambda c: (c.start - c.end, c.start)):
        if all(card.end <= k.start or card.start >= k.end for k in kept):
            kept.append(card)
    return sorted(kept, key=lambda c: c.start)
