"""Synthetic identifiers in the demo corpora, so that a demo's de-identification has
something to find: generated values (valid check digits, fictional ranges), no one's."""

from __future__ import annotations

import random
from typing import Any

from fedciuic.config import SIMULATED_DICTIONARIES
from fedciuic.data.records import CONTENT, ROLE, USER
from fedciuic.deid import cn_check_character

#: Where, under the demo root, each region's dictionary of names is: ``REGION.txt``.
DEMO_DICTIONARIES = SIMULATED_DICTIONARIES
#: The share of a region's users who sign a question.
SIGNING_SHARE = 0.1
_FIRST = ("Mei", "Jonas", "Amara", "Luca", "Sofia", "Wei", "Priya", "Tomas", "Hana", "Omar")
_LAST = ("Lindqvist", "Okafor", "Brennan", "Castellano", "Zhou", "Varga", "Moreau", "Tanaka")


def _phone(rng: random.Random, region: str) -> str:
    if region == "cn":
        return f"+86 13{rng.randint(0, 9)} {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}"
    if region == "us":
        return f"+1 212-555-{rng.randint(100, 199):04d}"  # 555-0100..0199: fictional
    return f"+49 30 {rng.randint(1000000, 9999999)}"


def _national_id(rng: random.Random, region: str) -> str:
    if region == "cn":
        body = f"110105{rng.randint(1950, 2005)}{rng.randint(1, 12):02d}{rng.randint(1, 28):02d}"
        body += f"{rng.randint(0, 999):03d}"
        return f"my resident ID is {body}{cn_check_character(body)}"
    if region == "us":
        return f"my SSN is {rng.randint(100, 665)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}"
    bban = "".join(str(rng.randint(0, 9)) for _ in range(18))
    digits = int(bban + "131400")  # D=13, E=14, then 00
    return f"my IBAN is DE{98 - digits % 97:02d}{bban}"


def sign_questions(region: str, chats: list[dict[str, Any]], user_field: str) -> list[str]:
    """Sign a chat of about :data:`SIGNING_SHARE` of the users (in place); the names used."""
    rng = random.Random(f"fedciuic-demo-identifiers:{region}")
    first_chat: dict[str, dict[str, Any]] = {}
    for record in chats:
        first_chat.setdefault(str(record[user_field]), record)
    names = []
    for user in sorted(first_chat):
        if rng.random() >= SIGNING_SHARE:
            continue
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        email = f"{name.lower().replace(' ', '.')}@example.org"
        signature = f"I am {name} ({email}, {_phone(rng, region)}); {_national_id(rng, region)}. "
        turn = next(t for t in first_chat[user]["messages"] if t[ROLE] == USER)
        turn[CONTENT] = signature + turn[CONTENT]
        names.append(name)
    return sorted(set(names))
