"""Checks on the launching machine, in seconds, before a federation starts anything.

A problem a region would only meet minutes into a run (the model, its tokenizer, the
chat template, the region's data) is found here instead, each named with its fix. A
convenience of the launcher only: each region's agent still checks everything itself.
"""

from __future__ import annotations

import argparse
import sys
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedciuic.agent import AgentConfig
from fedciuic.config import RunConfig, simulated_dictionary
from fedciuic.errors import ConfigError, DataError, ModelError
from fedciuic.ops.runconfig import app_run_config, parse_overrides

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fedciuic.config import ModelSpec


class PreflightError(ConfigError):
    """Every problem found before anything started, one per line."""

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return self.problems[0]
        lines = "\n".join(f"  {problem}" for problem in self.problems)
        return f"{len(self.problems)} problems, found before anything started:\n{lines}"


@dataclass
class Findings:
    """What the checks found: problems (nothing may start), warnings, and what was seen."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)  # what was checked, for the summary line

    def problem(self, text: str) -> None:
        if text not in self.problems:
            self.problems.append(text)

    def warning(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)


@dataclass(frozen=True)
class RegionFolder:
    """A region's data as this machine sees it, and (deployed) its own pickle word."""

    region: str
    path: Path
    #: A deployed region's agent config's allow-pickle-weights (None: simulated, the run's).
    allow_pickle_weights: bool | None = None
    source: str = ""  # the agent config it was read from, if any
    #: A deployed region's agent config's max-record-bytes (None: simulated, the run's).
    max_record_bytes: int | None = None


# -- the model ----------------------------------------------------------------------------


def _where(spec: ModelSpec) -> str:
    if spec.model_path:
        return f"run config:model-path: {Path(spec.model_path).expanduser()}"
    return f"run config:model-preset: {spec.model_preset}"


def check_model(spec: ModelSpec, findings: Findings) -> PreTrainedTokenizerBase | None:
    """The model's problems into ``findings``; the tokenizer, if it loads."""
    from fedciuic.model import adapter, preset_tokenizer

    path = Path(spec.model_path).expanduser()
    try:
        if not spec.model_path:
            adapter.check_model_spec(spec)
            tokenizer: PreTrainedTokenizerBase = preset_tokenizer(spec.model_preset)
            findings.seen.append(f"model-preset {spec.model_preset}")
            return tokenizer
        findings.seen.append(f"model-path {path}")
        config = adapter.checkpoint_config(path)
        allow_pickle = spec.allow_pickle_weights
        for problem in adapter.weight_problems(path, config, allow_pickle=allow_pickle):
            findings.problem(problem)
        tokenizer = adapter.open_tokenizer(path)
    except ModelError as err:
        findings.problem(str(err))
        return None
    for problem in adapter.tokenizer_problems(path, config, tokenizer):
        findings.problem(problem)
    for warning in adapter.tokenizer_warnings(path, config, tokenizer):
        findings.warning(warning)
    return tokenizer


def check_template(
    tokenizer: PreTrainedTokenizerBase, where: str, chat: bool | None, findings: Findings
) -> bool:
    """Whether the template masks; if not, a problem for chat records, a warning for unseen data."""
    from fedciuic.data import check_chat_template

    if chat is False or (chat is None and not getattr(tokenizer, "chat_template", None)):
        return True
    try:
        check_chat_template(tokenizer)
    except DataError as err:
        if chat:
            findings.problem(f"{where}: {err}")
        else:
            findings.warning(
                f"{where}: {err}; regions whose records are chat records will refuse them"
            )
        return False
    findings.seen.append("chat template")
    return True


def check_pickle_permissions(
    spec: ModelSpec, regions: Sequence[RegionFolder], findings: Findings
) -> None:
    """A deployed region whose agent config refuses pickle-only weights declines every round."""
    from fedciuic.model import weight_files

    path = Path(spec.model_path).expanduser()
    if not spec.model_path or not path.is_dir():
        return
    safe, pickles = weight_files(path)
    if safe or not pickles:
        return
    for folder in regions:
        if folder.allow_pickle_weights is False:
            findings.problem(
                f"region {folder.region}: {folder.source}:allow-pickle-weights: false, and the "
                f"weights of {path} are only pickle files: the region will refuse them; convert "
                "them to safetensors, or set allow-pickle-weights = true in that agent config "
                "if the region trusts them (then restart its agent)"
            )


# -- the data -----------------------------------------------------------------------------


def check_region(
    run: RunConfig,
    folder: RegionFolder,
    tokenizer: PreTrainedTokenizerBase | None,
    findings: Findings,
    *,
    sample: int,
) -> tuple[bool, bool, str | None]:
    """One region's data into ``findings``: (has data, has chat records, a render error)."""
    from fedciuic.data import CHAT, NoDataFiles, bad_rows_refusal, scan_data, users_refusal
    from fedciuic.model import preset_tokenizer

    name = folder.region
    if run.deid.deidentify:  # as a simulated region: its dictionary and entity types
        from fedciuic.data import check_deid

        try:
            check_deid(run.deid, dictionary=simulated_dictionary(run, name), ner_model="")
        except ConfigError as err:
            findings.problem(f"region {name}: {err}")
    try:
        root, scanned = scan_data(
            folder.path,
            tokenizer or preset_tokenizer("tiny"),
            seq_len=run.training.seq_len,
            fields=run.fields,
            sample=sample if tokenizer is not None else 0,
            truncation_side=run.data.truncation_side,
            max_record_bytes=folder.max_record_bytes or run.data.max_record_bytes,
        )
    except NoDataFiles as err:
        findings.warning(f"region {name}: {err}: region {name} will decline")
        return False, False, None
    except DataError as err:
        findings.problem(f"region {name}: {err}")
        return True, False, None
    summary = scanned.summary
    findings.seen.append(f"{name} ({summary.records:,} records, {scanned.sampled} tokenised)")
    for message in scanned.unreadable:
        findings.problem(f"region {name}: data-path {root}: {message}")
    for refusal in (bad_rows_refusal, users_refusal):
        if (problem := refusal(run, name, root, summary)) is not None:
            findings.problem(problem)
    if summary.bad_rows and run.data.bad_rows == "skip":
        findings.warning(
            f"region {name}: {summary.bad_rows} bad row(s) in data-path {root} will be skipped "
            '(bad-rows = "skip"); `fedciuic data check` lists them'
        )
    if summary.oversized:
        from fedciuic.data import dropped_for_size

        dropped = f"region {name}: data-path {root}: {dropped_for_size(summary)}"
        if summary.records:
            findings.warning(dropped)
        else:
            findings.problem(
                f"{dropped}; no record is left: raise max-record-bytes (a deployed "
                "region's own is in its agent.toml)"
            )
    elif not summary.records and not summary.bad_rows and not scanned.unreadable:
        findings.problem(
            f"region {name}: data-path {root} holds no records (its files are empty); add the "
            "region's records there"
        )
    whole = scanned.sampled == summary.records and scanned.render_error is None
    if whole and summary.records and not summary.examples:
        from fedciuic.data import dropped_for_length

        findings.problem(
            f"region {name}: data-path {root}: no record leaves anything to train on within "
            f"seq-len {run.training.seq_len}; "
            + (
                dropped_for_length(summary, run.training.seq_len, run.data.truncation_side)
                or "add records"
            )
        )
    return True, summary.shapes.get(CHAT, 0) > 0, scanned.render_error


# -- everything ---------------------------------------------------------------------------


def preflight(
    run: RunConfig, regions: Sequence[RegionFolder] | None, *, chat: bool | None = None
) -> Findings:
    """Every check, every problem: the model, the chat template and ``regions``' data
    (None: none is visible here). ``chat``: chat records are known to come (the demo
    data's are) whatever the visible data says."""
    from fedciuic.data import SCAN_SAMPLE

    findings = Findings()
    spec = run.model
    tokenizer = check_model(spec, findings)
    render_errors: list[str] = []
    if regions is not None:
        present = chat_seen = False
        for folder in regions:
            has_data, has_chat, render_error = check_region(
                run, folder, tokenizer, findings, sample=SCAN_SAMPLE
            )
            present |= has_data
            chat_seen |= has_chat
            if render_error is not None:
                render_errors.append(render_error)
        if regions and not present:
            findings.problem(
                "no region has data files ("
                + ", ".join(f"{f.region}: {f.path}" for f in regions)
                + "); put each region's records in its folder"
            )
        chat = chat_seen or bool(chat)
        check_pickle_permissions(spec, regions, findings)
    if tokenizer is not None and check_template(tokenizer, _where(spec), chat, findings):
        for error in render_errors:  # (what the template check found otherwise covers them)
            findings.problem(f"{_where(spec)}: {error}")
    return findings


def report(findings: Findings, started: float, *, quiet: bool = False) -> None:
    """Warnings to stderr, then :class:`PreflightError` or (unless ``quiet``) what was checked."""
    for warning in findings.warnings:
        print(f"fedciuic: warning: {warning}", file=sys.stderr)
    if findings.problems:
        raise PreflightError(findings.problems)
    if not quiet:
        print(
            f"preflight: ok: {', '.join(findings.seen) or 'nothing to check'} "
            f"({time.monotonic() - started:.1f} s)"
        )


def check_simulation(run: RunConfig, folders: Sequence[RegionFolder] | None) -> None:
    """``fedciuic simulate``'s checks (``folders`` None: the fresh demo corpora, chat records)."""
    started = time.monotonic()
    report(preflight(run, folders, chat=True if folders is None else None), started, quiet=True)


def region_folders(root: Path, regions: Sequence[str]) -> list[RegionFolder]:
    """Each region's folder under ``--data-root``; one without is said now (it will decline)."""
    for region in (r for r in regions if not (root / r).is_dir()):
        print(
            f"fedciuic: warning: --data-root: no folder {root / region}: region {region} "
            "will decline",
            file=sys.stderr,
        )
    return [RegionFolder(r, root / r) for r in regions if (root / r).is_dir()]


# -- fedciuic preflight -------------------------------------------------------------------


def flwr_run_config(args: Sequence[str]) -> dict[str, Any]:
    """The ``--run-config`` (``-c``) values among ``flwr run`` arguments, by Flower's parser."""
    import click
    from flwr.common.config import parse_config_args

    values: dict[str, Any] = {}
    items = list(args)
    for i, arg in enumerate(items):
        if arg in ("--run-config", "-c") and i + 1 < len(items):
            text = items[i + 1]
        elif arg.startswith("--run-config="):
            text = arg.partition("=")[2]
        else:
            continue
        try:
            values.update(parse_config_args([text]))
        except (OSError, ValueError, click.ClickException) as err:
            why = err.strerror if isinstance(err, OSError) else str(err)
            raise ConfigError([f"--run-config {text!r}: {why}"]) from None
    return values


def _toml_file(path: Path, option: str) -> dict[str, Any]:
    try:
        with open(path.expanduser(), "rb") as handle:
            return dict(tomllib.load(handle))
    except OSError as err:
        raise ConfigError([f"{option}: {path}: cannot read ({err.strerror})"]) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError([f"{option}: {path}: not TOML ({err})"]) from None


def preflight_command(args: argparse.Namespace) -> int:
    """``fedciuic preflight``: the run config as the run will get it, then every check."""
    started = time.monotonic()
    if args.data_root is not None and args.agent_config:
        raise ConfigError(["fedciuic preflight: give --data-root or --agent-config, not both"])
    values = app_run_config(args.app.resolve())
    if args.run_config_file is not None:
        values.update(_toml_file(args.run_config_file, "--run-config-file"))
    values.update(parse_overrides(args.run_config))
    values.update(flwr_run_config(args.flwr_args))
    run = RunConfig.from_user_config(values, source="run config")
    folders: list[RegionFolder] | None = None
    problems: list[str] = []
    if args.data_root is not None:
        folders = region_folders(args.data_root.resolve(), run.regions)
    elif args.agent_config:
        folders = []
        for file in args.agent_config:
            try:
                agent = AgentConfig.load(file)
            except ConfigError as err:
                problems += err.problems
                continue
            folders.append(
                RegionFolder(
                    agent.region,
                    Path(agent.data_path),
                    agent.allow_pickle_weights,
                    str(file),
                    agent.max_record_bytes,
                )
            )
    findings = preflight(run, folders)
    findings.problems[:0] = problems
    report(findings, started)
    return 0
