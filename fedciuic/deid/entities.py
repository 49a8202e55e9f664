"""The identifiers a region can scrub, named once: the entity types policies and run
configs list, and the placeholder each is replaced by.

Every type here is found by a pattern with a check where its format has one (Luhn for
cards, ISO 7064 for IBANs, GB 11643's check digit for mainland China resident IDs, the
national check digits of the EU identity numbers), so that an order number or a
reference that merely looks like one is kept. ``PERSON`` and ``LOCATION`` need a named
NER model (``deid-ner-model``); the region's dictionary finds the names it lists.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The one language recognizers are built for and texts analysed in (the patterns do not
#: depend on it).
LANGUAGE = "en"
#: Bumped whenever a recognizer of fedciuic's changes what it finds: it is part of the
#: pipeline's identity (the tokenisation cache's key and the audit record).
RECOGNIZERS_VERSION = 1

EMAIL_ADDRESS = "EMAIL_ADDRESS"
PHONE_NUMBER = "PHONE_NUMBER"
CN_RESIDENT_ID = "CN_RESIDENT_ID"
US_SSN = "US_SSN"
CREDIT_CARD = "CREDIT_CARD"
IBAN_CODE = "IBAN_CODE"
IP_ADDRESS = "IP_ADDRESS"
#: A URL whose path or query names a person (``/users/jane``, ``/~jane``, ``?email=``).
URL = "URL"
ES_NIF = "ES_NIF"
ES_NIE = "ES_NIE"
IT_FISCAL_CODE = "IT_FISCAL_CODE"
PL_PESEL = "PL_PESEL"
FI_PERSONAL_IDENTITY_CODE = "FI_PERSONAL_IDENTITY_CODE"
SE_PERSONNUMMER = "SE_PERSONNUMMER"
#: An entry of the region's own dictionary (its customers', account holders' names).
DICTIONARY = "DICTIONARY"
#: Found only by a named NER model.
PERSON = "PERSON"
LOCATION = "LOCATION"

#: What each type is replaced by (typed placeholders), and the stem of its pseudonyms.
PLACEHOLDERS: dict[str, str] = {
    EMAIL_ADDRESS: "EMAIL",
    PHONE_NUMBER: "PHONE",
    CN_RESIDENT_ID: "CN_ID",
    US_SSN: "SSN",
    CREDIT_CARD: "CARD",
    IBAN_CODE: "IBAN",
    IP_ADDRESS: "IP",
    URL: "URL",
    ES_NIF: "ES_NIF",
    ES_NIE: "ES_NIE",
    IT_FISCAL_CODE: "IT_FISCAL_CODE",
    PL_PESEL: "PL_PESEL",
    FI_PERSONAL_IDENTITY_CODE: "FI_ID",
    SE_PERSONNUMMER: "SE_ID",
    DICTIONARY: "NAME",
    PERSON: "PERSON",
    LOCATION: "LOCATION",
}
ENTITIES: tuple[str, ...] = tuple(PLACEHOLDERS)
#: The EU national identity numbers whose check digits fedciuic validates.
EU_NATIONAL_IDS = (
    ES_NIF,
    ES_NIE,
    IT_FISCAL_CODE,
    PL_PESEL,
    FI_PERSONAL_IDENTITY_CODE,
    SE_PERSONNUMMER,
)
#: Direct identifiers found by patterns alone: what ``deid-entities = "direct"`` means,
#: and what the shipped PIPL and GDPR policies require.
DIRECT: tuple[str, ...] = (
    EMAIL_ADDRESS,
    PHONE_NUMBER,
    CN_RESIDENT_ID,
    US_SSN,
    CREDIT_CARD,
    IBAN_CODE,
    IP_ADDRESS,
    URL,
    *EU_NATIONAL_IDS,
    DICTIONARY,
)
#: Types only a named NER model finds.
NER_ONLY = (PERSON, LOCATION)
#: The word a run config or policy uses for :data:`DIRECT`.
DIRECT_WORD = "direct"


def listed_entities(value: str | Iterable[str]) -> tuple[str, ...]:
    """``"direct,PERSON"`` (or a list) as the entity type names listed, each checked
    (``ValueError`` names an unknown one, or says none is listed)."""
    parts = value.split(",") if isinstance(value, str) else value
    names = tuple(name for name in (part.strip() for part in parts) if name)
    parse_entities(names)
    if not names:
        raise ValueError(f'no entity type; name some, or "{DIRECT_WORD}"')
    return names


def parse_entities(values: Iterable[str]) -> tuple[str, ...]:
    """Entity types as listed (``direct`` standing for :data:`DIRECT`), in their canonical
    order; an unknown name raises ``ValueError`` naming the known ones."""
    wanted: set[str] = set()
    for value in values:
        name = value.strip()
        if not name:
            continue
        if name == DIRECT_WORD:
            wanted.update(DIRECT)
        elif name in PLACEHOLDERS:
            wanted.add(name)
        else:
            raise ValueError(
                f"unknown entity type {name[:40]!r}; known: {DIRECT_WORD}, {', '.join(ENTITIES)}"
            )
    return tuple(e for e in ENTITIES if e in wanted)
