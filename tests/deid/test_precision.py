"""Identifier-shaped numbers in ordinary text are kept: references, DOIs, versions,
decimals and constants, dates and times, amounts, ranges, hashes and code come back
unchanged through the real pipeline, while identifiers as people write them (in Latin or
Chinese text) are still found."""

# Chinese text is punctuated with full-width commas and colons (，：) on purpose.
# ruff: noqa: RUF001, RUF003

from __future__ import annotations

import doctest

import pytest

from fedciuic.deid import DeidSpec, Scrubber
from fedciuic.deid import recognizers as recognizers_module
from fedciuic.deid.entities import DIRECT

#: Clean text by kind: each comes back unchanged.
CLEAN = {
    "references": [
        "invoice INV-2019-004512 is due on Friday",
        "Invoice 2024-000123 and invoice no. 2024-000124",
        "PO 4500012345 was approved",
        "Order #123-4567890 shipped; Order no. 123-4567890-1234567 too",
        "Ref: 2023/0456789, ticket #4567890, Case No. 2019-CV-01234",
        "SKU ABC-123-456-7890 and part P/N 12-3456-7890",
        "EAN 5716241543590 on the box",
        "Rechnungsnummer 2024-000123, Bestellnummer: 4711-0815123",
        "订单号2019-004512已发货，发票INV-2019-004512",
    ],
    "bibliography": [
        "DOI 10.1234/5678901",
        "see doi:10.1000/182 and https://doi.org/10.1038/nphys1170",
        "ISBN 0-306-40615-2, ISBN 978-0-306-40615-7, ISSN 0317-8471",
        "arXiv:2103.00020 and arXiv:1706.03762v7, PMID 31452104",
    ],
    "versions": [
        "version v2.13.0 and v1.2.3.4, build 10.0.22631.3296",
        "python 3.11.4, numpy==1.26.4, node v20.11.1, 2.13.0-rc.1+build.20240315",
        "Mozilla/5.0 (X11; Linux i686; rv:1.9.5.20) Gecko/20100101 Firefox/3.6.5",
        'Chrome 114.0.6914.14, [assembly: AssemblyVersion("16.36.7.0")], "^0.16.164"',
        "Windows 10.0.19041.1415 and kernel 5.15.0-1034-azure",
    ],
    "maths": [
        "e ~ 2.718281828459045",
        "pi is 3.14159265358979 and sqrt(2) = 1.4142135623730951",
        "2**40 = 1099511627776 and 2**53 - 1 = 9007199254740991",
        "N_A = 6.02214076e23 mol^-1, h = 6.62607015e-34, c = 299792458 m/s",
        "c = 299 792 458 m/s",
        "127687402 * 47449719 = 6058731344740038",  # a Luhn-valid Maestro number's shape
        "ln 2 = 0.6931471805599453, gamma = 0.5772156649015329",
        "圆周率约为3.14159265358979，自然常数2.718281828459045",
        "[[0.12345678, 0.98765432], [1.11111111, 2.22222222]]",
    ],
    "dates": [
        "on 2024-03-15 at 2024-03-15T10:20:30Z",
        "[2024-03-15 10:20:30,123] INFO pid=12345 tid=140234567890",
        "2024-03-15 10:20:30.123456+01:00, 15.03.2024, 03/15/2024, 2024/03/15",
        "timestamp 1710498030 and 1710498030123 ms",
    ],
    "amounts": [
        "costs $1,234,567.89 or 1.234.567,89 €",
        "97.762.581,65 € and 1 234 567 890 € and ¥123,456,789",
        "USD 12,345,678.90 and 12 345 678 kr",
    ],
    "ranges": [
        "from 1990-2020, pages 123-4567, 1234-5678, 100000-200000",
        "pp. 312-4567 and 1 : 1000000",
    ],
    "hashes": [
        "sha 3f786850e387550fdab836ed7e6dc881de23001b and 0x7fffffffffffffff",
        "commit 52da5c7 and uuid 123e4567-e89b-12d3-a456-426614174000",
        "md5 d41d8cd98f00b204e9800998ecf8427e and 0x1234567890abcdef",
    ],
    "tracking": [
        "FedEx 612305569545 and DHL 1234567890, UPS 1Z999AA10123456784",
        "顺丰 SF1234567890123，快递单号 4111111111111111",
    ],
    "code": [
        "std::vector<int> v; a::b; Foo::Bar::baz(); x = y ? 1 : 2;",
        "arr[::2] and x = np.zeros((1024, 1024, 3))",
        "if (n > 2147483647) return -1; assert f(12345678) == 87654321",
        "for i in range(1000000): total += i * 1099511627776",
    ],
}
CLEAN_CASES = [(kind, text) for kind, texts in CLEAN.items() for text in texts]

#: Identifiers as people write them, and what each becomes.
FOUND = [
    ("call +49 30 12345678 today", "call <PHONE> today"),
    ("call (212) 555-0123 today", "call <PHONE> today"),
    ("call 030 12345678 today", "call <PHONE> today"),
    ("call +33 1 23 45 67 89 today", "call <PHONE> today"),
    ("call 06 12 34 56 78 today", "call <PHONE> today"),
    ("call +39 02 1234 5678 today", "call <PHONE> today"),
    ("call 91 123 45 67 today", "call <PHONE> today"),
    ("call 612 345 678 today", "call <PHONE> today"),
    ("call 212-555-0123 x45 today", "call <PHONE> today"),
    ("Tel.: 030/1234567, fax", "Tel.: <PHONE>, fax"),
    ("电话13812345678，谢谢", "电话<PHONE>，谢谢"),
    ("手机：138 1234 5678", "手机：<PHONE>"),
    ("server 192.168.1.10:8080 and 192.168.1.0/24", "server <IP>:8080 and <IP>"),
    ("from 2001:db8::8a2e:370:7334 today", "from <IP> today"),
    ("PESEL: 44051401359", "PESEL: <PL_PESEL>"),
    ("SSN 536-22-8745.", "SSN <SSN>."),
    # Chinese text runs into identifiers without a space
    ("客户536-22-8745的", "客户<SSN>的"),
    ("邮箱jane.roe@example.org联系", "邮箱<EMAIL>联系"),
    ("证件号12345678Z已登记", "证件号<ES_NIF>已登记"),
    ("服务器192.168.1.10宕机", "服务器<IP>宕机"),
    ("卡号4111111111111111已冻结", "卡号<CARD>已冻结"),
]


@pytest.fixture(scope="module")
def scrubber() -> Scrubber:
    return Scrubber(DeidSpec(DIRECT, "placeholder", bytes(32)))


@pytest.mark.parametrize(("kind", "text"), CLEAN_CASES, ids=[k for k, _ in CLEAN_CASES])
def test_clean_text_comes_back_unchanged(scrubber, kind, text):
    assert scrubber.scrub(text) == text
    assert scrubber.scrub(f"{text}\n") == f"{text}\n"


@pytest.mark.parametrize(("text", "scrubbed"), FOUND)
def test_identifiers_as_people_write_them_are_still_found(scrubber, text, scrubbed):
    assert scrubber.scrub(text) == scrubbed


@pytest.mark.parametrize(
    ("text", "start", "end", "inside"),
    [
        ("e ~ 2.718281828459045", 7, 18, True),  # a decimal's digits
        ("INV-2019-004512", 4, 15, True),  # a code's
        ("DOI 10.1234/5678901", 7, 19, True),  # a DOI's
        ("at 10:20:30", 3, 8, True),  # a time's
        ("call 030 12345678.", 5, 17, False),  # the sentence's full stop
        ("卡号4111111111111111已冻结", 2, 18, False),  # Chinese around it
        ("(4111-1111-1111-1111)", 1, 20, False),
    ],
)
def test_a_finding_inside_a_longer_token_is_inside_it(text, start, end, inside):
    assert recognizers_module.inside_token(text, start, end) is inside


def test_the_modules_examples_hold():
    assert doctest.testmod(recognizers_module).failed == 0
