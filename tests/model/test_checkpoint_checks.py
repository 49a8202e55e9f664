"""What a model-path checkpoint is checked for before anything loads it: weights that
are only pickle (refused unless allowed, and whose permission is whose), weights and
tokenizers that certainly do not belong to the model's config, all from files on disk."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from fedciuic.agent.config import AgentConfig
from fedciuic.config import ModelSpec, NodeConfig, RunConfig
from fedciuic.errors import ModelError
from fedciuic.model.adapter import (
    AdapterModel,
    checkpoint_config,
    open_tokenizer,
    tokenizer_problems,
    tokenizer_warnings,
    weight_problems,
)
from fedciuic.model.presets import byte_tokenizer
from tests.conftest import ROOT, app_config, unit_config, within

CPU = torch.device("cpu")


def copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def pickle_only(source: Path, target: Path) -> Path:
    """The checkpoint with its weights as ``pytorch_model.bin`` only (transformers 5's
    save_pretrained writes safetensors whatever it is asked, so torch.save it is)."""
    copy_checkpoint(source, target)
    (target / "model.safetensors").unlink()
    model = AutoModelForCausalLM.from_pretrained(source)
    torch.save(model.state_dict(), target / "pytorch_model.bin")
    return target


@pytest.fixture(scope="module")
def pickled(tiny_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pickle_only(tiny_checkpoints["qwen2"], tmp_path_factory.mktemp("pickled") / "ckpt")


def _logits(model: AdapterModel) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = model.model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    return logits


def test_pickle_only_weights_are_refused_by_default_naming_the_file_the_fix_and_the_key(pickled):
    with pytest.raises(ModelError) as refused:
        AdapterModel(ModelSpec(model_path=str(pickled)), device=CPU)
    message = str(refused.value)
    assert "\n" not in message
    assert (
        f"model-path: {pickled}: its weights are only pickle files (pytorch_model.bin)" in message
    )
    assert "convert them to safetensors" in message and "save_pretrained" in message
    assert "allow-pickle-weights = true" in message and "agent config" in message


@pytest.mark.parametrize("shared", ["1", "0"], ids=["shared-base", "private-base"])
def test_pickle_only_weights_load_with_the_key_as_the_safetensors_do(
    pickled, tiny_checkpoints, monkeypatch, shared
):
    monkeypatch.setenv("FEDCIUIC_SHARED_BASE", shared)
    allowed = AdapterModel(
        ModelSpec(model_path=str(pickled), allow_pickle_weights=True), device=CPU
    )
    safe = AdapterModel(ModelSpec(model_path=str(tiny_checkpoints["qwen2"])), device=CPU)
    torch.testing.assert_close(_logits(allowed), _logits(safe))


def test_the_conversion_the_refusal_names_gives_a_checkpoint_that_loads_by_default(
    pickled, tmp_path, tiny_checkpoints
):
    folder = copy_checkpoint(pickled, tmp_path / "converted")
    with pytest.raises(ModelError) as refused:
        AdapterModel(ModelSpec(model_path=str(folder)), device=CPU)
    snippet = re.search(r'python -c "([^"]+)"', str(refused.value))
    assert snippet is not None
    exec(snippet.group(1), {})  # what the user is told to run, run here
    assert (folder / "model.safetensors").is_file()
    converted = AdapterModel(ModelSpec(model_path=str(folder)), device=CPU)
    safe = AdapterModel(ModelSpec(model_path=str(tiny_checkpoints["qwen2"])), device=CPU)
    torch.testing.assert_close(_logits(converted), _logits(safe))


def test_loading_never_unpickles_unless_allowed_whatever_the_folder_holds(
    pickled, tiny_checkpoints, tmp_path, monkeypatch
):
    """Defence in depth: beside safetensors, a pickle file is never read unless allowed
    (from_pretrained is told safetensors only); pickle-only weights are refused before
    transformers is asked."""
    mixed = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "mixed")
    shutil.copy(pickled / "pytorch_model.bin", mixed / "pytorch_model.bin")
    seen: list[dict[str, object]] = []
    original = AutoModelForCausalLM.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(dict(kwargs))
        return original(*args, **kwargs)

    monkeypatch.setenv("FEDCIUIC_SHARED_BASE", "0")
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    AdapterModel(ModelSpec(model_path=str(mixed)), device=CPU)
    assert seen[-1]["use_safetensors"] is True
    AdapterModel(ModelSpec(model_path=str(pickled), allow_pickle_weights=True), device=CPU)
    assert "use_safetensors" not in seen[-1]
    seen.clear()
    with pytest.raises(ModelError, match="only pickle files"):
        AdapterModel(ModelSpec(model_path=str(pickled)), device=CPU)
    assert seen == []


# -- whose permission it is ---------------------------------------------------------------


def _run(**changes: object) -> RunConfig:
    return RunConfig.from_user_config({**unit_config(), **changes}, source="test")


def test_the_run_config_key_defaults_to_false_and_governs_the_launcher_and_simulation():
    assert app_config()["allow-pickle-weights"] is False
    assert ModelSpec().allow_pickle_weights is False
    allowing = _run(**{"allow-pickle-weights": True})
    assert allowing.model.allow_pickle_weights is True
    assert _run().model.allow_pickle_weights is False
    simulated = NodeConfig.resolve({"partition-id": 0}, _run(**{"data-root": "/d"}))
    assert simulated.allows_pickle_weights(allowing) is True  # one operator owns both


def test_a_deployed_region_goes_by_its_own_word_never_the_run_configs(tmp_path):
    allowing = _run(**{"allow-pickle-weights": True})
    agent = AgentConfig.from_user_config(
        {
            "region": "eu",
            "data-path": str(tmp_path),
            "key-file": "k",
            "aggregator-bundle": "a",
            "policy": "p",
            "socket": "s",
        },
        source="agent.toml",
    )
    assert agent.allow_pickle_weights is False  # the agent's default
    node = agent.node_for(allowing)
    assert node.allows_pickle_weights(allowing) is False
    # what the region's trainer builds: the run's model section, with the region's word
    assert node.allows_pickle_weights(allowing) is False
    assert allowing.model.allow_pickle_weights is True
    trusting = agent.model_copy(update={"allow_pickle_weights": True})
    assert trusting.node_for(_run()).allows_pickle_weights(_run()) is True
    # A node config that names its region (a deployed node) is never the run's either.
    named = NodeConfig.resolve({"region": "eu", "data-path": str(tmp_path)}, allowing)
    assert named.allows_pickle_weights(allowing) is False


# -- weights and tokenizers that are not the config's ---------------------------------------


def test_a_checkpoint_without_weights_or_with_another_embedding_is_named(
    tiny_checkpoints, tmp_path
):
    folder = copy_checkpoint(tiny_checkpoints["llama"], tmp_path / "c")
    config = checkpoint_config(folder)
    assert weight_problems(folder, config, allow_pickle=False) == []
    config.vocab_size = 2048
    (problem,) = weight_problems(folder, config, allow_pickle=False)
    assert "model.embed_tokens.weight has 1024 rows, config.json:vocab_size says 2048" in problem
    (folder / "model.safetensors").unlink()
    (problem,) = weight_problems(folder, config, allow_pickle=True)
    assert f"model-path: {folder}: no weights" in problem


@pytest.mark.parametrize("family", ["qwen2", "deepseek_v4"])
def test_a_tokenizer_with_ids_past_the_embedding_is_refused(tiny_checkpoints, tmp_path, family):
    # On V4 such an id would also index past the hash router's token -> expert table.
    folder = copy_checkpoint(tiny_checkpoints[family], tmp_path / "c")
    tokenizer = open_tokenizer(folder)
    tokenizer.add_tokens([f"extra{i}" for i in range(10)])
    tokenizer.save_pretrained(folder)
    with pytest.raises(ModelError) as refused:
        AdapterModel(ModelSpec(model_path=str(folder)), device=CPU)
    assert (
        "the tokenizer has 1034 tokens (ids up to 1033), the model's vocabulary 1024 "
        "(config.json:vocab_size)" in str(refused.value)
    )


def test_special_token_ids_of_the_config_must_be_rows_and_tokens(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["deepseek_v3"], tmp_path / "c")
    config = checkpoint_config(folder)
    tokenizer = open_tokenizer(folder)
    assert tokenizer_problems(folder, config, tokenizer) == []
    assert tokenizer_warnings(folder, config, tokenizer) == []
    config.pad_token_id = 5000
    config.eos_token_id = [1, 7000]
    problems = tokenizer_problems(folder, config, tokenizer)
    named = [re.search(r"config\.json:(\w+): ", p) for p in problems]
    assert [m.group(1) for m in named if m] == ["eos_token_id", "pad_token_id"]
    assert "7000 is outside the model's vocabulary of 1024" in problems[0]
    # A tokenizer smaller than the embedding that lacks the config's eos id is not its own.
    small = copy_checkpoint(tiny_checkpoints["deepseek_v3"], tmp_path / "small")
    config = checkpoint_config(small)
    config.eos_token_id = 600
    byte = byte_tokenizer()  # 259 tokens
    (problem,) = tokenizer_problems(small, config, byte)
    assert "config.json:eos_token_id: 600 is no token of the tokenizer beside it" in problem


def test_an_eos_the_model_does_not_stop_at_is_a_warning_not_a_refusal(tiny_checkpoints, tmp_path):
    folder = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "c")
    for file in folder.iterdir():
        if file.name.startswith(("tokenizer", "chat_template", "special")):
            file.unlink()
    byte_tokenizer().save_pretrained(folder)  # ids 0-258: every config id is one of them
    config = checkpoint_config(folder)
    tokenizer = open_tokenizer(folder)
    assert tokenizer_problems(folder, config, tokenizer) == []
    (warning,) = tokenizer_warnings(folder, config, tokenizer)
    assert "the tokenizer's eos token '<eos>' (id 257) is not the model's" in warning
    # generation_config.json's stop ids count as the model's too.
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation.get("eos_token_id", 1), 257]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    assert tokenizer_warnings(folder, config, tokenizer) == []


# -- what the folder holds: its own code, and what is not a regular file ---------------------

#: A checkpoint's own Python file that leaves a mark wherever it is imported.
OWN_CODE = """from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PretrainedConfig, PreTrainedTokenizerFast
class Config(PretrainedConfig):
    model_type = "evil_lm"
class Tokenizer(PreTrainedTokenizerFast):
    pass
"""
MODEL_CODE = {"AutoConfig": "evil.Config", "AutoModelForCausalLM": "evil.CausalLM"}


def with_own_code(source: Path, target: Path, file: str, changes: dict[str, Any]) -> Path:
    """The checkpoint with ``evil.py`` beside it, and ``changes`` to ``file`` naming it."""
    folder = copy_checkpoint(source, target)
    (folder / "evil.py").write_text(OWN_CODE.format(marker=str(target.parent / "ran")))
    settings = json.loads((folder / file).read_text(encoding="utf-8"))
    (folder / file).write_text(json.dumps({**settings, **changes}), encoding="utf-8")
    return folder


@pytest.fixture
def answers_yes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every prompt asked, each answered "y" (as a user who trusts the folder would)."""
    asked: list[str] = []

    def answer(prompt: object = "") -> str:
        asked.append(str(prompt))
        return "y"

    monkeypatch.setattr("builtins.input", answer)
    return asked


@pytest.mark.parametrize(
    ("file", "changes"),
    [
        ("config.json", {"model_type": "evil_lm", "auto_map": MODEL_CODE}),
        (
            "tokenizer_config.json",
            {
                "tokenizer_class": "EvilTokenizer",
                "auto_map": {"AutoTokenizer": ["evil.Tokenizer", "evil.Tokenizer"]},
            },
        ),
    ],
)
def test_a_folder_whose_config_names_code_of_its_own_is_refused_in_one_line_never_asking(
    tiny_checkpoints, tmp_path, answers_yes, file, changes
):
    """Old code asked "Do you wish to run the custom code? [y/N]" for config.json, and
    with "y" ran evil.py; it loaded tokenizer_config.json's as another class."""
    folder = with_own_code(tiny_checkpoints["qwen2"], tmp_path / "ckpt", file, changes)
    for load in (
        lambda: AdapterModel(ModelSpec(model_path=str(folder)), device=CPU),
        lambda: open_tokenizer(folder),
    ):
        with pytest.raises(ModelError) as refused:
            load()
        assert answers_yes == []
        assert not (tmp_path / "ran").exists()
        message = str(refused.value)
        assert "\n" not in message
        assert f"model-path: {folder / file}:auto_map: names code of the checkpoint's own " in (
            message
        )
        assert "(evil.py)" in message and "without custom code" in message


def test_an_auto_map_beside_an_architecture_transformers_has_is_never_followed(
    tiny_checkpoints, tmp_path, answers_yes, monkeypatch
):
    """As DeepSeek-V2 and V3 are published (config.json's auto_map names their original
    modeling files, model_type one transformers has): transformers' own classes load it,
    and every load is told never to trust the folder's code."""
    folder = with_own_code(
        tiny_checkpoints["qwen2"], tmp_path / "ckpt", "config.json", {"auto_map": MODEL_CODE}
    )
    told: set[tuple[str, object]] = set()
    for auto in (AutoConfig, AutoTokenizer, AutoModelForCausalLM):
        original = auto.from_pretrained

        def spy(*args: Any, _original: Any = original, _auto: Any = auto, **kwargs: Any) -> Any:
            told.add((_auto.__name__, kwargs.get("trust_remote_code", "unsaid")))
            return _original(*args, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", spy)
    monkeypatch.setenv("FEDCIUIC_SHARED_BASE", "0")  # from_pretrained loads the weights
    model = AdapterModel(ModelSpec(model_path=str(folder)), device=CPU)
    assert type(model.model.get_base_model()).__module__.startswith("transformers.models.qwen2")
    assert told == {
        (auto, False) for auto in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM")
    }
    assert answers_yes == []
    assert not (tmp_path / "ran").exists()


def test_every_transformers_load_in_fedciuic_says_trust_remote_code_false():
    """Defence in depth beside the refusal: no from_pretrained or from_config leaves
    trust_remote_code to its default (which asks on a terminal)."""
    calls = []
    for source in sorted((ROOT / "fedciuic").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("from_pretrained", "from_config")
            ):
                said = {k.arg: k.value for k in node.keywords}
                trusted = said.get("trust_remote_code")
                ok = isinstance(trusted, ast.Constant) and trusted.value is False
                calls.append((f"{source.relative_to(ROOT)}:{node.lineno}", ok))
    assert len(calls) >= 8
    assert [where for where, ok in calls if not ok] == []


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer_config.json"])
def test_a_fifo_in_the_checkpoint_folder_is_refused_at_once_naming_it(
    tiny_checkpoints, tmp_path, name
):
    """Old code waited forever on a FIFO named model.safetensors (its header is read),
    called a FIFO named config.json missing, and loaded the tokenizer without its
    tokenizer_config.json."""
    folder = copy_checkpoint(tiny_checkpoints["qwen2"], tmp_path / "ckpt")
    (folder / name).unlink()
    os.mkfifo(folder / name)
    refused = within(
        10, lambda: AdapterModel(ModelSpec(model_path=str(folder)), device=CPU), fifo=folder / name
    )
    assert isinstance(refused, ModelError)
    message = str(refused)
    assert "\n" not in message
    assert f"model-path: {folder / name}: a FIFO (named pipe), not a regular file; " in message
