"""Presidio recognizers for every entity type fedciuic scrubs, all offline.

Presidio's own pattern recognizers are used where they validate what they find (cards,
IBANs, SSNs, IPs, e-mail, phone numbers through ``phonenumbers``, the Spanish, Italian,
Polish, Finnish and Swedish identity numbers); fedciuic adds what Presidio lacks: the
mainland China resident ID with its GB 11643-1999 check digit, mainland China mobile
numbers written without a country code, URLs whose path names a person (Presidio's URL
recognizer flags every dotted word, ``os.path`` included), and the region's dictionary.
Every recognizer is built for one analysis language: the patterns do not depend on it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import tldextract
from presidio_analyzer import EntityRecognizer, Pattern, PatternRecognizer, RecognizerResult
from presidio_analyzer.nlp_engine import NlpArtifacts
from presidio_analyzer.predefined_recognizers import (
    CreditCardRecognizer,
    EmailRecognizer,
    EsNieRecognizer,
    EsNifRecognizer,
    FiPersonalIdentityCodeRecognizer,
    IbanRecognizer,
    IpRecognizer,
    ItFiscalCodeRecognizer,
    PhoneRecognizer,
    PlPeselRecognizer,
    SePersonnummerRecognizer,
    UsSsnRecognizer,
)

from fedciuic.deid.checks import cn_resident_id_valid
from fedciuic.deid.entities import (
    CN_RESIDENT_ID,
    CREDIT_CARD,
    DICTIONARY,
    EMAIL_ADDRESS,
    ES_NIE,
    ES_NIF,
    FI_PERSONAL_IDENTITY_CODE,
    IBAN_CODE,
    IP_ADDRESS,
    IT_FISCAL_CODE,
    LANGUAGE,
    PHONE_NUMBER,
    PL_PESEL,
    SE_PERSONNUMMER,
    URL,
    US_SSN,
)

#: Regions whose numbering plans the phone recognizer tries (international numbers with
#: a + are found whatever the region).
PHONE_REGIONS = ("US", "GB", "DE", "FR", "IT", "ES", "NL", "PL", "SE", "FI", "CN", "SG", "IN")

#: A run that may be a phone number: 7 or more digits, with the separators people write.
_PHONE_RUN = re.compile(r"[+(]?\d[\d \t().\-/]{5,}\d")
#: Characters either side of a run given to ``phonenumbers`` with it.
_PHONE_MARGIN = 2


class CnResidentIdRecognizer(PatternRecognizer):
    """Mainland China resident identity card numbers (18 characters, checked)."""

    def __init__(self) -> None:
        super().__init__(
            supported_entity=CN_RESIDENT_ID,
            patterns=[
                Pattern("cn resident id", r"(?<![0-9A-Za-z])\d{17}[\dXx](?![0-9A-Za-z])", 0.5)
            ],
            supported_language=LANGUAGE,
            name="CnResidentIdRecognizer",
        )

    def validate_result(self, pattern_text: str) -> bool:
        return cn_resident_id_valid(pattern_text)


def _not_a_phone(text: str, run: re.Match[str]) -> bool:
    """A run that is a number rather than a phone number: a decimal's digits, or a bare
    run of digits with no + and no separator (an amount, a count, a constant; a
    mainland China mobile written so is found by :class:`CnMobileRecognizer`)."""
    before, after = text[max(0, run.start() - 2) : run.start()], text[run.end() : run.end() + 2]
    if before.endswith(".") or re.fullmatch(r"\.\d", after):
        return True
    digits = run.group()
    return digits.isdigit() or re.fullmatch(r"\d+\.\d+", digits) is not None


class FastPhoneRecognizer(PhoneRecognizer):
    """Presidio's phone recognizer (``phonenumbers``, every region of
    :data:`PHONE_REGIONS`), run only on the runs of digits that could be a number:
    scanning whole texts once per region costs some 5 us a character, most texts have no
    such run, and a match never reaches beyond one."""

    def __init__(self) -> None:
        super().__init__(supported_language=LANGUAGE, supported_regions=PHONE_REGIONS)

    def analyze(
        self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None
    ) -> list[RecognizerResult]:
        found: list[RecognizerResult] = []
        for run in _PHONE_RUN.finditer(text):
            if _not_a_phone(text, run):
                continue
            lo, hi = max(0, run.start() - _PHONE_MARGIN), min(len(text), run.end() + _PHONE_MARGIN)
            for result in super().analyze(text[lo:hi], entities, nlp_artifacts):  # type: ignore[arg-type]
                result.start += lo
                result.end += lo
                found.append(result)
        return found


class CnMobileRecognizer(PatternRecognizer):
    """Mainland China mobile numbers: 11 digits from 13x to 19x, with or without +86 and
    spaces or hyphens as people write them (``138 1234 5678``)."""

    def __init__(self) -> None:
        number = r"1[3-9]\d[ -]?\d{4}[ -]?\d{4}"
        super().__init__(
            supported_entity=PHONE_NUMBER,
            patterns=[
                Pattern(
                    "cn mobile",
                    rf"(?<![\d+])(?:(?:\+|00)86[ -]?)?{number}(?!\d)",
                    0.6,
                )
            ],
            supported_language=LANGUAGE,
            name="CnMobileRecognizer",
        )


#: Path segments and query keys after which a URL names a person.
_PERSONAL_SEGMENTS = (
    "u|user|users|people|person|profile|profiles|member|members|account|accounts|customer|"
    "customers|patient|patients|client|clients|employee|employees|staff|author|authors|"
    "home|in|pub"
)
_PERSONAL_QUERY = "user|username|uid|userid|email|mail|name|account|customer|patient|phone"
#: Bounded, so that a long run of non-space text costs linear time, never quadratic.
_URL_START = r"(?:https?://|www\.)[^\s/?#<>\"'()]{1,253}"
_URL_REST = r"[^\s<>\"'()]{0,1024}"


class PersonalUrlRecognizer(PatternRecognizer):
    """URLs (with a scheme or ``www.``) whose path or query names a person:
    ``/users/NAME``, ``/~NAME``, ``/@NAME``, ``?email=...``. Documentation links are kept."""

    def __init__(self) -> None:
        segment = rf"/(?:{_PERSONAL_SEGMENTS})/[^\s/?#<>\"'()]+"
        patterns = [
            Pattern(
                "url personal segment", rf"(?i){_URL_START}{_URL_REST}?{segment}{_URL_REST}", 0.6
            ),
            Pattern(
                "url tilde or handle",
                rf"(?i){_URL_START}{_URL_REST}?/[~@][^\s/?#<>\"'()]+{_URL_REST}",
                0.6,
            ),
            Pattern(
                "url personal query",
                rf"(?i){_URL_START}{_URL_REST}?[?&](?:{_PERSONAL_QUERY})={_URL_REST}",
                0.6,
            ),
        ]
        super().__init__(
            supported_entity=URL,
            patterns=patterns,
            supported_language=LANGUAGE,
            name="PersonalUrlRecognizer",
        )


@functools.cache
def _offline_tld() -> tldextract.TLDExtract:
    """tldextract with its bundled public suffix list: no download, ever."""
    return tldextract.TLDExtract(suffix_list_urls=(), cache_dir=None)


class OfflineEmailRecognizer(EmailRecognizer):
    """Presidio's e-mail recognizer, its domain checked against the public suffix list
    that tldextract bundles (Presidio's own fetches the list from the internet)."""

    def __init__(self) -> None:
        super().__init__(supported_language=LANGUAGE)

    def validate_result(self, pattern_text: str) -> bool:
        return _offline_tld()(pattern_text.rsplit("@", 1)[-1]).fqdn != ""


class DictionaryRecognizer(EntityRecognizer):
    """The region's own list of names (customers, account holders): each found whole,
    case-insensitively, at word boundaries."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self._pattern = pattern  # dictionary_pattern's
        super().__init__(
            supported_entities=[DICTIONARY],
            supported_language=LANGUAGE,
            name="DictionaryRecognizer",
        )

    def load(self) -> None:
        return None

    def analyze(
        self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None
    ) -> list[RecognizerResult]:
        del nlp_artifacts
        if DICTIONARY not in entities:
            return []
        return [
            RecognizerResult(DICTIONARY, m.start(), m.end(), 1.0)
            for m in self._pattern.finditer(text)
        ]


#: Presidio's recognizers fedciuic uses as they are, built for :data:`LANGUAGE`.
_PRESIDIO: dict[str, Callable[..., EntityRecognizer]] = {
    US_SSN: UsSsnRecognizer,
    CREDIT_CARD: CreditCardRecognizer,
    IBAN_CODE: IbanRecognizer,
    IP_ADDRESS: IpRecognizer,
    ES_NIF: EsNifRecognizer,
    ES_NIE: EsNieRecognizer,
    IT_FISCAL_CODE: ItFiscalCodeRecognizer,
    PL_PESEL: PlPeselRecognizer,
    FI_PERSONAL_IDENTITY_CODE: FiPersonalIdentityCodeRecognizer,
    SE_PERSONNUMMER: SePersonnummerRecognizer,
}
#: fedciuic's own (the dictionary's is built apart, from the region's entries).
_OWN: dict[str, tuple[Callable[[], EntityRecognizer], ...]] = {
    EMAIL_ADDRESS: (OfflineEmailRecognizer,),
    PHONE_NUMBER: (FastPhoneRecognizer, CnMobileRecognizer),
    CN_RESIDENT_ID: (CnResidentIdRecognizer,),
    URL: (PersonalUrlRecognizer,),
}


def pattern_recognizers(entities: tuple[str, ...]) -> list[EntityRecognizer]:
    """The pattern recognizers of ``entities``, made only for those."""
    made: list[EntityRecognizer] = []
    for entity in entities:
        if entity in _PRESIDIO:
            made.append(_PRESIDIO[entity](supported_language=LANGUAGE))
        made += [kind() for kind in _OWN.get(entity, ())]
    return made
