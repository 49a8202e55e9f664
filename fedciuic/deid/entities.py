"""The identifiers a region can scrub, named once: the entity types policies and run
configs list, and the placeholder each is replaced by.

Patterns check digits where a format has them, so an order number that merely looks like
an ID is kept; names are found by the region's dictionary, a NER model, or their context.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The one language recognizers are built for (the patterns do not depend on it).
LANGUAGE = "en"
#: Bumped whenever fedciuic's recognizers change what they find (in the pipeline's identity).
RECOGNIZERS_VERSION = 2

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
#: A name found offline by its context (``fedciuic/deid/names.py``).
CONTEXT_NAME = "CONTEXT_NAME"
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
    CONTEXT_NAME: "NAME",
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
#: Direct identifiers found by patterns alone: what ``direct`` means in configs and policies.
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
)
#: Person names: what ``names`` means (a region scrubs those it can, :func:`found_entities`).
NAMES: tuple[str, ...] = (DICTIONARY, PERSON, CONTEXT_NAME)
#: What meets a policy's ``names``: a dictionary of the region's names, or a NER model
#: (the context recognizers alone miss most names, docs/deidentification.md).
NAME_SOURCES = (DICTIONARY, PERSON)
#: Types only a named NER model finds.
NER_ONLY = (PERSON, LOCATION)
#: The word a run config or policy uses for :data:`DIRECT`, and for :data:`NAMES`.
DIRECT_WORD = "direct"
NAMES_WORD = "names"
#: The class words, each standing for its types.
CLASSES: dict[str, tuple[str, ...]] = {DIRECT_WORD: DIRECT, NAMES_WORD: NAMES}
#: What the types whose names do not say it are, as reports show them.
LABELS: dict[str, str] = {
    DICTIONARY: "names, dictionary",
    CONTEXT_NAME: "names, by context",
    PERSON: "names, NER",
    LOCATION: "places, NER",
}


def entity_label(entity: str) -> str:
    """An entity type as a report shows it: ``DICTIONARY (names, dictionary)``."""
    return f"{entity} ({LABELS[entity]})" if entity in LABELS else entity


def listed_entities(value: str | Iterable[str]) -> tuple[str, ...]:
    """``"direct,names"`` (or a list) as the entity type names listed, each checked."""
    parts = value.split(",") if isinstance(value, str) else value
    names = tuple(name for name in (part.strip() for part in parts) if name)
    parse_entities(names)
    if not names:
        raise ValueError(f'no entity type; name some, or "{DIRECT_WORD},{NAMES_WORD}"')
    return names


def parse_entities(values: Iterable[str]) -> tuple[str, ...]:
    """Entity types as listed (class words expanded), in their canonical order."""
    wanted: set[str] = set()
    for value in values:
        if not (name := value.strip()):
            continue
        if name in CLASSES:
            wanted.update(CLASSES[name])
        elif name in PLACEHOLDERS:
            wanted.add(name)
        else:
            raise ValueError(
                f"unknown entity type {name[:40]!r}; known: {', '.join(CLASSES)}, "
                f"{', '.join(ENTITIES)}"
            )
    return tuple(e for e in ENTITIES if e in wanted)


def found_entities(
    entities: tuple[str, ...], *, dictionary: bool, ner_model: bool
) -> tuple[str, ...]:
    """What a region scrubs of ``entities`` (and declares): the types it can find.

    >>> found_entities(parse_entities(["names"]), dictionary=False, ner_model=False)
    ('CONTEXT_NAME',)
    """
    cannot = (() if dictionary else (DICTIONARY,)) + (() if ner_model else NER_ONLY)
    return tuple(e for e in entities if e not in cannot)


def requirement_reasons(listed: tuple[str, ...], scrubbed: tuple[str, ...]) -> list[str]:
    """Why ``scrubbed`` does not meet a policy's ``deidentification.entities``; ``names``
    needs one of :data:`NAME_SOURCES` (the context recognizers alone miss most names)."""
    required = parse_entities(name for name in listed if name != NAMES_WORD)
    reasons = []
    if missing := [e for e in required if e not in scrubbed]:
        reasons.append(
            f"de-identification does not scrub {', '.join(missing)} (deidentification.entities)"
        )
    if NAMES_WORD in listed and not set(NAME_SOURCES) & set(scrubbed):
        reasons.append(
            f"names are required (deidentification.entities: {NAMES_WORD}) but this region "
            + (
                "has neither a name dictionary nor a NER model: set"
                if CONTEXT_NAME in scrubbed
                else f"does not scrub them: list {NAMES_WORD} in the run's deid-entities, and set"
            )
            + " deid-dictionary or deid-ner-model in its agent config"
        )
    return reasons
