"""Card numbers by network: every current IIN range and length, Luhn where the network
uses it, found in Latin and Chinese text (no word boundary), grouped as printed or not;
a number failing Luhn, or part of a longer run of digits, is kept."""

from __future__ import annotations

import doctest
import random

import pytest

from fedciuic.deid import DeidSpec, Scrubber, cards
from fedciuic.deid.cards import NETWORKS, find_cards, luhn_digit, luhn_valid, network_of
from fedciuic.deid.entities import DIRECT

#: (network, prefix, length): both ends of every range, every length class.
CASES = [
    ("Visa", "4", 13),
    ("Visa", "4", 16),
    ("Visa", "49", 19),
    ("Mastercard", "51", 16),
    ("Mastercard", "55", 16),
    ("Mastercard", "2221", 16),
    ("Mastercard", "2720", 16),
    ("American Express", "34", 15),
    ("American Express", "37", 15),
    ("Discover", "6011", 16),
    ("Discover", "644", 16),
    ("Discover", "649", 19),
    ("Discover", "65", 16),
    ("UnionPay", "622126", 17),  # 622126-622925: UnionPay's, which Discover accepts
    ("UnionPay", "622925", 19),
    ("JCB", "3528", 16),
    ("JCB", "3589", 19),
    ("JCB", "2131", 15),
    ("JCB", "1800", 15),
    ("Maestro", "5018", 12),
    ("Maestro", "5020", 13),
    ("Maestro", "5038", 16),
    ("Maestro", "5893", 19),
    ("Maestro", "6304", 16),
    ("Maestro", "6759", 18),
    ("Maestro", "6761", 12),
    ("Maestro", "6763", 19),
    ("UnionPay", "62", 16),
    ("UnionPay", "6222", 19),
    ("UnionPay", "6228", 18),
    ("Diners Club", "300", 14),
    ("Diners Club", "305", 14),
    ("Diners Club", "36", 14),
    ("Diners Club", "38", 16),
    ("Diners Club", "39", 19),
    ("Mir", "2200", 16),
    ("Mir", "2204", 16),
]
IDS = [f"{name}-{prefix}-{length}" for name, prefix, length in CASES]


def card(prefix: str, length: int, *, seed: int = 0) -> str:
    """A Luhn-valid number of ``length`` digits starting with ``prefix``."""
    rng = random.Random(f"{prefix}/{length}/{seed}")
    payload = prefix + "".join(rng.choice("0123456789") for _ in range(length - len(prefix) - 1))
    return payload + luhn_digit(payload)


def grouped(digits: str, sep: str) -> str:
    """``digits`` as printed on a card: 4-6-5 or 4-6-4 for 15 and 14 digits, else in fours."""
    if len(digits) in (14, 15):
        widths = [4, 6, len(digits) - 10]
    else:
        widths = [4] * (len(digits) // 4) + ([len(digits) % 4] if len(digits) % 4 else [])
    parts, at = [], 0
    for width in widths:
        parts.append(digits[at : at + width])
        at += width
    return sep.join(parts)


def bad_luhn(digits: str) -> str:
    return digits[:-1] + str((int(digits[-1]) + 1) % 10)


@pytest.fixture(scope="module")
def scrubber() -> Scrubber:
    return Scrubber(DeidSpec(DIRECT, "placeholder", bytes(32)))


def test_the_table_names_every_network_the_issue_lists():
    names = {network.name for network in NETWORKS}
    assert names == {name for name, _, _ in CASES}


@pytest.mark.parametrize(("name", "prefix", "length"), CASES, ids=IDS)
def test_each_network_is_named_by_its_prefix_and_length(name, prefix, length):
    digits = card(prefix, length)
    assert luhn_valid(digits)
    assert network_of(digits) == name


@pytest.mark.parametrize("sep", ["", " ", "-"], ids=["ungrouped", "spaces", "hyphens"])
@pytest.mark.parametrize(("name", "prefix", "length"), CASES, ids=IDS)
def test_each_network_is_found_in_latin_and_chinese_text(scrubber, name, prefix, length, sep):
    number = grouped(card(prefix, length), sep) if sep else card(prefix, length)
    assert [(c.network, c.end - c.start) for c in find_cards(f"x {number} y")] == [
        (name, len(number))
    ]
    assert scrubber.scrub(f"Please charge {number} today.") == "Please charge <CARD> today."
    assert scrubber.scrub(f"卡号{number}已冻结") == "卡号<CARD>已冻结"
    assert scrubber.scrub(f"信用卡{number}") == "信用卡<CARD>"
    assert scrubber.scrub(f"カード番号{number}です") == "カード番号<CARD>です"


@pytest.mark.parametrize(
    ("text", "scrubbed"),
    [
        ("信用卡4111111111111111", "信用卡<CARD>"),
        # UnionPay without a Luhn digit, named a card
        ("卡号6222021234567890123已冻结", "卡号<CARD>已冻结"),
        ("Card: 4111111111111111 12/26, CVV 123", "Card: <CARD> 12/26, CVV 123"),
        ("4111 1111 1111 1111 12/26", "<CARD> 12/26"),  # an expiry date after it
        ("cards 4111111111111111,5555555555554444", "cards <CARD>,<CARD>"),  # a list
        ("(4111-1111-1111-1111)", "(<CARD>)"),
        ("Amex 3782 822463 10005.", "Amex <CARD>."),
    ],
)
def test_cards_as_people_write_them_are_found(scrubber, text, scrubbed):
    assert scrubber.scrub(text) == scrubbed


@pytest.mark.parametrize(("name", "prefix", "length"), CASES, ids=IDS)
def test_a_number_failing_luhn_is_kept(scrubber, name, prefix, length):
    digits = bad_luhn(card(prefix, length))
    if name == "UnionPay":  # its debit cards need not carry a Luhn digit: see below
        digits = "99" + digits[2:]
    assert find_cards(f"order {digits} shipped") == []
    assert "<CARD>" not in scrubber.scrub(f"order {digits} shipped")
    assert "<CARD>" not in scrubber.scrub(f"订单{digits}已发货")


def test_unionpay_without_luhn_is_a_card_only_when_printed_or_named_as_one():
    digits = bad_luhn(card("6222", 19))
    assert find_cards(f"ref {digits}") == []  # bare and unnamed: a reference
    assert [c.network for c in find_cards(f"ref {grouped(digits, ' ')}")] == ["UnionPay"]
    assert [c.network for c in find_cards(f"银行卡{digits}")] == ["UnionPay"]
    assert [c.network for c in find_cards(f"UnionPay card: {digits}")] == ["UnionPay"]


@pytest.mark.parametrize(("name", "prefix", "length"), CASES, ids=IDS)
def test_a_card_inside_a_longer_run_of_digits_is_kept(scrubber, name, prefix, length):
    digits = card(prefix, length)
    longer = [
        f"{digits}0123456789",  # more digits after
        f"0123456789{digits}",  # and before
        f"3.{digits}",  # a decimal's digits
        f"{digits}.25",
        f"10.1234/{digits}",  # a DOI
        f"12-{digits}",  # a code joined by a hyphen
        f"{digits}-7",
        f"1234 5678 {grouped(digits, ' ')}",  # more groups
        f"{grouped(digits, '-')}-1234-5678",
        f"INV{digits}",  # letters joined to it (a code)
    ]
    for text in longer:
        assert "<CARD>" not in scrubber.scrub(f"see {text} here"), text


def test_the_modules_examples_hold():
    assert doctest.testmod(cards).failed == 0


def test_presidios_recognizer_is_not_registered(scrubber):
    analyzer = scrubber._engines[0]
    names = {r.name for r in analyzer.registry.recognizers}
    assert "CreditCardRecognizer" not in names
    assert "CardRecognizer" in names
