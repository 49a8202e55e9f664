"""Presidio recognizers for every entity type fedciuic scrubs, all offline.

Presidio's own are used where they validate what they find; fedciuic adds the rest (cards
of every network, Chinese IDs and mobiles, personal URLs, the dictionary). A finding that
is only part of a longer token is kept (:class:`WholeTokens`): ``INV-2019-004512``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable

import tldextract
from presidio_analyzer import EntityRecognizer, Pattern, PatternRecognizer, RecognizerResult
from presidio_analyzer.nlp_engine import NlpArtifacts
from presidio_analyzer.predefined_recognizers import (
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

from fedciuic.deid.cards import find_cards
from fedciuic.deid.checks import cn_resident_id_valid
from fedciuic.deid.entities import (
    CN_RESIDENT_ID,
    CONTEXT_NAME,
    CREDIT_CARD,
    DICTIONARY,
    EMAIL_ADDRESS,
    ES_NIE,
    ES_NIF,
    EU_NATIONAL_IDS,
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
from fedciuic.deid.names import find_names

#: Regions whose numbering plans the phone recognizer tries (a + number is found anyway).
PHONE_REGIONS = ("US", "GB", "DE", "FR", "IT", "ES", "NL", "PL", "SE", "FI", "CN", "SG", "IN")

#: A run that may be a phone number: 7 or more digits, with the separators people write.
_PHONE_RUN = re.compile(r"[+(]?\d[\d \t().\-/]{5,}\d")
#: Characters either side of a run given to ``phonenumbers`` with it.
_PHONE_MARGIN = 2
#: An extension written after a number (``x45``, ``ext. 45``), given with it.
_EXTENSION = re.compile(r"[ \t]?(?:x|ext\.?|extension)[ \t]?\d{1,6}(?!\d)", re.IGNORECASE)


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
    """A run that is a decimal, bare digits (a China mobile is :class:`CnMobileRecognizer`'s)
    or thousands: no phone number."""
    before, after = text[max(0, run.start() - 2) : run.start()], text[run.end() : run.end() + 2]
    if before.endswith(".") or re.fullmatch(r"\.\d", after):
        return True
    digits = run.group()
    return (
        digits.isdigit()
        or re.fullmatch(r"\d+\.\d+", digits) is not None
        or _THOUSANDS.fullmatch(digits) is not None
    )


#: An amount grouped in thousands: ``12.345.678``, ``1 234 567 890`` (not ``612 345 678``).
_THOUSANDS = re.compile(r"[1-9]\d{0,2}(?:\.\d{3})+|[1-9]\d?(?: \d{3}){2,}")
#: Words that name the number after them a reference or a product's code.
_REFERENCE_WORDS = (
    r"invoice|inv|order|ord|po|ref|reference|ticket|case|claim|isbn|issn|doi|pmid|arxiv|"
    r"sku|part|p/n|serial|s/n|tracking|version|ver|build|release|page|pages|pp|"
    r"ean|gtin|upc|barcode|art|article|"
    r"rechnung\w*|bestell\w*|auftrag\w*|artikel\w*|facture|commande|fattura|ordine|"
    r"factura|pedido|albar[aá]n|fedex|ups|usps|dhl|tnt|gls|dpd|sendung\w*|suivi|spedizione|"
    r"env[ií]o"
)
_NAMED_REFERENCE = re.compile(
    rf"(?i)(?:(?<![^\W\d_])(?:{_REFERENCE_WORDS})|订单|发票|单号|编号|条码|条形码|顺丰|快递|运单)\.?\s*"
    r"(?:(?:no|nr|n[°º]|num|number|nummer|numéro|número|numero)\b\.?\s*)?[:#]?\s*$"
)
#: A date (year first or last) at the start of a finding.
_LEADING_DATE = re.compile(
    r"\[?(?:\d{4}[-/.](?:0?[1-9]|1[0-2])[-/.](?:0?[1-9]|[12]\d|3[01])"
    r"|(?:0?[1-9]|[12]\d|3[01])[-/.](?:0?[1-9]|1[0-2])[-/.]\d{4})(?!\d)"
)
#: A version's marker before an IPv4-shaped number (``rv:1.9.5.20``, ``"version": "1.2.3.4"``).
_VERSION_MARK = re.compile(
    r"(?i)(?:version|release|build|(?<![^\W\d_])(?:v|rv|ver))[\s:=\"'(\[]{0,4}$"
)
#: The result of a calculation before a number: ``2**40 = ``, ``a * b = ``, ``20! = ``.
_CALCULATED = re.compile(r"[\d)!²³]\s*[=≈]\s*$")
#: An IPv4 address or network (found as an IP, or kept as a version).
_IPV4_SHAPE = re.compile(r"\d{1,3}(?:\.\d{1,3}){3}(?:/\d{1,2})?")
#: A unit after a number makes it a quantity (``299 792 458 m/s``, ``12 345 678 kr``).
_UNIT_AFTER = re.compile(
    r"\s?(?:[%‰€$£¥元円]|°[CF]?|(?:m/s|km/h|[kMGT]?(?:m|g|s|Hz|Wh|Pa|bit|bytes?)|[kMGT][JWVB]"
    r"|kr|zł|EUR|USD|CNY|GBP|PLN|SEK|CHF|JPY)(?![^\W\d_]))"
)


def _named_reference(text: str, start: int, end: int) -> bool:
    """A finding named a reference by the words before it (``invoice 2024-000123``), or a
    calculation's result (``a * b = 6557470319842``)."""
    del end
    before = max(0, start - 32)
    return (
        _NAMED_REFERENCE.search(text, before, start) is not None
        or _CALCULATED.search(text, before, start) is not None
    )


def _dotted_version(found: str) -> bool:
    """3+ dotted groups of digits, one of a single digit: a version (``114.0.6914.14``), as
    phone numbers group by two or more (``06.12.34.56.78``)."""
    groups = found.split(".")
    return len(groups) >= 3 and all(g.isdecimal() for g in groups) and min(map(len, groups)) == 1


def _phone_shaped_number(text: str, start: int, end: int) -> bool:
    """A phone-shaped reference, leading date, version, IPv4 address or quantity: no phone."""
    return (
        _named_reference(text, start, end)
        or text[max(0, start - 3) : start].rstrip().endswith("#")
        or _LEADING_DATE.match(text, start, end) is not None
        or _dotted_version(text[start:end])
        or _IPV4_SHAPE.fullmatch(text, start, end) is not None
        or _UNIT_AFTER.match(text, end) is not None
    )


def _not_an_address(text: str, start: int, end: int) -> bool:
    """An IP-shaped finding that is no host's address: a version (``rv:1.9.5.20``), or an
    IPv6 shape with under three groups or no digit (``arr[::2]``, ``dead::beef``, ``::1``)."""
    found = text[start:end]
    if ":" not in found:
        return _VERSION_MARK.search(text, max(0, start - 24), start) is not None
    groups = [g for g in re.split(r"[:/%.]", found) if g]
    return len(groups) < 3 or not any(c.isdecimal() for c in found)


def _continues_token(char: str) -> bool:
    """Whether ``char`` continues a word or number of a spaced script (not ``卡号6222``)."""
    return char == "_" or char.isdecimal() or (char.isalpha() and ord(char) < 0x0530)


#: Separators that make one token of both sides: '-' and '/' join any, '.' and ':' digits.
NUMBER_JOINERS = "-/.:"


def inside_token(text: str, start: int, end: int, joiners: str = NUMBER_JOINERS) -> bool:
    """Whether ``text[start:end]`` starts or ends inside a longer token: a letter or digit
    right beside it, or one beside a joining separator beside it.

    >>> inside_token("e ~ 2.718281828459045", 7, 18), inside_token("PESEL 44051401359", 6, 17)
    (True, False)
    >>> inside_token("INV-2019-004512", 4, 15), inside_token("卡号4111111111111111", 2, 18)
    (True, False)
    """
    if start > 0 and _joined(text[start - 1], text[start - 2] if start > 1 else "", joiners):
        return True
    return end < len(text) and _joined(text[end], text[end + 1 : end + 2], joiners)


def _joined(beside: str, beyond: str, joiners: str) -> bool:
    if _continues_token(beside):
        return True
    if not beyond or beside not in joiners:
        return False
    return beyond.isdecimal() if beside in ".:" else _continues_token(beyond)


#: A letter of an unspaced script (Chinese, Thai...), read as a space where a pattern needs \b.
_UNSPACED_LETTER = re.compile(r"[^\W\d_\u0000-\u052f]")


@functools.lru_cache(maxsize=2)
def _unglued(text: str) -> str:
    """``text``, each letter of an unspaced script read as a space (once for all recognizers)."""
    return _UNSPACED_LETTER.sub(" ", text)


class WholeTokens(EntityRecognizer):
    """A recognizer whose findings are kept only as whole tokens not ``also_kept`` by their
    type's rule; it answers to the wrapped one's id, so that Presidio's context words apply.
    ``unglued``: ``\\b`` sees no word boundary in ``客户123-45-6789的`` (:func:`_unglued`)."""

    def __init__(
        self,
        inner: EntityRecognizer,
        *,
        joiners: str = NUMBER_JOINERS,
        also_kept: Callable[[str, int, int], bool] | None = None,
        unglued: bool = False,
    ) -> None:
        self.inner = inner
        self._joiners = joiners
        self._also_kept = also_kept
        self._unglued = unglued
        super().__init__(
            supported_entities=inner.get_supported_entities(),
            supported_language=inner.get_supported_language(),
            name=str(getattr(inner, "name", "")),
            context=inner.context,
        )
        self._id = inner.id  # results carry the wrapped recognizer's id

    def load(self) -> None:
        return None

    def analyze(
        self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None
    ) -> list[RecognizerResult]:
        read = _unglued(text) if self._unglued else text
        found: list[RecognizerResult] = self.inner.analyze(read, entities, nlp_artifacts)  # type: ignore[arg-type]
        return [
            r
            for r in found
            if read[r.start : r.end] == text[r.start : r.end]  # no letter read as a space
            and not inside_token(text, r.start, r.end, self._joiners)
            and not (self._also_kept is not None and self._also_kept(text, r.start, r.end))
        ]

    def enhance_using_context(
        self,
        text: str,
        raw_recognizer_results: list[RecognizerResult],
        other_raw_recognizer_results: list[RecognizerResult],
        nlp_artifacts: NlpArtifacts,
        context: list[str] | None = None,
    ) -> list[RecognizerResult]:
        return self.inner.enhance_using_context(
            text, raw_recognizer_results, other_raw_recognizer_results, nlp_artifacts, context
        )


class FastPhoneRecognizer(PhoneRecognizer):
    """Presidio's phone recognizer, run only on runs of digits (whole texts are slow)."""

    def __init__(self) -> None:
        super().__init__(supported_language=LANGUAGE, supported_regions=PHONE_REGIONS)

    def analyze(
        self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None
    ) -> list[RecognizerResult]:
        found: list[RecognizerResult] = []
        for run in _PHONE_RUN.finditer(text):
            if _not_a_phone(text, run):
                continue
            extension = _EXTENSION.match(text, run.end())
            end = extension.end() if extension else run.end()
            lo, hi = max(0, run.start() - _PHONE_MARGIN), min(len(text), end + _PHONE_MARGIN)
            for result in super().analyze(text[lo:hi], entities, nlp_artifacts):  # type: ignore[arg-type]
                result.start += lo
                result.end += lo
                found.append(result)
        return found


class CnMobileRecognizer(PatternRecognizer):
    """Mainland China mobile numbers (13x-19x, 11 digits), +86 and separators optional."""

    def __init__(self) -> None:
        number = r"(?<![\d+])(?:(?:\+|00)86[ -]?)?1[3-9]\d[ -]?\d{4}[ -]?\d{4}(?!\d)"
        super().__init__(
            supported_entity=PHONE_NUMBER,
            patterns=[Pattern("cn mobile", number, 0.6)],
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
    """URLs whose path or query names a person: ``/users/NAME``, ``/~NAME``, ``?email=``."""

    def __init__(self) -> None:
        personal = {
            "url personal segment": rf"/(?:{_PERSONAL_SEGMENTS})/[^\s/?#<>\"'()]+",
            "url tilde or handle": r"/[~@][^\s/?#<>\"'()]+",
            "url personal query": rf"[?&](?:{_PERSONAL_QUERY})=",
        }
        patterns = [
            Pattern(name, rf"(?i){_URL_START}{_URL_REST}?{part}{_URL_REST}", 0.6)
            for name, part in personal.items()
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
    """Presidio's e-mail recognizer, offline: tldextract's bundled suffix list, not a download."""

    def __init__(self) -> None:
        super().__init__(supported_language=LANGUAGE)

    def validate_result(self, pattern_text: str) -> bool:
        return _offline_tld()(pattern_text.rsplit("@", 1)[-1]).fqdn != ""


class _SpanRecognizer(EntityRecognizer):
    """One entity type found by a function of the text alone, each span at one score."""

    def __init__(
        self, entity: str, score: float, find: Callable[[str], Iterable[tuple[int, int]]]
    ) -> None:
        self._entity, self._score, self._find = entity, score, find
        super().__init__(
            supported_entities=[entity], supported_language=LANGUAGE, name=type(self).__name__
        )

    def load(self) -> None:
        return None

    def analyze(
        self, text: str, entities: list[str], nlp_artifacts: NlpArtifacts | None = None
    ) -> list[RecognizerResult]:
        del nlp_artifacts
        if self._entity not in entities:
            return []
        spans = sorted(set(self._find(text)))
        return [RecognizerResult(self._entity, s, e, self._score) for s, e in spans]


class CardRecognizer(_SpanRecognizer):
    """Payment card numbers of every network (:mod:`fedciuic.deid.cards`)."""

    def __init__(self) -> None:
        super().__init__(
            CREDIT_CARD, 1.0, lambda text: ((c.start, c.end) for c in find_cards(text))
        )


class DictionaryRecognizer(_SpanRecognizer):
    """The region's own list of names, each found whole, case-insensitively, at word boundaries."""

    def __init__(self, pattern: re.Pattern[str]) -> None:  # dictionary_pattern's
        super().__init__(DICTIONARY, 1.0, lambda text: (m.span() for m in pattern.finditer(text)))


class ContextNameRecognizer(_SpanRecognizer):
    """Names found offline by their context (:func:`fedciuic.deid.names.find_names`)."""

    #: Above the pipeline's threshold, below a dictionary's 1.0 (which wins a tie).
    SCORE = 0.6

    def __init__(self) -> None:
        super().__init__(CONTEXT_NAME, self.SCORE, find_names)


#: Presidio's recognizers fedciuic uses as they are, built for :data:`LANGUAGE`.
_PRESIDIO: dict[str, Callable[..., EntityRecognizer]] = {
    US_SSN: UsSsnRecognizer,
    IBAN_CODE: IbanRecognizer,
    IP_ADDRESS: IpRecognizer,
    ES_NIF: EsNifRecognizer,
    ES_NIE: EsNieRecognizer,
    IT_FISCAL_CODE: ItFiscalCodeRecognizer,
    PL_PESEL: PlPeselRecognizer,
    FI_PERSONAL_IDENTITY_CODE: FiPersonalIdentityCodeRecognizer,
    SE_PERSONNUMMER: SePersonnummerRecognizer,
}
#: Types found as tokens of running text: each recognizer wrapped in :class:`WholeTokens`
#: with its separators and rule (IPs take '/24' and ':8080' after).
_TOKEN_RULES: dict[str, tuple[str, Callable[[str, int, int], bool] | None]] = {
    entity: (NUMBER_JOINERS, None)
    for entity in (EMAIL_ADDRESS, CN_RESIDENT_ID, US_SSN, IBAN_CODE, *EU_NATIONAL_IDS)
} | {
    PHONE_NUMBER: (NUMBER_JOINERS, _phone_shaped_number),
    IP_ADDRESS: (".", _not_an_address),
    # Luhn and PESEL's or a personnummer's checks pass one number in ten or so
    CREDIT_CARD: (NUMBER_JOINERS, _named_reference),
    PL_PESEL: (NUMBER_JOINERS, _named_reference),
    SE_PERSONNUMMER: (NUMBER_JOINERS, _named_reference),
}
#: fedciuic's own (the dictionary's is built apart, from the region's entries).
_OWN: dict[str, tuple[Callable[[], EntityRecognizer], ...]] = {
    EMAIL_ADDRESS: (OfflineEmailRecognizer,),
    PHONE_NUMBER: (FastPhoneRecognizer, CnMobileRecognizer),
    CREDIT_CARD: (CardRecognizer,),
    CN_RESIDENT_ID: (CnResidentIdRecognizer,),
    URL: (PersonalUrlRecognizer,),
    CONTEXT_NAME: (ContextNameRecognizer,),
}


def pattern_recognizers(entities: tuple[str, ...]) -> list[EntityRecognizer]:
    made: list[EntityRecognizer] = []
    for entity in entities:
        found_by = [_PRESIDIO[entity](supported_language=LANGUAGE)] if entity in _PRESIDIO else []
        found_by += [kind() for kind in _OWN.get(entity, ())]
        if entity in _TOKEN_RULES:
            joiners, rule = _TOKEN_RULES[entity]
            found_by = [
                WholeTokens(
                    r, joiners=joiners, also_kept=rule, unglued=isinstance(r, PatternRecognizer)
                )
                for r in found_by
            ]
        made += found_by
    return made
