from __future__ import annotations

import collections
import json
import re
import statistics

import pytest

from fedciuic.data.demo import (
    CHAT_FILE,
    DOCS_FILE,
    INSTRUCTIONS_FILE,
    MAX_RECORD_CHARS,
    MESSAGES,
    PROMPT,
    RECORDS_PER_USER,
    RESPONSE,
    TEXT,
    USER_ID,
    USERS_PER_REGION,
    summary,
    write_demo_corpora,
)
from fedciuic.data.records import (
    ASSISTANT,
    CONTENT,
    INPUT,
    INSTRUCTION,
    OUTPUT,
    ROLE,
    SYSTEM,
    USER,
)
from fedciuic.errors import ConfigError
from fedciuic.model.presets import byte_tokenizer

FILES = (DOCS_FILE, CHAT_FILE, INSTRUCTIONS_FILE)
REGIONS = ("eu", "cn", "us")
#: The record shapes a region may hold, by their fields (less the user id).
SHAPES = {
    "text": {TEXT},
    "prompt/response": {PROMPT, RESPONSE},
    "alpaca": {INSTRUCTION, INPUT, OUTPUT},
    "chat": {MESSAGES},
}


def records(folder):
    """Every record of a region's demo files, with the name of the file it is in."""
    return [
        (name, json.loads(line))
        for name in FILES
        for line in (folder / name).read_text(encoding="utf-8").splitlines()
    ]


def texts(record):
    """The text a record holds, whatever its shape."""
    if MESSAGES in record:
        return [turn[CONTENT] for turn in record[MESSAGES]]
    return [value for key, value in record.items() if key != USER_ID]


def shape(record):
    (found,) = [name for name, fields in SHAPES.items() if set(record) - {USER_ID} == fields]
    return found


def words(folder):
    text = " ".join(t for _, record in records(folder) for t in texts(record))
    return collections.Counter(re.findall(r"[a-z]{4,}", text.lower()))


def test_demo_corpora_are_deterministic(tmp_path):
    write_demo_corpora(tmp_path / "a", ("eu", "cn"))
    write_demo_corpora(tmp_path / "b", ("eu", "cn"))
    for region in ("eu", "cn"):
        assert sorted(p.name for p in (tmp_path / "a" / region).iterdir()) == sorted(FILES)
        for name in FILES:
            a = (tmp_path / "a" / region / name).read_bytes()
            assert a == (tmp_path / "b" / region / name).read_bytes()
            assert len(a) > 10_000


def test_regions_really_differ_in_vocabulary(demo_root):
    top = {r: {w for w, _ in words(demo_root / r).most_common(200)} for r in REGIONS}
    for a, b in (("eu", "cn"), ("eu", "us"), ("cn", "us")):
        overlap = len(top[a] & top[b]) / 200
        assert overlap < 0.6, (a, b, overlap)
    assert "message" in top["eu"] and "decimal" in top["cn"] and "process" in top["us"]


@pytest.mark.parametrize("region", REGIONS)
def test_every_record_has_one_shape_and_a_user(demo_root, region):
    shapes: collections.Counter[tuple[str, str]] = collections.Counter()
    for name, record in records(demo_root / region):
        assert isinstance(record[USER_ID], str) and record[USER_ID], record
        kind = shape(record)
        shapes[name, kind] += 1
        if kind != "chat":
            assert all(isinstance(value, str) for value in record.values()), record
            assert all(record[field] for field in SHAPES[kind] - {INPUT}), record
            continue
        turns = record[MESSAGES]
        assert all(set(turn) == {ROLE, CONTENT} for turn in turns), record
        assert all(isinstance(turn[CONTENT], str) and turn[CONTENT] for turn in turns), record
        roles = [turn[ROLE] for turn in turns]
        assert set(roles) <= {SYSTEM, USER, ASSISTANT} and roles[-1] == ASSISTANT, record
        assert SYSTEM not in roles[1:], record
    assert {kind for name, kind in shapes if name == DOCS_FILE} == {"text"}
    assert {kind for name, kind in shapes if name == CHAT_FILE} == {"chat"}
    (instructions,) = {kind for name, kind in shapes if name == INSTRUCTIONS_FILE}
    assert instructions in {"alpaca", "prompt/response"}
    assert 1000 <= shapes.total() <= 2500


def test_every_shape_appears_across_regions(demo_root):
    found = {shape(record) for r in REGIONS for _, record in records(demo_root / r)}
    assert found == set(SHAPES)


def test_chats_vary(demo_root):
    chats = [r for name, r in records(demo_root / "eu") if name == CHAT_FILE]
    roles = collections.Counter(tuple(turn[ROLE] for turn in r[MESSAGES]) for r in chats)
    assert roles[USER, ASSISTANT] > len(chats) / 2
    assert roles[SYSTEM, USER, ASSISTANT] and roles[USER, ASSISTANT, USER, ASSISTANT]
    questions = {r[MESSAGES][-2][CONTENT].split()[0] for r in chats}
    assert len(questions) >= 5


@pytest.mark.parametrize("region", REGIONS)
def test_users_are_many_and_heavy_tailed_within_the_text_bound(demo_root, region):
    found = records(demo_root / region)
    per_user = collections.Counter(record[USER_ID] for _, record in found)
    assert USERS_PER_REGION[0] <= len(per_user) <= USERS_PER_REGION[1]
    assert all(user.startswith(f"{region}-u") for user in per_user)
    counts = list(per_user.values())
    assert RECORDS_PER_USER[0] <= min(counts) and max(counts) <= RECORDS_PER_USER[1]
    assert max(counts) >= 5 * statistics.median(counts)
    chars = sum(len(t) for _, record in found for t in texts(record))
    assert chars <= MAX_RECORD_CHARS


def test_regions_have_their_own_users(demo_root):
    users = [{record[USER_ID] for _, record in records(demo_root / r)} for r in REGIONS]
    assert not (users[0] & users[1]) and not (users[0] & users[2]) and not (users[1] & users[2])


def test_summary_keeps_first_paragraphs_and_cuts_at_a_sentence():
    doc = "First line\nof the first paragraph.\n\nSecond.\n\nThird paragraph."
    assert summary(doc, 0) == "First line\nof the first paragraph."
    assert summary(doc, 45) == "First line\nof the first paragraph.\n\nSecond."
    long = "Sentence one is here. " * 40
    cut = summary(long)
    assert cut.endswith("here.") and len(cut) <= 600 and long.startswith(cut)


def test_unknown_demo_region_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="no demo corpus for \\['xx'\\]; known: eu, cn, us"):
        write_demo_corpora(tmp_path, ("eu", "xx"))


def test_demo_chats_render_prefix_stably_with_the_presets_template(demo_root):
    tok = byte_tokenizer()

    def render(turns, prompt):
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt)
        assert isinstance(text, str)
        return text

    chats = [r[MESSAGES] for name, r in records(demo_root / "cn") if name == CHAT_FILE]
    for turns in chats[:200]:
        whole = render(turns, False)
        for i, turn in enumerate(turns):
            if turn[ROLE] == ASSISTANT:
                assert whole.startswith(render(turns[:i], True))
