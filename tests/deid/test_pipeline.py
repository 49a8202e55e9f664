"""The de-identification pipeline on its own: every supported type found and replaced,
checks keeping look-alikes, pseudonyms keyed by the region, the region's key and NER."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fedciuic.deid import DeidSpec, Scrubber, data_commitment, load_dictionary, region_secret
from fedciuic.deid.entities import DIRECT
from fedciuic.errors import ConfigError

KEY = bytes(range(32))

#: One value of every pattern type, as people write it, and its placeholder.
PLANTED = {
    "EMAIL_ADDRESS": ("jane.roe@example.org", "<EMAIL>"),
    "PHONE_NUMBER": ("+44 20 7946 0958", "<PHONE>"),
    "CN_RESIDENT_ID": ("11010519491231002X", "<CN_ID>"),
    "US_SSN": ("536-22-8745", "<SSN>"),
    "CREDIT_CARD": ("4111 1111 1111 1111", "<CARD>"),
    "IBAN_CODE": ("DE89370400440532013000", "<IBAN>"),
    "IP_ADDRESS": ("192.168.17.42", "<IP>"),
    "URL": ("https://forum.example.com/users/jane-roe", "<URL>"),
    "ES_NIF": ("12345678Z", "<ES_NIF>"),
    "IT_FISCAL_CODE": ("RSSMRA85T10A562S", "<IT_FISCAL_CODE>"),
    "PL_PESEL": ("44051401359", "<PL_PESEL>"),
    "FI_PERSONAL_IDENTITY_CODE": ("131052-308T", "<FI_ID>"),
    "DICTIONARY": ("Zhang Wei", "<NAME>"),
}
#: The pattern types and the dictionary (``direct`` no longer holds it: ``names`` does).
SCRUBBED = (*DIRECT, "DICTIONARY")
#: Mainland China mobiles as people write them (no country code, spaces, +86).
CN_MOBILES = ("13812345678", "138 1234 5678", "+86 138-1234-5678", "0086 13912345678")


def scrubber(replacement: str = "placeholder", key: bytes = KEY, **kw: object) -> Scrubber:
    return Scrubber(DeidSpec(SCRUBBED, replacement, key, kw.pop("dictionary", None), **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def placeholder(tmp_path_factory: pytest.TempPathFactory) -> Scrubber:
    names = tmp_path_factory.mktemp("dict") / "names.txt"
    names.write_text("# customers\nZhang Wei\nJane Roe Holdings\n", encoding="utf-8")
    return scrubber(dictionary=load_dictionary(names))


@pytest.mark.parametrize("entity", sorted(PLANTED))
def test_every_supported_type_is_found_and_replaced_by_its_placeholder(placeholder, entity):
    value, shown = PLANTED[entity]
    text = f"Please note: {value} is on file, thanks."
    out = placeholder.scrub(text)
    assert value not in out
    assert out == f"Please note: {shown} is on file, thanks."


@pytest.mark.parametrize("number", CN_MOBILES)
def test_mainland_china_mobile_numbers_are_phone_numbers(placeholder, number):
    assert placeholder.scrub(f"call {number} today") == "call <PHONE> today"


@pytest.mark.parametrize(
    "kept",
    [
        "order 4111111111111112 shipped",  # 16 digits failing Luhn: an order number
        "ref 11010519491231002Y",  # a resident ID's shape with the wrong check character
        "IBAN DE89370400440532013001",  # an IBAN's shape failing ISO 7064
        "NIF 12345678A",  # a Spanish NIF with the wrong letter
        "see https://docs.python.org/3/library/os.html and os.path.join",  # no person in it
        "pi is 3.14159265358979 and e is 2.718281828",  # decimals are not phone numbers
        "Emin=-425000000, Emax=425000000",  # bare digit runs are not phone numbers
        "Zhang Weiqiang wrote it",  # a dictionary entry only as a whole word
    ],
)
def test_checks_keep_look_alikes(placeholder, kept):
    assert placeholder.scrub(kept) == kept


def test_counts_are_per_entity_type_and_file_and_never_hold_a_value(placeholder):
    placeholder.findings.clear()
    placeholder.scrub("mail jane.roe@example.org or a@example.com", file="chat.jsonl")
    placeholder.scrub("card 4111 1111 1111 1111", file="docs.jsonl")
    found = placeholder.findings
    assert found.counts == {"EMAIL_ADDRESS": 2, "CREDIT_CARD": 1}
    assert found.by_file == {"chat.jsonl": {"EMAIL_ADDRESS": 2}, "docs.jsonl": {"CREDIT_CARD": 1}}


def test_masked_examples_show_the_shape_and_not_the_value():
    s = scrubber()
    s.findings.examples = []
    s.scrub("write to jane.roe@example.org now", where="chat.jsonl:3")
    (example,) = s.findings.examples
    assert example == "chat.jsonl:3: EMAIL_ADDRESS: write to ****.***@*******.*** now"


def test_pseudonyms_are_stable_within_a_region_and_differ_across_regions():
    eu, eu_again, cn = (
        scrubber("pseudonym"),
        scrubber("pseudonym"),
        scrubber("pseudonym", b"c" * 32),
    )
    text = "jane.roe@example.org"
    first = eu.scrub(text)
    assert first.startswith("<EMAIL_") and text not in first
    assert eu.scrub(text) == first == eu_again.scrub(text)
    assert eu.scrub("Jane.Roe@Example.org") == first  # the same address, as written otherwise
    assert eu.scrub("john.roe@example.org") != first
    assert cn.scrub(text) != first


def test_the_identity_covers_the_config_and_holds_no_key_or_value(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("Zhang Wei\n", encoding="utf-8")
    base = scrubber().identity
    assert base["recognizers"]["presidio-analyzer"] and base["entities"] == list(SCRUBBED)
    assert scrubber("pseudonym").identity["config_hash"] != base["config_hash"]
    listed = scrubber(dictionary=load_dictionary(names)).identity
    assert listed["config_hash"] != base["config_hash"] and listed["dictionary_entries"] == 1
    assert KEY.hex() not in str(listed) and "Zhang" not in str(listed)


def test_the_region_key_is_made_once_private_and_a_damaged_one_is_refused(tmp_path):
    path = tmp_path / "state" / "deid-secret.key"
    key = region_secret(path)
    assert region_secret(path) == key and len(key) == 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    path.write_text("not hex\n")
    with pytest.raises(ConfigError, match=rf"{path}: not a pseudonym key \(64 hex digits\)"):
        region_secret(path)


def test_a_named_ner_model_finds_names_and_a_missing_one_is_refused(tmp_path):
    import spacy

    nlp = spacy.blank("en")
    ruler = nlp.add_pipe("entity_ruler")
    ruler.add_patterns([{"label": "PERSON", "pattern": "Alice Moreau"}])  # type: ignore[attr-defined]
    nlp.to_disk(tmp_path / "ner")
    spec = DeidSpec(
        ("PERSON", "EMAIL_ADDRESS"), "placeholder", KEY, ner_model=str(tmp_path / "ner")
    )
    assert Scrubber(spec).scrub("Alice Moreau wrote") == "<PERSON> wrote"
    missing = DeidSpec(("PERSON",), "placeholder", KEY, ner_model=str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match="deid-ner-model: cannot load spaCy pipeline"):
        Scrubber(missing).scrub("Alice Moreau wrote")


def test_nothing_is_downloaded(monkeypatch):
    """Presidio's e-mail recognizer fetches the public suffix list unless told not to."""
    import socket

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("de-identification tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    assert scrubber().scrub("mail jane@example.co.uk") == "mail <EMAIL>"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"Zhang Wei\nX\n", ":2: entry of 1 character(s), the least is 2"),
        (b"Zhang Wei\nJane\tRoe\n", ":2: holds a control character"),
        (b"# names\n\nZhang Wei\n\xff\xfe\n", ":4: not UTF-8"),
        (b"Zhang Wei\n---\n", ":2: no letter or digit in the entry"),
        (b"# only a comment\n", ": no entries"),
    ],
)
def test_a_malformed_dictionary_is_refused_naming_file_and_line(tmp_path, content, problem):
    path = tmp_path / "customers.txt"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_dictionary(path)
    message = str(err.value)
    assert message.startswith(f"{path}{problem}"), message
    assert "\n" not in message


def test_a_dictionary_saved_with_a_byte_order_mark_and_crlf_reads_its_names(tmp_path):
    path = tmp_path / "customers.txt"
    path.write_bytes(b"\xef\xbb\xbfZhang Wei\r\nJane Roe\r\n")
    assert load_dictionary(path).entries == ("Zhang Wei", "Jane Roe")


def test_a_missing_dictionary_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"no such dictionary file; check deid-dictionary"):
        load_dictionary(Path(tmp_path / "none.txt"))


def test_dictionary_names_are_found_in_scripts_written_without_spaces(tmp_path):
    names = tmp_path / "names.txt"
    names.write_text("王伟\nZhang Wei\nZhang Wei Holdings\n", encoding="utf-8")
    s = scrubber(dictionary=load_dictionary(names))
    assert s.scrub("客户王伟的账户") == "客户<NAME>的账户"
    assert s.scrub("zhang wei holdings and Zhang Wei") == "<NAME> and <NAME>"  # longest first
    assert s.scrub("Zhang Weiqiang") == "Zhang Weiqiang"
    assert s.findings.counts == {"DICTIONARY": 3}


#: What a region without a dictionary or a NER model may be given (``direct,names`` and
#: the NER types): the analyzer has recognizers for some of them only.
UNFOUNDABLE = (*DIRECT, "DICTIONARY", "CONTEXT_NAME", "PERSON", "LOCATION")
TEXTS = (
    "mail jane.roe@example.org",
    "Dear Mr. Smith, call +44 20 7946 0958",
    "客户王伟的卡号 4111 1111 1111 1111",
    "order 42 shipped on 2024-03-01",
)


def test_presidio_is_asked_only_for_types_a_recognizer_supports(monkeypatch):
    """Presidio warns once per text of a type without a recognizer, and says it will
    refuse them: asked only for supported ones, scrubbing works either way."""
    from presidio_analyzer import AnalyzerEngine

    analyze = AnalyzerEngine.analyze

    def strict(self, text, language, entities=None, **kw):
        unsupported = set(entities or ()) - set(self.get_supported_entities(language))
        if unsupported:
            raise ValueError(f"Entity {sorted(unsupported)} has no recognizer")
        return analyze(self, text, language, entities=entities, **kw)

    monkeypatch.setattr(AnalyzerEngine, "analyze", strict)
    s = Scrubber(DeidSpec(UNFOUNDABLE, "placeholder", KEY))
    assert [s.scrub(t) for t in TEXTS] == [
        "mail <EMAIL>",
        "Dear Mr. <NAME>, call <PHONE>",
        "客户<NAME>的卡号 <CARD>",
        "order 42 shipped on 2024-03-01",
    ]
    assert Scrubber(DeidSpec(("DICTIONARY",), "placeholder", KEY)).scrub("Zhang Wei 42") == (
        "Zhang Wei 42"  # nothing to ask for: Presidio reads no types as all it knows
    )


def test_no_per_text_warning_without_a_dictionary_or_model(caplog):
    s = Scrubber(DeidSpec(UNFOUNDABLE, "placeholder", KEY))
    with caplog.at_level("WARNING"):
        for _ in range(50):
            for text in TEXTS:
                s.scrub(text)
    assert not [r for r in caplog.records if "corresponding recognizer" in r.getMessage()]
    assert s.findings.counts["EMAIL_ADDRESS"] == 50


def test_the_data_commitment_binds_key_data_and_run_and_shows_none_of_them(tmp_path):
    key, other = region_secret(tmp_path / "a.key"), region_secret(tmp_path / "b.key")
    made = data_commitment(key, "ab" * 32, 7)
    assert made == data_commitment(key, "ab" * 32, 7) and len(made) == 64
    assert "ab" * 32 not in made
    others = {data_commitment(other, "ab" * 32, 7), data_commitment(key, "cd" * 32, 7)}
    assert made not in others | {data_commitment(key, "ab" * 32, 8)}
