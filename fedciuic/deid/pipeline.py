"""The de-identification pipeline a region runs on every text field before tokenising:
Presidio's analyzer with fedciuic's recognizers (offline, no model unless the region
names one), then Presidio's anonymizer, replacing each identifier by a typed placeholder
(``<EMAIL>``) or by a pseudonym keyed by the region's secret (``<EMAIL_3f9a1c2b>``: the
same address gives the same pseudonym within the region, another in every other).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Literal

from presidio_analyzer import AnalyzerEngine, RecognizerRegistry, RecognizerResult
from presidio_analyzer.nlp_engine import NlpEngine, NoOpNlpEngine, SpacyNlpEngine
from presidio_analyzer.predefined_recognizers import SpacyRecognizer
from presidio_anonymizer import AnonymizerEngine
from presidio_anonymizer.entities import OperatorConfig

from fedciuic.deid.dictionary import Dictionary
from fedciuic.deid.entities import DICTIONARY, NER_ONLY, PLACEHOLDERS
from fedciuic.deid.recognizers import (
    LANGUAGE,
    RECOGNIZERS_VERSION,
    DictionaryRecognizer,
    pattern_recognizers,
)
from fedciuic.deid.secret import key_id
from fedciuic.errors import ConfigError

Replacement = Literal["placeholder", "pseudonym"]
REPLACEMENTS: tuple[Replacement, ...] = ("placeholder", "pseudonym")
#: Findings scored below this are kept (Presidio scores an unvalidated phone number 0.4,
#: a checked card or ID 1.0; weak guesses such as any nine digits score 0.05).
MIN_SCORE = 0.4
#: Hex digits of a pseudonym: 32 bits, so two identifiers of a region rarely share one.
PSEUDONYM_HEX = 8
#: The packages whose versions decide what is found (the pipeline's identity).
PACKAGES = ("presidio-analyzer", "presidio-anonymizer", "phonenumbers", "tldextract")
#: Masked examples a check keeps, and the context shown either side of one.
EXAMPLES = 5
_CONTEXT = 32
#: A text with none of these (nor a dictionary entry) holds no pattern's identifier:
#: every pattern type has a digit, an @, or a URL's start.
_MAY_HOLD = re.compile(r"[0-9@]|://|www\.", re.IGNORECASE)


@dataclass(frozen=True)
class DeidSpec:
    """Everything that decides what scrubbing does to a text."""

    entities: tuple[str, ...]
    replacement: Replacement
    key: bytes
    dictionary: Dictionary | None = None
    #: A spaCy pipeline (an installed package's name or a folder) for PERSON and LOCATION.
    ner_model: str = ""

    def identity(self) -> dict[str, Any]:
        """What the audit log records of the pipeline (no value, no key): its entity
        types, replacement, recognizer versions and a hash over all of it."""
        described: dict[str, Any] = {
            "entities": list(self.entities),
            "replacement": self.replacement,
            "min_score": MIN_SCORE,
            "ner_model": self.ner_model,
            "dictionary_entries": len(self.dictionary.entries) if self.dictionary else 0,
            "recognizers": {"fedciuic": RECOGNIZERS_VERSION}
            | {name: version(name) for name in PACKAGES},
            "key_id": key_id(self.key) if self.replacement == "pseudonym" else "",
        }
        hashed = described | {
            "dictionary": self.dictionary.keyed_digest(self.key) if self.dictionary else ""
        }
        canonical = json.dumps(hashed, sort_keys=True).encode()
        return {"config_hash": hashlib.sha256(canonical).hexdigest(), **described}


@dataclass
class Findings:
    """What scrubbing found, by entity type and by file; values are never kept, only
    (when asked) a few examples with every identifier masked."""

    counts: Counter[str] = field(default_factory=Counter)
    by_file: dict[str, Counter[str]] = field(default_factory=dict)
    records: int = 0  # records with at least one identifier
    examples: list[str] | None = None  # None: none are kept (training)

    def add(
        self,
        where: str,
        file: str,
        replaced: list[str],
        text: str,
        spans: list[tuple[str, int, int]],
    ) -> None:
        """Count the identifiers replaced in ``text`` (read at ``where``, of ``file``);
        ``spans`` are where they were (entity, start, end), for a masked example."""
        self.counts.update(replaced)
        self.by_file.setdefault(file, Counter()).update(replaced)
        if self.examples is not None and spans and len(self.examples) < EXAMPLES:
            self.examples.append(f"{where}: {spans[0][0]}: {masked_context(text, spans)}")


def masked_context(text: str, found: list[tuple[str, int, int]]) -> str:
    """The text around the first identifier, every identifier in it masked (letters and
    digits as ``*``, separators kept so that the shape shows)."""
    _, start, end = found[0]
    lo, hi = max(0, start - _CONTEXT), min(len(text), end + _CONTEXT)
    chars = list(text)
    for _, s, e in found:
        for i in range(s, e):
            if chars[i].isalnum():
                chars[i] = "*"
    shown = "".join(chars[lo:hi]).replace("\n", " ")
    return ("..." if lo else "") + shown + ("..." if hi < len(text) else "")


class Scrubber:
    """Finds and replaces identifiers in texts, counting what it replaced."""

    def __init__(self, spec: DeidSpec) -> None:
        self.spec = spec
        self.identity = spec.identity()
        registry = RecognizerRegistry(supported_languages=[LANGUAGE])
        for recognizer in pattern_recognizers(spec.entities):
            registry.add_recognizer(recognizer)
        if DICTIONARY in spec.entities and spec.dictionary is not None:
            registry.add_recognizer(DictionaryRecognizer(spec.dictionary.entries))
        self._ner = bool(spec.ner_model) and bool(set(NER_ONLY) & set(spec.entities))
        if self._ner:
            registry.add_recognizer(SpacyRecognizer(supported_language=LANGUAGE))
        self._analyzer = AnalyzerEngine(
            registry=registry,
            nlp_engine=_nlp_engine(spec.ner_model if self._ner else ""),
            supported_languages=[LANGUAGE],
            default_score_threshold=MIN_SCORE,
        )
        self._anonymizer = AnonymizerEngine()
        self._operators = {e: self._operator(e) for e in spec.entities}
        self._dictionary = (
            DictionaryRecognizer(spec.dictionary.entries)._pattern
            if spec.dictionary is not None and DICTIONARY in spec.entities
            else None
        )
        self.findings = Findings()

    def _operator(self, entity: str) -> OperatorConfig:
        stem = PLACEHOLDERS[entity]
        if self.spec.replacement == "placeholder":
            return OperatorConfig("replace", {"new_value": f"<{stem}>"})
        key = self.spec.key

        def pseudonym(value: str) -> str:
            normal = "".join(c for c in value.casefold() if c.isalnum() or c in "@.")
            mac = hmac.new(key, f"{entity}\n{normal}".encode(), hashlib.sha256)
            return f"<{stem}_{mac.hexdigest()[:PSEUDONYM_HEX]}>"

        return OperatorConfig("custom", {"lambda": pseudonym})

    def _may_hold(self, text: str) -> bool:
        if self._ner or _MAY_HOLD.search(text):
            return True
        return self._dictionary is not None and self._dictionary.search(text) is not None

    def scrub(self, text: str, *, where: str = "", file: str = "") -> str:
        """``text`` with every identifier replaced; the findings counted under ``file``."""
        if not text or not self._may_hold(text):
            return text
        results: list[RecognizerResult] = self._analyzer.analyze(
            text, language=LANGUAGE, entities=list(self.spec.entities)
        )
        if not results:
            return text
        done = self._anonymizer.anonymize(text, results, operators=self._operators)
        replaced = [item.entity_type for item in done.items]
        spans = sorted(((r.entity_type, r.start, r.end) for r in results), key=lambda f: f[1])
        self.findings.add(where, file, replaced, text, spans)
        return str(done.text)


def _nlp_engine(ner_model: str) -> NlpEngine:
    """No NLP at all (patterns need none), or the region's named spaCy pipeline."""
    if not ner_model:
        engine: NlpEngine = NoOpNlpEngine(models=[{"lang_code": LANGUAGE, "model_name": "none"}])
        engine.load()
        return engine
    engine = SpacyNlpEngine(models=[{"lang_code": LANGUAGE, "model_name": ner_model}])
    try:
        engine.load()
    except (OSError, ValueError) as err:
        raise ConfigError(
            [
                f"deid-ner-model: cannot load spaCy pipeline {ner_model!r} ({err}); install "
                "it in the region's environment (python -m spacy download NAME, or a folder "
                "saved with nlp.to_disk), or leave deid-ner-model empty to scrub by "
                "patterns and the dictionary alone"
            ]
        ) from None
    return engine
