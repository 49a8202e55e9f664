"""The defaults the README and docs state are the code's.

A run takes its defaults from pyproject.toml's ``[tool.flwr.app.config]``; code that
builds a ``RunConfig`` without them gets the model's own field defaults; a deployed
region's agent gets ``AgentConfig``'s. Every table of defaults in the docs is read here
and compared with those, so that a default changed in the code fails until the docs
say the same. Nothing below restates a default by hand.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from fedciuic.agent.config import AgentConfig
from fedciuic.config import RUN_KEYS, NodeConfig, RunConfig, run_key_required
from tests.conftest import ROOT, app_config

README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: (file, the section it is under or None, the first header cell) of each table of
#: run-config defaults.
RUN_CONFIG_TABLES = [
    (README, "## Configuration", "key"),
    (DOCS / "privacy.md", None, "run config"),
    (DOCS / "heterogeneity.md", None, "setting"),
]
#: Tables of agent-config defaults (a deployed region's own file).
AGENT_CONFIG_TABLES = [
    (DOCS / "privacy.md", None, "agent config"),
    (DOCS / "cluster.md", "### The agent config", "key"),
]
RUN_IDS = ["README", "privacy", "heterogeneity"]
AGENT_IDS = ["privacy", "cluster"]
#: A stated default of the model's own, inside a cell's remark: "(RunConfig default `x`)".
MODEL_DEFAULT = re.compile(r"`?RunConfig`? default (`[^`]*`|\S+?)\)?(?:[,;]|$)")
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
NOT_SET = object()


# -- reading the tables ------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    """A Markdown table row's cells (no cell in these tables holds a ``|``)."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def default_tables(path: Path, section: str | None, first: str) -> list[tuple[int, str, str]]:
    """(line, keys cell, defaults cell) of every row of the tables in ``path`` (under
    the heading ``section``, if given) whose header is ``| first | default | ...``."""
    lines = path.read_text(encoding="utf-8").splitlines()
    start = 0
    if section is not None:
        start = next(i for i, line in enumerate(lines) if line.strip() == section)
    rows: list[tuple[int, str, str]] = []
    inside = False
    for number, line in enumerate(lines[start:], start + 1):
        if (
            section is not None
            and number > start + 1
            and re.match(rf"#{{1,{section.count('#')}}} ", line)
        ):
            break  # the next heading of the same or a higher level
        if not line.startswith("|"):
            inside = False
            continue
        cells = _cells(line)
        if cells[:2] == [first, "default"]:
            inside = True
        elif inside and not set(cells[0]) <= set("-: "):
            rows.append((number, cells[0], cells[1]))
    assert rows, f"{path.name}: no table headed | {first} | default | (section {section})"
    return rows


def split_top(cell: str) -> list[str]:
    """A cell's items, split at ``, `` and `` / `` outside backticks and parentheses
    (``10,000,000`` and ```"eu,cn,us"``` stay whole)."""
    items, depth, quoted, current = [], 0, False, ""
    i = 0
    while i < len(cell):
        char = cell[i]
        if char == "`":
            quoted = not quoted
        elif not quoted and char == "(":
            depth += 1
        elif not quoted and char == ")":
            depth -= 1
        if not quoted and depth == 0:
            for separator in (", ", " / "):
                if cell.startswith(separator, i):
                    items.append(current.strip())
                    current = ""
                    i += len(separator)
                    break
            else:
                current += char
                i += 1
            continue
        current += char
        i += 1
    items.append(current.strip())
    return items


def keys_of(cell: str) -> list[str]:
    keys = [item.strip("`") for item in split_top(cell)]
    assert all(re.fullmatch(r"[a-z][a-z0-9-]*", k) for k in keys), f"not keys: {cell!r}"
    return keys


def leading(item: str) -> tuple[str, str]:
    """An item's value and its remark: ```""` (= the aggregator's)`` gives ``""``."""
    match = re.fullmatch(r"(`[^`]*`|[^(]*?)\s*(?:\((.*)\))?", item.strip())
    assert match, f"cannot read {item!r}"
    return match.group(1).strip(), match.group(2) or ""


def value(text: str) -> Any:
    """A documented value as Python: booleans, numbers (``1e-5``, ``10,000,000``,
    ``256 MiB``), quoted or bare strings, ``""``."""
    text = text.strip()
    if text.startswith("`") and text.endswith("`"):
        text = text[1:-1]
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    number = re.fullmatch(r"([0-9][0-9,]*(?:\.[0-9]+)?(?:e-?[0-9]+)?)\s*([KMGT]iB)?", text)
    if number and (
        "," not in number.group(1) or re.fullmatch(r"[0-9]{1,3}(,[0-9]{3})+", number.group(1))
    ):
        digits = number.group(1).replace(",", "")
        scale = UNITS[number.group(2)] if number.group(2) else 1
        parsed = float(digits) if re.search(r"[.e]", digits) else int(digits)
        return parsed * scale
    return text


def same(documented: Any, actual: Any) -> bool:
    if isinstance(actual, bool) or isinstance(documented, bool):
        return documented is actual
    if isinstance(actual, int | float):
        return isinstance(documented, int | float) and math.isclose(documented, actual)
    return bool(documented == actual)


def documented(rows: list[tuple[int, str, str]], where: str) -> dict[str, tuple[str, Any, str]]:
    """key -> (where, documented default, remark), one per key, from a table's rows."""
    found: dict[str, tuple[str, Any, str]] = {}
    for line, keys_cell, defaults_cell in rows:
        keys = keys_of(keys_cell)
        defaults = split_top(defaults_cell)
        assert len(keys) == len(defaults), (
            f"{where}:{line}: {len(keys)} key(s) {keys} but {len(defaults)} default(s) "
            f"{defaults}: give one default per key, in order"
        )
        for key, item in zip(keys, defaults, strict=True):
            assert key not in found, f"{where}:{line}: {key} is listed twice"
            text, remark = leading(item)
            found[key] = (f"{where}:{line}", value(text), remark)
    return found


def table(path: Path, section: str | None, first: str) -> dict[str, tuple[str, Any, str]]:
    return documented(default_tables(path, section, first), path.name)


# -- what the code says ------------------------------------------------------------------


def aliases(model: type[Any]) -> dict[str, str]:
    """kebab-case key -> field name."""
    return {field.alias or name: name for name, field in model.model_fields.items()}


def app_defaults() -> dict[str, Any]:
    """pyproject.toml's run config: what every run starts from."""
    return app_config()


def model_defaults() -> dict[str, Any]:
    """``RunConfig``'s own defaults, as a run config writes them (kebab-case keys, JSON
    values: a codec by its name, a region table as ``eu=2``); NOT_SET where a field has
    none. Built from the app's values for the required fields only."""
    required = {key: v for key, v in app_defaults().items() if run_key_required(key)}
    values = json.loads(RunConfig.from_user_config(required, source="test").canonical_json())
    return {key: (NOT_SET if run_key_required(key) else values[key]) for key in RUN_KEYS}


def app_values_as_model_writes_them() -> dict[str, Any]:
    """The app's run config through the model, so that ``""`` and ``()`` compare equal."""
    values: dict[str, Any] = json.loads(
        RunConfig.from_user_config(app_defaults(), source="pyproject.toml").canonical_json()
    )
    return values


# -- the README's run-config table -------------------------------------------------------


def test_the_readme_lists_every_run_config_key_and_no_other():
    listed = table(README, "## Configuration", "key")
    app = app_defaults()
    missing = sorted(set(app) - set(listed))
    assert not missing, (
        f"README.md ## Configuration does not list {missing} (pyproject.toml has them)"
    )
    unknown = sorted(set(listed) - set(RUN_KEYS))
    assert not unknown, f"README.md lists {unknown}, which RunConfig does not have"


@pytest.mark.parametrize(("path", "section", "first"), RUN_CONFIG_TABLES, ids=RUN_IDS)
def test_each_documented_run_config_default_is_the_apps(path, section, first):
    """Each default stated in a run-config table is pyproject.toml's value for that key."""
    app = app_defaults()
    wrong = []
    for key, (where, stated, _) in table(path, section, first).items():
        assert key in RUN_KEYS, f"{where}: {key} is not a RunConfig key"
        assert key in app, f"{where}: {key} is not in pyproject.toml's [tool.flwr.app.config]"
        if not same(stated, app[key]):
            wrong.append(
                f"{where}: {key} documented as {stated!r}, pyproject.toml has {app[key]!r}"
            )
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(("path", "section", "first"), RUN_CONFIG_TABLES, ids=RUN_IDS)
def test_a_model_default_that_differs_from_the_apps_is_stated_and_right(path, section, first):
    """Where RunConfig's own default differs from pyproject.toml's (privacy-unit: the app
    asks for user, the model keeps record), the table says both; any "RunConfig default"
    it states is the model's."""
    model = model_defaults()
    app = app_values_as_model_writes_them()
    problems = []
    for key, (where, _, remark) in table(path, section, first).items():
        stated = MODEL_DEFAULT.search(remark)
        own = model[key]
        if stated is not None:
            if own is NOT_SET:
                problems.append(f"{where}: {key}: RunConfig has no default, the docs give one")
            elif not same(value(stated.group(1)), own):
                problems.append(
                    f"{where}: {key}: RunConfig default documented as {value(stated.group(1))!r}, "
                    f"the model has {own!r}"
                )
        elif own is not NOT_SET and not same(own, app[key]):
            problems.append(
                f"{where}: {key}: RunConfig's default {own!r} differs from pyproject.toml's "
                f"{app[key]!r}; add '(RunConfig default ...)' to the default cell"
            )
    assert not problems, "\n".join(problems)


# -- the agent config (a deployed region's own defaults) ---------------------------------


@pytest.mark.parametrize(("path", "section", "first"), AGENT_CONFIG_TABLES, ids=AGENT_IDS)
def test_each_documented_agent_config_default_is_the_agents(path, section, first):
    names = aliases(AgentConfig)
    wrong = []
    for key, (where, stated, _) in table(path, section, first).items():
        assert key in names, f"{where}: {key} is not an agent config key"
        field = AgentConfig.model_fields[names[key]]
        if stated == "required" or field.is_required():
            if not (stated == "required" and field.is_required()):
                wrong.append(
                    f"{where}: {key} documented as {stated!r}, required: {field.is_required()}"
                )
            continue
        own = field.get_default()
        if key == "state-path" and own == "":
            # Empty means derived from data-path: check the rule the docs state.
            derived = NodeConfig(region="eu", data_path="/srv/eu").state_dir
            rule = str(stated).lower().replace("data_path", "data-path").rstrip("/")
            if derived != Path("/srv/eu") / rule.removeprefix("data-path/"):
                wrong.append(f"{where}: state-path documented as {stated!r}, derived as {derived}")
            continue
        if not same(stated, own):
            wrong.append(f"{where}: {key} documented as {stated!r}, AgentConfig has {own!r}")
    assert not wrong, "\n".join(wrong)


# -- defaults named in prose -------------------------------------------------------------


def _prose(path: Path) -> str:
    """A file's text without the generated benchmark table (it names the codec that was
    the default when it was measured)."""
    text = path.read_text(encoding="utf-8")
    return re.sub(r"<!-- results:start -->.*?<!-- results:end -->", "", text, flags=re.S)


def test_the_default_codec_named_in_the_docs_is_the_run_configs():
    codec = app_defaults()["codec"]
    said = []
    for path in [README, *sorted(DOCS.glob("*.md"))]:
        text = _prose(path)
        for pattern in (
            r"default codec,?\s+`([^`]+)`",
            r"`([a-z0-9-]+:[0-9.]+)`\s+\(the default\)",
        ):
            said += [(path.name, m.group(1)) for m in re.finditer(pattern, text)]
    assert ("README.md", codec) in said, f"the README does not name the default codec {codec}"
    wrong = [f"{name}: {named}" for name, named in said if named != codec]
    assert not wrong, f"named as the default codec, but the run config's is {codec}: {wrong}"


def test_policy_hashes_in_sample_outputs_are_the_shipped_policies():
    """A sample output's policy hash (``policies/cn-pipl.yaml (87e7de02e9be)``, the
    summary's ``policies (aggregator in EU): CN ...``) is the shipped file's today."""
    from fedciuic.policy.rules import load_policies, load_policy

    shipped = {j: p.hash[:12] for j, p in load_policies(ROOT / "policies").by_jurisdiction.items()}
    wrong, seen = [], 0
    for path in [README, ROOT / "policies" / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"(policies/[a-z/-]+\.yaml) \(([0-9a-f]{12})\)", text):
            seen += 1
            actual = load_policy(ROOT / m.group(1)).hash[:12]
            if m.group(2) != actual:
                wrong.append(f"{path.name}: {m.group(1)} shown as {m.group(2)}, is {actual}")
        for m in re.finditer(r"policies \(aggregator in [A-Z]+\): (.+)", text):
            for j, shown in re.findall(r"([A-Z]{2,3}) ([0-9a-f]{12})", m.group(1)):
                seen += 1
                if shipped.get(j) != shown:
                    wrong.append(f"{path.name}: {j} shown as {shown}, is {shipped.get(j)}")
    assert seen, "no policy hash found in the docs: has the sample output moved?"
    assert not wrong, "\n".join(wrong)


def test_data_check_defaults_to_the_seq_len_training_uses(monkeypatch, tmp_path):
    """`fedciuic data check` without --seq-len checks at the run config's seq-len (the
    README and docs/data.md say so), not at a length of its own."""
    import fedciuic.data.check as check
    import fedciuic.model.adapter as adapter
    from fedciuic.ops.cli import main

    seen: dict[str, Any] = {}

    class Checked:
        ok = True

        def lines(self, _user_id: str) -> list[str]:
            return []

    def fake_check(*_args: Any, **kwargs: Any) -> Checked:
        seen.update(kwargs)
        return Checked()

    monkeypatch.setattr(check, "check_data", fake_check)
    monkeypatch.setattr(adapter, "spec_tokenizer", lambda _spec: None)
    monkeypatch.chdir(ROOT)
    assert main(["data", "check", str(tmp_path)]) == 0
    assert seen["seq_len"] == app_defaults()["seq-len"]
