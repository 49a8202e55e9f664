"""One shared base per machine: mapped read-only from one file, written and hashed once,
identical to a private load, rebuilt when damaged, never written by training; and the
per-process region cache's bound."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fedciuic.config import ModelSpec
from fedciuic.data.corpus import ExampleSet
from fedciuic.digests import file_digest
from fedciuic.errors import ConfigError
from fedciuic.model.adapter import AdapterModel
from fedciuic.model.shared_base import SHARE_ENV, bases_dir, mapping_of
from fedciuic.model.train import train_local
from fedciuic.privacy.dpsgd import PrivateTrainer
from fedciuic.region.cache import BUDGET_ENV, BoundedCache, budget_bytes

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDCIUIC_CACHE", str(cache))
    monkeypatch.delenv(SHARE_ENV, raising=False)
    return cache


def build(spec: ModelSpec, shared: bool, monkeypatch: pytest.MonkeyPatch) -> AdapterModel:
    monkeypatch.setenv(SHARE_ENV, "1" if shared else "0")
    try:
        return AdapterModel(spec, device=CPU)
    finally:
        monkeypatch.delenv(SHARE_ENV)


def frozen(model: AdapterModel) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.model.named_parameters() if not p.requires_grad}


def logits(model: AdapterModel, vocab: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out: torch.Tensor = model.model(input_ids=ids).logits
    return out


def maps_line(file: Path) -> list[str]:
    """The permissions of this process's mappings of ``file``."""
    lines = Path("/proc/self/maps").read_text(encoding="utf-8").splitlines()
    return [ln.split()[1] for ln in lines if ln.endswith(str(file))]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_shared_preset_base_is_mapped_read_only_and_gives_the_same_logits(dtype, monkeypatch):
    spec = ModelSpec(model_preset="tiny", dtype=dtype)
    private = build(spec, False, monkeypatch)
    shared = build(spec, True, monkeypatch)
    assert torch.equal(logits(private, 256), logits(shared, 256))
    files = {mapping_of(p) for p in frozen(shared).values()}
    (file,) = files
    assert file is not None and file.parent == bases_dir()
    assert maps_line(file) and all("w" not in perms for perms in maps_line(file))
    assert all(mapping_of(p) is None for p in shared.trainable_parameters())  # adapters private
    # A second model in the same process views the very same memory.
    again = build(spec, True, monkeypatch)
    assert all(p.data_ptr() == frozen(shared)[n].data_ptr() for n, p in frozen(again).items())
    assert shared.private_bytes() * 5 < private.private_bytes()


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_shared_checkpoint_base_gives_the_same_logits(
    tiny_checkpoints, family, dtype, monkeypatch
):
    path = tiny_checkpoints[family]
    spec = ModelSpec(model_path=str(path), dtype=dtype)
    private = build(spec, False, monkeypatch)
    shared = build(spec, True, monkeypatch)
    vocab = private.model.config.vocab_size
    assert torch.equal(logits(private, vocab), logits(shared, vocab))
    files = {mapping_of(p) for p in frozen(shared).values()}
    assert files and None not in files
    if dtype == "fp32" and family == "llama":  # saved in fp32 under the model's names
        assert files == {path / "model.safetensors"}


def test_two_processes_map_one_file_written_and_hashed_once(_own_cache):
    script = textwrap.dedent(
        """
        import json, os, sys
        import fedciuic.digests as digests
        import fedciuic.model.adapter as adapter
        from fedciuic.model.shared_base import mapping_of
        counts = {"built": 0, "hashed": 0}
        seeded, digest = adapter._seeded_model, digests.file_digest
        def count_build(*args):
            counts["built"] += 1
            return seeded(*args)
        def count_hash(file):
            counts["hashed"] += "bases" in str(file)
            return digest(file)
        adapter._seeded_model, digests.file_digest = count_build, count_hash
        model = adapter.AdapterModel(adapter.ModelSpec(model_preset="tiny"))
        param = next(p for p in model.model.parameters() if not p.requires_grad)
        file = mapping_of(param)
        print(json.dumps({**counts, "file": str(file), "inode": os.stat(file).st_ino}))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDCIUIC_CACHE": str(_own_cache)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len({(r["file"], r["inode"]) for r in results}) == 1
    assert sum(r["built"] for r in results) == 1
    assert sum(r["hashed"] for r in results) == 1


def test_a_damaged_cache_file_is_rebuilt(monkeypatch, caplog):
    spec = ModelSpec(model_preset="tiny")
    want = logits(build(spec, False, monkeypatch), 256)
    first = build(spec, True, monkeypatch)
    file = mapping_of(next(iter(frozen(first).values())))
    assert file is not None
    del first
    for damage in (b"\x00" * 4096, b"not a header"):
        data = bytearray(file.read_bytes())
        offset = 64 if len(damage) > 100 else 0
        data[offset : offset + len(damage)] = damage
        file.write_bytes(bytes(data[: len(data) - 16]))
        with caplog.at_level("WARNING"):
            rebuilt = build(spec, True, monkeypatch)
        assert "damaged; rebuilding" in caplog.text
        assert torch.equal(logits(rebuilt, 256), want)
        caplog.clear()


def test_training_never_writes_the_shared_base(monkeypatch):
    spec = ModelSpec(model_preset="tiny", gradient_checkpointing=True)
    model = build(spec, True, monkeypatch)
    file = mapping_of(next(iter(frozen(model).values())))
    assert file is not None
    before = file_digest(file)
    reference = {n: p.clone() for n, p in frozen(build(spec, False, monkeypatch)).items()}
    adapters = model.adapter_state()
    rows = torch.randint(0, 256, (16, 24), generator=torch.Generator().manual_seed(0))
    train_local(
        model,
        ExampleSet.of_rows(rows),
        steps=2,
        batch_size=4,
        learning_rate=0.1,
        generator=torch.Generator().manual_seed(1),
    )
    trainer = PrivateTrainer(
        model,
        ExampleSet.of_rows(rows),
        batch_size=4,
        learning_rate=0.1,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
    )
    try:
        trainer.run(2)
    finally:
        trainer.close()
    assert any((model.adapter_state()[n] != a).any() for n, a in adapters.items())
    assert file_digest(file) == before
    assert all(torch.equal(p, reference[n]) for n, p in frozen(model).items())


def test_a_write_to_a_shared_base_tensor_faults(_own_cache):
    script = textwrap.dedent(
        """
        from fedciuic.model.adapter import AdapterModel, ModelSpec
        model = AdapterModel(ModelSpec(model_preset="tiny"))
        param = next(p for p in model.model.parameters() if not p.requires_grad)
        print("mapped", flush=True)
        param.data.add_(1.0)
        print("written", flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDCIUIC_CACHE": str(_own_cache)}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert "mapped" in done.stdout and "written" not in done.stdout
    assert done.returncode == -signal.SIGSEGV


def test_the_cache_keeps_at_most_its_count_and_budget_least_recently_used_first():
    built: list[str] = []

    def make(key: str) -> str:
        built.append(key)
        return key

    sizes = {"a": 10, "b": 10, "c": 10, "d": 10, "e": 10, "big": 100}
    cache: BoundedCache[str] = BoundedCache(sizes.__getitem__, count=4, budget=35)
    for key in ("a", "b", "c"):
        cache.get(key, functools.partial(make, key))
    cache.get("a", lambda: make("a"))  # a hit, and now the most recent
    assert built == ["a", "b", "c"]
    cache.get("d", lambda: make("d"))  # 40 bytes > 35: b (least recent) goes
    assert list(cache.entries) == ["c", "a", "d"] and cache.held_bytes() <= 35
    cache.get("big", lambda: make("big"))  # alone over budget, but the newest stays
    assert list(cache.entries) == ["big"]
    counted: BoundedCache[str] = BoundedCache(sizes.__getitem__, count=4, budget=10**9)
    for key in ("a", "b", "c", "d", "e"):
        counted.get(key, functools.partial(str, key))
    assert list(counted.entries) == ["b", "c", "d", "e"]


def test_the_cache_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(BUDGET_ENV, "512")
    assert budget_bytes() == 512 * 2**20
    monkeypatch.setenv(BUDGET_ENV, "lots")
    with pytest.raises(ConfigError, match=f"environment:{BUDGET_ENV}: 'lots'"):
        budget_bytes()
