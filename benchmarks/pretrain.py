"""Pretrain a preset once on public local text: the base the quality benchmarks fine-tune.

Issue 20's quality runs (``compression.py``) fine-tuned a random-initialised preset, so
what they measured was mostly the model learning token frequencies, not fine-tuning.
This stands in for a public pretrained checkpoint: every weight trained with plain
AdamW (no DP: the text is public), in bf16 autocast where the CPU has bf16 instructions
(else fp32), for a fixed step or time budget, on text that ships with CPython and that
no region's demo data is made of (pydoc's language-reference topics and the docstrings
of :data:`PUBLIC_MODULES`, less any docstring a region's corpus also holds), so that
the regions' chat and instruction data stays unseen, as private data would be.

    .venv/bin/python benchmarks/pretrain.py                         # realistic, 15 minutes
    .venv/bin/python benchmarks/pretrain.py --preset small --steps 20

The base is saved (``save_pretrained``, model and tokenizer) as a ``model-path``
checkpoint in ``$FEDCIUIC_CACHE/pretrained/<preset>-<key>`` (else
``~/.cache/fedciuic/pretrained``, beside the shared bases in ``.../bases``), the key
hashing the preset's fingerprint, the text and the recipe, so a second run with the
same settings reuses it. Its figures are kept beside it (``fedciuic-pretrain.json``),
printed, and saved per preset in ``benchmarks/results/pretrain.json``: the eval loss on
held-out public text and on the regions' demo data (as ``compression.py``'s round 0
measures it: the run's settings, each region's held-out records, example-weighted),
before and after, and how long pretraining took. Both evaluations load the base the
way a region does (``AdapterModel``: ``build_base`` through ``model-path``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from fedciuic.config import ModelSpec, NodeConfig, RunConfig
from fedciuic.data import load_region_data
from fedciuic.data.corpus import ExampleSet
from fedciuic.data.demo import FAMILIES, module_docs, write_demo_corpora
from fedciuic.digests import cache_dir
from fedciuic.model import AdapterModel, evaluate
from fedciuic.model.adapter import build_base, default_device
from fedciuic.model.identity import checkpoint_fingerprint, preset_fingerprint
from fedciuic.model.presets import preset_config, preset_tokenizer, save_tokenizer
from fedciuic.model.shared_base import SHARE_ENV
from fedciuic.ops.runconfig import app_run_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "pretrain.json"
#: The figures kept beside a pretrained base; a folder without it is incomplete.
RECORD = "fedciuic-pretrain.json"
#: Bumped when the text or the recipe's meaning changes, so that no old base is reused.
RECIPE_VERSION = 1
#: The default budget per preset: about 15 minutes of training for ``realistic`` on
#: 2 CPU cores (issue 34), a quick one for the smaller presets.
MINUTES = {"tiny": 1.0, "small": 3.0, "realistic": 15.0}
#: Standard-library modules no region's demo corpus draws on (``FAMILIES``).
PUBLIC_MODULES = (
    "builtins", "sys", "gc", "atexit", "string", "textwrap", "difflib", "re", "typing",
    "types", "abc", "contextlib", "contextvars", "weakref", "ast", "tokenize", "symtable",
    "traceback", "warnings", "importlib", "pydoc", "code", "codeop", "optparse", "getopt",
    "shlex", "cmd", "uuid", "ipaddress", "binascii", "plistlib", "tomllib", "graphlib",
    "filecmp", "fileinput", "stat", "linecache", "tracemalloc", "time", "zoneinfo",
    "platform", "sysconfig", "ctypes", "xmlrpc", "wsgiref", "unicodedata",
)  # fmt: skip
#: Share of the texts held out (by the hash of each text) for the text eval loss.
HELD_OUT = 0.05
#: Held-out rows evaluated (of ``seq_len`` tokens each).
EVAL_ROWS = 32
#: Share of the budget over which the learning rate warms up (from a tenth of its
#: peak), before a cosine decay to a tenth.
WARMUP = 0.1


@dataclass(frozen=True)
class Recipe:
    """How a base is pretrained: everything its cache key covers."""

    preset: str
    steps: int | None  # a step budget, or
    minutes: float | None  # a wall-clock one (training only)
    batch_size: int = 8
    seq_len: int = 128
    learning_rate: float = 2e-3
    dtype: str = "auto"  # autocast dtype (and the saved weights'): auto, bf16 or fp32
    seed: int = 0  # the preset's seed (its random init) and the data order's

    def progress(self, step: int, seconds: float) -> float:
        """How far through its budget the run is, in [0, 1]."""
        if self.steps is not None:
            return step / self.steps
        return seconds / (60 * (self.minutes or 0.0))

    def learning_rate_at(self, progress: float) -> float:
        if progress < WARMUP:
            return self.learning_rate * (0.1 + 0.9 * progress / WARMUP)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - WARMUP) / (1 - WARMUP))))
        return self.learning_rate * (0.1 + 0.9 * cosine)

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """bf16 where the hardware computes in it (``auto``), else fp32."""
        if self.dtype != "auto":
            return torch.bfloat16 if self.dtype == "bf16" else torch.float32
        return torch.bfloat16 if _has_bf16(device) else torch.float32


def _has_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    with contextlib.suppress(OSError):
        flags = Path("/proc/cpuinfo").read_text(encoding="utf-8").split()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    return False


def app_config() -> dict[str, Any]:
    """The run config in pyproject.toml: what a federation gets unless told otherwise."""
    return app_run_config(ROOT)


def public_text() -> list[str]:
    """The pretraining text, in a fixed order: pydoc's topics, then the docstrings of
    :data:`PUBLIC_MODULES`, without duplicates or any docstring a region's corpus holds."""
    from pydoc_data.topics import topics

    regional = {doc for region in FAMILIES for doc in module_docs(FAMILIES[region])}
    texts = [topics[name] for name in sorted(topics)] + module_docs(PUBLIC_MODULES, 10**8)
    return list(dict.fromkeys(t for t in texts if t not in regional))


def held_out(text: str) -> bool:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64 < HELD_OUT


def pack(texts: list[str], tokenizer: Any, seq_len: int) -> torch.Tensor:
    """The texts as one token stream (each between bos and eos) cut into rows."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream: list[int] = []
    for text in texts:
        stream += [bos, *tokenizer.encode(text, add_special_tokens=False), eos]
    rows = len(stream) // seq_len
    return torch.tensor(stream[: rows * seq_len], dtype=torch.long).view(rows, seq_len)


def token_rows(recipe: Recipe, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The training rows, and the held-out rows the text eval loss is measured on."""
    tokenizer = preset_tokenizer(recipe.preset)
    train = pack([t for t in texts if not held_out(t)], tokenizer, recipe.seq_len)
    held = pack([t for t in texts if held_out(t)], tokenizer, recipe.seq_len)
    return train, held[:EVAL_ROWS]


def unigram_loss(train: torch.Tensor, held: torch.Tensor, vocab: int) -> float:
    """The held-out rows' loss (every token after the first, as the eval counts them)
    under the training rows' token frequencies, add-one smoothed: what a base that had
    learned token frequencies and nothing else would score."""
    counts = torch.bincount(train.flatten(), minlength=vocab).double() + 1
    return float(-(counts / counts.sum()).log()[held[:, 1:]].mean())


def base_key(recipe: Recipe, texts: list[str]) -> str:
    tokenizer = preset_tokenizer(recipe.preset)
    config = preset_config(recipe.preset).to_dict()
    described = {
        "version": RECIPE_VERSION,
        "preset": preset_fingerprint(recipe.preset, config, recipe.seed, tokenizer),
        "text": hashlib.sha256(json.dumps(texts).encode()).hexdigest(),
        "recipe": asdict(recipe),
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def pretrained_dir(recipe: Recipe, texts: list[str]) -> Path:
    return cache_dir() / "pretrained" / f"{recipe.preset}-{base_key(recipe, texts)}"


def pretrained_base(recipe: Recipe, settings: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The pretrained base's folder and figures: the cached one, else built now.

    ``settings``: the run config keys (``compression.py``'s for the preset) the demo
    data is evaluated with, as a federation's round 0 would."""
    texts = public_text()
    folder = pretrained_dir(recipe, texts)
    if (folder / RECORD).is_file():
        return folder, json.loads((folder / RECORD).read_text(encoding="utf-8"))
    shutil.rmtree(folder, ignore_errors=True)  # an earlier build that did not finish
    began = time.monotonic()
    train_rows, eval_rows = token_rows(recipe, texts)
    before = base_losses({"model-preset": recipe.preset, "seed": recipe.seed}, eval_rows, settings)
    print(f"before pretraining: {before}", file=sys.stderr, flush=True)
    trained = train(recipe, train_rows)
    save(trained.pop("model"), preset_tokenizer(recipe.preset), folder)
    gc.collect()
    after = base_losses({"model-path": str(folder)}, eval_rows, settings)
    print(f"after pretraining: {after}", file=sys.stderr, flush=True)
    record = {
        "preset": recipe.preset,
        "path": str(folder),
        "recipe": asdict(recipe),
        "text": {
            "texts": len(texts),
            "chars": sum(map(len, texts)),
            "train_tokens": train_rows.numel(),
            "heldout_texts": sum(map(held_out, texts)),
            "heldout_tokens_evaluated": eval_rows.numel(),
        },
        **trained,
        "before": before,
        "after": after,
        "demo_settings": {k: settings[k] for k in sorted(settings)},
        "fingerprint": checkpoint_fingerprint(folder),
        "total_seconds": round(time.monotonic() - began, 1),
    }
    (folder / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return folder, record


@contextlib.contextmanager
def _private_base() -> Iterator[None]:
    """Build a base of its own (not mapped read-only from the shared cache): trainable."""
    saved = os.environ.get(SHARE_ENV)
    os.environ[SHARE_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[SHARE_ENV]
        else:
            os.environ[SHARE_ENV] = saved


def train(recipe: Recipe, rows: torch.Tensor) -> dict[str, Any]:
    """Every weight of the preset's seeded init, AdamW on the rows in a seeded order;
    returns the model (fp32, or bf16 when it trained in bf16) and what the run took."""
    device = default_device()
    dtype = recipe.compute_dtype(device)
    with _private_base():  # the random init every party builds, in fp32 master weights
        spec = ModelSpec(model_preset=recipe.preset, seed=recipe.seed, dtype="fp32")
        model = build_base(spec, device).model.requires_grad_(True).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.learning_rate, betas=(0.9, 0.95), fused=True)
    order = torch.Generator().manual_seed(recipe.seed)
    batches: list[torch.Tensor] = []
    losses: list[float] = []
    began = time.monotonic()
    step = 0
    while recipe.progress(step, time.monotonic() - began) < 1:
        if not batches:  # the next epoch, reshuffled
            shuffled = rows[torch.randperm(len(rows), generator=order)]
            batches = list(torch.split(shuffled, recipe.batch_size))
        ids = batches.pop(0).to(device)
        for group in optimizer.param_groups:
            group["lr"] = recipe.learning_rate_at(recipe.progress(step, time.monotonic() - began))
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
        step += 1
        if step % 10 == 1:
            seconds = time.monotonic() - began
            print(f"  step {step}: loss {losses[-1]:.4f}, {seconds:.0f} s", file=sys.stderr)
    seconds = time.monotonic() - began
    del optimizer
    gc.collect()
    tokens = step * recipe.batch_size * recipe.seq_len
    return {
        "model": model.to(dtype),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(p.numel() for p in params),
        "steps": step,
        "tokens_seen": tokens,
        "epochs": round(tokens / rows.numel(), 3),
        "train_seconds": round(seconds, 1),
        "train_loss_first_last": [losses[0], losses[-1]],
        "train_loss_per_step": losses,
    }


def save(model: PreTrainedModel, tokenizer: Any, folder: Path) -> None:
    """Save into a temporary folder beside ``folder``, then rename it into place: a
    reader never sees half a checkpoint."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        model.save_pretrained(str(staging))
        save_tokenizer(tokenizer, staging)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def base_losses(
    base: dict[str, Any], rows: torch.Tensor, settings: dict[str, Any]
) -> dict[str, Any]:
    """Eval loss on the held-out public text and on each region's held-out demo records
    (and their example-weighted mean), the ``base`` (run config keys: a model-preset
    and seed, or a model-path) loaded as a region loads it."""
    run = RunConfig.from_user_config({**app_config(), **settings, **base}, source="pretrain")
    model = AdapterModel(run.model, torch.device("cpu"))
    text = evaluate(model, ExampleSet.of_rows(rows), batch_size=8).loss
    regions: dict[str, float] = {}
    examples: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="fedciuic-pretrain-") as tmp:
        write_demo_corpora(Path(tmp), run.regions)
        for region in run.regions:
            node = NodeConfig(
                region=region, data_path=str(Path(tmp) / region), state_path=f"{tmp}/{region}-state"
            )
            data = load_region_data(run, node, model.tokenizer)
            stats = evaluate(model, data.eval, batch_size=run.training.batch_size)
            regions[region], examples[region] = round(stats.loss, 4), stats.num_examples
    demo = sum(regions[r] * examples[r] for r in regions) / sum(examples.values())
    return {
        "heldout_text_loss": round(text, 4),
        "demo_eval_loss": round(demo, 4),
        "demo_eval_loss_per_region": regions,
        "demo_eval_examples": sum(examples.values()),
    }


def save_results(record: dict[str, Any]) -> None:
    """``benchmarks/results/pretrain.json``: the latest figures per preset."""
    results = json.loads(RESULTS.read_text(encoding="utf-8")) if RESULTS.is_file() else {}
    results[record["preset"]] = {k: v for k, v in record.items() if k != "train_loss_per_step"}
    RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def summary(record: dict[str, Any]) -> str:
    before, after = record["before"], record["after"]
    return (
        f"{record['preset']}: {record['parameters']:,} parameters, {record['steps']} steps of "
        f"{record['recipe']['batch_size']} x {record['recipe']['seq_len']} tokens "
        f"({record['tokens_seen']:,} tokens, {record['epochs']} epochs of "
        f"{record['text']['train_tokens']:,}) in {record['train_seconds'] / 60:.1f} min "
        f"({record['dtype']} on {record['device']}; {record['total_seconds'] / 60:.1f} min "
        f"with the evaluations)\n"
        f"  held-out text eval loss  {before['heldout_text_loss']:.4f} -> "
        f"{after['heldout_text_loss']:.4f} (token frequencies alone: "
        f"{record['unigram_heldout_text_loss']:.4f})\n"
        f"  demo data eval loss      {before['demo_eval_loss']:.4f} -> "
        f"{after['demo_eval_loss']:.4f} ({after['demo_eval_examples']} held-out records of "
        f"{', '.join(after['demo_eval_loss_per_region'])})\n"
        f"  model-path = {record['path']}"
    )


def main() -> int:
    from compression import PRESETS  # the settings its fine-tuning runs use

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", choices=sorted(MINUTES), default="realistic")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="a step budget")
    budget.add_argument("--minutes", type=float, help="a training-time budget (default: MINUTES)")
    parser.add_argument("--batch-size", type=int, default=Recipe.batch_size)
    parser.add_argument("--seq-len", type=int, default=Recipe.seq_len)
    parser.add_argument("--learning-rate", type=float, default=Recipe.learning_rate)
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default=Recipe.dtype)
    args = parser.parse_args()
    recipe = Recipe(
        preset=args.preset,
        steps=args.steps,
        minutes=None if args.steps else (args.minutes or MINUTES[args.preset]),
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        learning_rate=args.learning_rate,
        dtype=args.dtype,
    )
    _, record = pretrained_base(recipe, PRESETS[args.preset])
    rows = token_rows(recipe, public_text())
    unigram = unigram_loss(*rows, len(preset_tokenizer(recipe.preset)))
    record["unigram_heldout_text_loss"] = round(unigram, 4)
    print(summary(record))
    save_results(record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
