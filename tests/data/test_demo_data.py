from __future__ import annotations

import collections
import json
import re

import pytest

from fedciuic.data.demo import write_demo_corpora
from fedciuic.errors import ConfigError


def words(path):
    text = " ".join(json.loads(line)["text"] for line in path.read_text().splitlines())
    return collections.Counter(re.findall(r"[a-z]{4,}", text.lower()))


def test_demo_corpora_are_deterministic(tmp_path):
    write_demo_corpora(tmp_path / "a", ("eu", "cn"))
    write_demo_corpora(tmp_path / "b", ("eu", "cn"))
    for region in ("eu", "cn"):
        a = (tmp_path / "a" / region / "docs.jsonl").read_bytes()
        assert a == (tmp_path / "b" / region / "docs.jsonl").read_bytes()
        assert len(a) > 50_000


def test_regions_really_differ_in_vocabulary(demo_root):
    top = {
        r: {w for w, _ in words(demo_root / r / "docs.jsonl").most_common(200)}
        for r in ("eu", "cn", "us")
    }
    for a, b in (("eu", "cn"), ("eu", "us"), ("cn", "us")):
        overlap = len(top[a] & top[b]) / 200
        assert overlap < 0.6, (a, b, overlap)
    assert "message" in top["eu"] and "decimal" in top["cn"] and "process" in top["us"]


def test_unknown_demo_region_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError, match="no demo corpus for \\['xx'\\]; known: eu, cn, us"):
        write_demo_corpora(tmp_path, ("eu", "xx"))
