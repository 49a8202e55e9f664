"""Bad input is found on the launching machine, in seconds, before anything starts:
`fedciuic simulate` and a deployment's start.sh exit 2 naming every problem (a
checkpoint without its tokenizer or with another one, a chat template that cannot be
masked, pickle-only weights, data that cannot be read), with real files on disk and no
Flower process started."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from fedciuic.config import RunConfig
from fedciuic.data.demo import CHAT_FILE, write_demo_corpora
from fedciuic.model.adapter import open_tokenizer
from fedciuic.ops.cli import main
from fedciuic.ops.preflight import RegionFolder, flwr_run_config, preflight
from tests.conftest import ROOT, unit_config
from tests.model.test_checkpoint_checks import copy_checkpoint, pickle_only

#: A chat template whose generation prompt is not how it writes an assistant turn.
UNMASKABLE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ANSWER:{% endif %}"
)
#: Seconds within which a refusal must come (the run it replaces took minutes).
SECONDS = 30


@pytest.fixture(scope="module")
def checkpoints(
    tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny qwen2 checkpoint as it is, and broken in each way a user breaks one."""
    good = tiny_checkpoints["qwen2"]
    root = tmp_path_factory.mktemp("bad-checkpoints")
    no_tokenizer = copy_checkpoint(good, root / "no-tokenizer")
    for file in no_tokenizer.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            file.unlink()
    mismatched = copy_checkpoint(good, root / "mismatched")
    tokenizer = open_tokenizer(mismatched)  # extended, the model's embedding not resized
    tokenizer.add_tokens([f"<extra-{i}>" for i in range(64)])
    tokenizer.save_pretrained(mismatched)
    unmaskable = copy_checkpoint(good, root / "unmaskable")
    (unmaskable / "chat_template.jinja").write_text(UNMASKABLE, encoding="utf-8")
    return {
        "good": good,
        "no-tokenizer": no_tokenizer,
        "mismatched": mismatched,
        "unmaskable": unmaskable,
        "pickle-only": pickle_only(good, root / "pickle-only"),
    }


@pytest.fixture
def no_federation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to start Flower fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a federation was started")

    monkeypatch.setattr("fedciuic.flower.LocalFederation", refuse)


def simulate(out: Path, data_root: Path | None, *args: str) -> int:
    data = ["--data-root", str(data_root)] if data_root is not None else []
    return main(["simulate", "--app", str(ROOT), "--output-dir", str(out), "--quiet", *data, *args])


def model_path(path: Path) -> list[str]:
    return ["--run-config", f"model-path='{path}'"]


def _run(**changes: object) -> RunConfig:
    return RunConfig.from_user_config({**unit_config(), **changes}, source="test")


@pytest.mark.parametrize(
    ("broken", "says"),
    [
        ("no-tokenizer", "no-tokenizer: no usable tokenizer (none of tokenizer.json"),
        ("mismatched", "the tokenizer has 1088 tokens (ids up to 1087), the model's vocabulary"),
        ("unmaskable", "the model's chat template cannot be masked for training"),
        ("pickle-only", "its weights are only pickle files (pytorch_model.bin)"),
    ],
)
@pytest.mark.parametrize("data", ["demo-data", "data-root"])
def test_simulate_refuses_a_broken_checkpoint_in_seconds_before_starting_anything(
    checkpoints, demo_root, tmp_path, capsys, no_federation, broken, says, data
):
    start = time.monotonic()
    code = simulate(
        tmp_path / "runs",
        demo_root if data == "data-root" else None,
        *model_path(checkpoints[broken]),
    )
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2, err
    assert took < SECONDS
    (line,) = [line for line in err.splitlines() if line.startswith("fedciuic: error: ")]
    assert line.startswith(f"fedciuic: error: run config:model-path: {checkpoints[broken]}")
    assert says in line
    assert "Traceback" not in err
    assert not (tmp_path / "runs" / ".flower").exists()  # no workdir, no demo data, no keys


def test_pickle_only_weights_load_in_simulation_when_the_run_config_allows_them(
    checkpoints, demo_root, tmp_path, no_federation
):
    run = _run(**{"model-path": str(checkpoints["pickle-only"])})
    folders = [RegionFolder(r, demo_root / r) for r in ("eu", "cn")]
    assert any("only pickle" in p for p in preflight(run, folders).problems)
    allowing = run.updated(**{"allow_pickle_weights": True})
    assert preflight(allowing, folders).problems == []


@pytest.fixture
def data_root(demo_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "data"
    shutil.copytree(demo_root, root, ignore=shutil.ignore_patterns(".fedciuic"))
    return root


def test_simulate_refuses_region_data_that_cannot_be_read_naming_every_problem(
    checkpoints, data_root, tmp_path, capsys, no_federation
):
    (data_root / "eu" / "extra.parquet").write_bytes(b"not a parquet file")
    with open(data_root / "cn" / "instructions.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"prompt": "an unterminated string\n')
    start = time.monotonic()
    code = simulate(tmp_path / "runs", data_root, *model_path(checkpoints["no-tokenizer"]))
    assert time.monotonic() - start < SECONDS
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert lines[0] == "fedciuic: error: 3 problems, found before anything started:"
    assert lines[1].startswith(f"  run config:model-path: {checkpoints['no-tokenizer']}: no usable")
    assert lines[2] == (
        f"  region eu: data-path {data_root / 'eu'}: extra.parquet: cannot be read as parquet "
        "(Parquet magic bytes not found in footer. Either the file is corrupted or this is "
        "not a parquet file.); check the file (`fedciuic data check` lists what it reads)"
    )
    assert lines[3].startswith(f"  region cn: 1 bad row(s) in data-path {data_root / 'cn'}: ")
    assert "instructions.jsonl:" in lines[3] and "invalid JSON" in lines[3]
    assert 'or set bad-rows = "skip"' in lines[3]
    assert not (tmp_path / "runs" / ".flower").exists()


def test_an_unreadable_file_is_named_with_its_permission_problem(data_root, tmp_path):
    import os

    if os.geteuid() == 0:
        pytest.skip("root reads every file")
    broken = data_root / "us" / "docs.jsonl"
    broken.chmod(0)
    problems = preflight(_run(), [RegionFolder("us", data_root / "us")]).problems
    assert problems == [
        f"region us: data-path {data_root / 'us'}: docs.jsonl: cannot read (Permission denied); "
        "check its permissions"
    ]


def test_good_input_passes_and_the_checks_read_every_row_but_tokenise_a_sample(
    checkpoints, demo_root, capsys
):
    run = _run(**{"model-path": str(checkpoints["good"])})
    findings = preflight(run, [RegionFolder(r, demo_root / r) for r in ("eu", "cn", "us")])
    assert findings.problems == [] and findings.warnings == []
    assert any(
        s.startswith("eu (1,") and s.endswith(" records, 256 tokenised)") for s in findings.seen
    )
    assert "chat template" in findings.seen


def test_a_malformed_dictionary_or_ner_only_type_is_named_before_anything_starts(
    data_root, tmp_path
):
    names = tmp_path / "dictionaries"
    names.mkdir()
    (names / "eu.txt").write_text("Zhang Wei\nX\n", encoding="utf-8")
    folders = [RegionFolder("eu", data_root / "eu"), RegionFolder("cn", data_root / "cn")]
    problems = preflight(_run(**{"deid-dictionaries": str(names)}), folders).problems
    assert problems == [
        f"region eu: {names / 'eu.txt'}:2: entry of 1 character(s), the least is 2; one name "
        "per line, # for a comment (docs/deidentification.md)"
    ]
    person = preflight(_run(**{"deid-entities": "direct,PERSON"}), folders[:1]).problems
    assert person == [
        "region eu: deid-entities: PERSON can only be found by a NER model: name one the "
        "region installed in its deid-ner-model (agent config), or drop them from deid-entities"
    ]


def test_bad_rows_skipped_and_records_without_users_follow_the_run_config(data_root):
    with open(data_root / "eu" / "docs.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"text": 5, "user_id": "x"}\n{"text": "no user here"}\n')
    folders = [RegionFolder("eu", data_root / "eu")]
    skipping = preflight(_run(**{"bad-rows": "skip"}), folders)
    assert skipping.problems == [
        f"region eu: 1 record(s) in {data_root / 'eu'} name no user, e.g. docs.jsonl:"
        + skipping.problems[0].split("docs.jsonl:", 1)[1]
    ]
    assert 'privacy-unit = "record"' in skipping.problems[0]
    assert "1 bad row(s)" in skipping.warnings[0] and "will be skipped" in skipping.warnings[0]
    lenient = preflight(_run(**{"bad-rows": "skip", "privacy-unit": "record"}), folders)
    assert lenient.problems == []


def test_an_unmaskable_template_is_a_problem_only_where_chat_records_need_it(
    checkpoints, data_root
):
    run = _run(**{"model-path": str(checkpoints["unmaskable"])})
    for region in ("eu", "cn", "us"):
        (data_root / region / CHAT_FILE).unlink()  # prompt/response, Alpaca and text remain
    folders = [RegionFolder(r, data_root / r) for r in ("eu", "cn", "us")]
    assert preflight(run, folders).problems == []
    unseen = preflight(run, None)  # no data visible: a warning, the checkpoint may be fine
    assert unseen.problems == []
    (warning,) = unseen.warnings
    assert "cannot be masked" in warning and "chat records will refuse them" in warning
    write_demo_corpora(data_root / "chat-again", ("eu",))
    folders.append(RegionFolder("eu2", data_root / "chat-again" / "eu"))
    (problem,) = preflight(run, folders).problems
    assert problem.startswith(f"run config:model-path: {checkpoints['unmaskable']}: the model's")


def test_an_empty_region_declines_with_a_warning_and_no_data_anywhere_is_a_problem(
    data_root, tmp_path
):
    (tmp_path / "empty").mkdir()
    folders = [RegionFolder("eu", data_root / "eu"), RegionFolder("us", tmp_path / "empty")]
    found = preflight(_run(), folders)
    assert found.problems == []
    assert found.warnings == [
        f"region us: data-path {tmp_path / 'empty'} holds no data files (.jsonl, .json, .csv, "
        ".parquet, .txt or a save_to_disk folder); add the region's records there: region us "
        "will decline"
    ]
    (problem,) = preflight(_run(), folders[1:]).problems
    assert problem == (
        f"no region has data files (us: {tmp_path / 'empty'}); put each region's records "
        "in its folder"
    )


# -- fedciuic preflight, and start.sh -------------------------------------------------------


def test_flwr_run_config_values_are_read_as_flwr_reads_them(tmp_path):
    file = tmp_path / "over.toml"
    file.write_text('seq-len = 64\nmodel-path = "/x"\n')
    args = [
        "--stream",
        "--run-config",
        "num-server-rounds=5 model-path='/a b' dp=false",
        "-c",
        "lora-rank=4",
        "--run-config=seed=3",
    ]
    assert flwr_run_config(args) == {
        "num-server-rounds": 5,
        "model-path": "/a b",
        "dp": False,
        "lora-rank": 4,
        "seed": 3,
    }
    assert flwr_run_config(["--run-config", str(file)]) == {"seq-len": 64, "model-path": "/x"}


def _agent_toml(path: Path, data: Path, allow: bool) -> Path:
    path.write_text(
        f'region = "{path.stem}"\ndata-path = "{data}"\nkey-file = "k"\n'
        f'aggregator-bundle = "a"\npolicy = "p"\nsocket = "s"\n'
        f"allow-pickle-weights = {str(allow).lower()}\n",
        encoding="utf-8",
    )
    return path


def test_preflight_goes_by_each_deployed_regions_own_pickle_permission(
    checkpoints, demo_root, tmp_path, capsys
):
    eu = _agent_toml(tmp_path / "eu.toml", demo_root / "eu", allow=False)
    cn = _agent_toml(tmp_path / "cn.toml", demo_root / "cn", allow=True)
    args = ["preflight", "--app", str(ROOT), "--agent-config", str(eu), "--agent-config", str(cn)]
    pickled = f"model-path='{checkpoints['pickle-only']}'"
    assert main([*args, "--", "--run-config", pickled]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err
    assert f"  run config:model-path: {checkpoints['pickle-only']}: its weights are only" in err
    assert f"  region eu: {eu}:allow-pickle-weights: false, and the weights of" in err
    assert f"region cn: {cn}" not in err
    allowing = ["--run-config", "allow-pickle-weights=true"]
    assert main([*args, *allowing, "--", "--run-config", pickled]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedciuic: error: region eu: {eu}:allow-pickle-weights: false")
    cn_only = ["preflight", "--app", str(ROOT), "--agent-config", str(cn), *allowing]
    assert main([*cn_only, "--", "-c", pickled]) == 0
    assert capsys.readouterr().out.startswith("preflight: ok: model-path ")


def test_start_sh_exits_2_on_a_bad_checkpoint_before_starting_any_process(
    checkpoints, tmp_path, capsys
):
    dep = tmp_path / "dep"
    assert (
        main(
            [
                "init",
                str(dep),
                "--app",
                str(ROOT),
                "--regions",
                "eu,cn",
                "--insecure",
                "--demo-data",
                "--relay-user",
                "",
                "--port",
                "19492",
            ]
        )
        == 0
    )
    capsys.readouterr()
    start = time.monotonic()
    done = subprocess.run(
        ["bash", str(dep / "start.sh"), "--run-config", *model_path(checkpoints["mismatched"])[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert time.monotonic() - start < SECONDS
    assert (
        f"fedciuic: error: run config:model-path: {checkpoints['mismatched']}: the tokenizer"
        in (done.stderr)
    )
    assert "start.sh: superlink" not in done.stdout
    assert not list((dep / "pids").glob("*.pid"))
    assert not list((dep / "logs").iterdir())
