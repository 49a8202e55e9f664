"""Check digits of the identifier formats fedciuic validates itself: light (no Presidio),
so that the demo data and the benchmarks make valid synthetic identifiers with them."""

from __future__ import annotations

import datetime

#: GB 11643-1999's ISO 7064 MOD 11-2 weights of a mainland China resident ID's 17 digits,
#: and the check character of each remainder.
_CN_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_CN_CHECK = "10X98765432"


def cn_check_character(digits: str) -> str:
    """The check character of a resident ID's first 17 digits."""
    return _CN_CHECK[sum(int(d) * w for d, w in zip(digits, _CN_WEIGHTS, strict=True)) % 11]


def cn_resident_id_valid(text: str) -> bool:
    """Whether ``text`` is a resident ID: 18 characters, a real birth date, its check character."""
    value = text.upper()
    if len(value) != 18 or not value[:17].isdigit():
        return False
    try:
        born = datetime.date(int(value[6:10]), int(value[10:12]), int(value[12:14]))
    except ValueError:
        return False
    if born.year < 1900 or born > datetime.date.today():
        return False
    return cn_check_character(value[:17]) == value[17]
