"""DeepSeek-family causal LMs with LoRA adapters: the only weights that train and travel.

The base, a seeded preset or a local checkpoint (``model-path``), stays frozen, MoE router
and experts included; fp32 adapters sit on the modules :mod:`fedciuic.model.families`
picks. ``adapter-mode`` decides what trains (docs/models.md): its fixed factors are derived
from names, shapes and seed by every party, never sent, and a saved adapter is always
standard LoRA factors, which peft loads.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from safetensors.numpy import save_file
from torch.distributed.tensor import DTensor
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

from fedciuic.config import AdapterMode, ModelSpec
from fedciuic.errors import ModelError
from fedciuic.files import DIRECTORY, not_regular
from fedciuic.model.families import frozen_parts, resolve_targets, target_names
from fedciuic.model.identity import checkpoint_fingerprint, preset_fingerprint
from fedciuic.model.presets import preset_config, preset_tokenizer
from fedciuic.model.shared_base import (
    MappedFile,
    Slicer,
    assign,
    cached_base_file,
    checkpoint_weight_files,
    mapped_tensors,
    sharing_enabled,
    skeleton,
    state_names,
)

# peft calls transformers APIs that transformers 5 deprecates: noise users cannot act on.
warnings.filterwarnings(
    "ignore",
    message=".*(is_gradient_checkpointing|gradient_checkpointing_enable).*",
    category=FutureWarning,
)

ADAPTER_NAME = "default"  # peft's name for the one adapter
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Beside a saved adapter: the adapter-mode it was trained in (peft's config has no place).
ADAPTER_MODE_FILE = "fedciuic_adapter.json"
#: Name ends of an adapted module's peft A and B, and lora-sb's R in B's slot (:class:`RThenB`).
LORA_A = f".lora_A.{ADAPTER_NAME}.weight"
LORA_B = f".lora_B.{ADAPTER_NAME}.weight"
LORA_R = f".lora_B.{ADAPTER_NAME}.lora_R.weight"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHECKPOINT_FIX = (
    "point model-path at a folder written by save_pretrained (config.json, weights, tokenizer)"
)


@dataclass(frozen=True)
class ParamCounts:
    total: int
    trainable: int


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def base_dtype(spec: ModelSpec, device: torch.device) -> torch.dtype:
    """The frozen base's dtype: ``auto`` is bf16 on a GPU that supports it, else fp32."""
    if spec.dtype != "auto":
        if spec.dtype not in DTYPES:
            raise ModelError(
                f"run config:dtype: unknown {spec.dtype!r}; use auto, bf16, fp16 or fp32"
            )
        return DTYPES[spec.dtype]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def check_quantization(spec: ModelSpec, device: torch.device) -> None:
    """``nf4`` needs CUDA (bitsandbytes) and a checkpoint to quantize while loading."""
    if spec.quantization == "none":
        return
    if spec.quantization != "nf4":
        raise ModelError(f"run config:quantization: unknown {spec.quantization!r}; use none or nf4")
    if device.type != "cuda":
        raise ModelError(
            "run config:quantization: nf4 needs a CUDA GPU (bitsandbytes 4-bit); this "
            f'machine trains on {device.type}: set quantization = "none"'
        )
    if not spec.model_path:
        raise ModelError(
            "run config:quantization: nf4 quantizes a checkpoint while loading it; set "
            "model-path (fedciuic save-checkpoint writes one from a preset)"
        )


def check_model_spec(spec: ModelSpec) -> None:
    """Fail fast, before any training, on an unknown preset or a folder that is no checkpoint."""
    if spec.model_path:
        checkpoint_config(Path(spec.model_path).expanduser())
    else:
        preset_config(spec.model_preset)


def checkpoint_config(path: Path) -> PretrainedConfig:
    """A checkpoint folder's config, or :class:`ModelError` naming what is wrong with it."""
    config_file = path / "config.json"
    if not path.is_dir():
        raise ModelError(f"run config:model-path: {path} is not a directory; {CHECKPOINT_FIX}")
    _check_folder(path)
    if not config_file.is_file():
        raise ModelError(f"run config:model-path: {path} has no config.json; {CHECKPOINT_FIX}")
    try:
        config: PretrainedConfig = AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelError(f"{config_file}: {_first_line(err)}; {CHECKPOINT_FIX}") from None
    if type(config) not in AutoModelForCausalLM._model_mapping:
        raise ModelError(
            f"{config_file}:model_type: {config.model_type!r} is not a causal language "
            f"model transformers can load; {CHECKPOINT_FIX}"
        )
    return config


# -- what the folder holds, before transformers reads any of it ---------------------------

#: Files whose ``auto_map`` names the checkpoint's own code, and the field naming a class
#: transformers has itself (then used instead: that ``auto_map`` is never followed).
CUSTOM_CODE = {"config.json": "model_type", "tokenizer_config.json": "tokenizer_class"}
CUSTOM_CODE_FIX = (
    "fedciuic never runs a checkpoint's own code: use a checkpoint of a supported "
    "architecture without custom code, whose model_type (deepseek_v3, deepseek_v2, qwen2, "
    "llama, or another causal LM) and tokenizer_class transformers has"
)


def _check_folder(path: Path) -> None:
    """Refuse a folder holding a non-regular file (a FIFO hangs loading) or code of its own."""
    try:
        entries = sorted(path.iterdir())
    except OSError as err:
        raise ModelError(
            f"run config:model-path: {path}: cannot list ({err.strerror}); check its permissions"
        ) from None
    for entry in entries:
        what = not_regular(entry)
        if what not in (None, DIRECTORY):
            raise ModelError(
                f"run config:model-path: {entry}: {what}, not a regular file; a checkpoint "
                "folder holds regular files: put the file itself there, or remove this entry"
            )
    for name, field_name in CUSTOM_CODE.items():
        if (refusal := _custom_code(path / name, field_name)) is not None:
            raise ModelError(refusal)


def _custom_code(file: Path, field_name: str) -> str | None:
    """Why ``file``'s ``auto_map`` would make transformers import the folder's code, if so."""
    try:
        settings = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # none, or unreadable: transformers' own error names it
    if not isinstance(settings, dict) or "auto_map" not in settings:
        return None
    named = settings.get(field_name)
    if isinstance(named, str) and _transformers_has(field_name, named):
        return None
    modules = ", ".join(_modules(settings["auto_map"])) or "a Python file"
    return (
        f"run config:model-path: {file}:auto_map: names code of the checkpoint's own "
        f"({modules}) for {field_name} {named!r}, which transformers does not have: only "
        f"that code could load it; {CUSTOM_CODE_FIX}"
    )


def _modules(auto_map: object) -> list[str]:
    """The Python files an ``auto_map`` names (``[repo--]module.Class``; a tokenizer's is a
    slow/fast pair, either of which may be null)."""
    refs = list(auto_map.values()) if isinstance(auto_map, dict) else auto_map
    if not isinstance(refs, list):
        return []
    flat = [r for ref in refs for r in (ref if isinstance(ref, list) else [ref])]
    return sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in flat if isinstance(r, str)})


def _transformers_has(field_name: str, named: str) -> bool:
    """Whether transformers has ``named`` itself (a tokenizer with or without ``Fast``)."""
    if field_name == "model_type":
        return named in CONFIG_MAPPING
    return any(
        tokenizer_class_from_name(name) is not None
        for name in (named, named.removesuffix("Fast"), f"{named.removesuffix('Fast')}Fast")
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# -- the checkpoint's weights ----------------------------------------------------------------

#: transformers' pickle weight files: ``pytorch_model.bin``, its shards and their index.
PICKLE_WEIGHTS = "pytorch_model*.bin"


def weight_files(path: Path) -> tuple[list[Path], list[Path]]:
    """A checkpoint folder's safetensors and pickle weight files (adapters excluded)."""
    safe = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("adapter_"))
    return safe, sorted(path.glob(PICKLE_WEIGHTS))


def pickle_refusal(path: Path, pickles: list[Path]) -> str:
    """Why a checkpoint whose weights are only pickle files is not loaded, and the fix."""
    shown = ", ".join(f.name for f in pickles[:2]) + (", ..." if len(pickles) > 2 else "")
    return (
        f"run config:model-path: {path}: its weights are only pickle files ({shown}), and "
        "loading pickle runs code; convert them to safetensors once, where you trust them: "
        'python -c "from transformers import AutoModelForCausalLM as M; '
        f"M.from_pretrained('{path}').save_pretrained('{path}')\" (writes model.safetensors "
        "beside them), or set allow-pickle-weights = true (the run config's for a "
        "simulation, the region's agent config for a deployed region) to load them as they are"
    )


def weight_problems(path: Path, config: PretrainedConfig, *, allow_pickle: bool) -> list[str]:
    """What is certainly wrong with a checkpoint's weights, from names and headers alone."""
    safe, pickles = weight_files(path)
    if not safe and not pickles:
        return [
            f"run config:model-path: {path}: no weights (model.safetensors, or "
            f"model-*-of-*.safetensors shards); {CHECKPOINT_FIX}"
        ]
    if not safe:
        return [] if allow_pickle else [pickle_refusal(path, pickles)]
    vocab = getattr(config, "vocab_size", None)
    for file in safe:
        try:
            with safe_open(str(file), framework="pt") as weights:
                for name in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not name.endswith("embed_tokens.weight"):
                        continue
                    rows = weights.get_slice(name).get_shape()[0]
                    if isinstance(vocab, int) and rows != vocab:
                        return [
                            f"run config:model-path: {file}: {name} has {rows} rows, "
                            f"config.json:vocab_size says {vocab}: the config is not these "
                            f"weights'; {CHECKPOINT_FIX}"
                        ]
                    return []
        except (OSError, ValueError, safetensors.SafetensorError) as err:
            return [
                f"run config:model-path: {file}: not a safetensors file ({_first_line(err)}); "
                f"{CHECKPOINT_FIX}"
            ]
    return []


# -- the checkpoint's tokenizer --------------------------------------------------------------

#: A tokenizer's own files; without one, transformers 5 builds an empty tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
TOKENIZER_FIX = "the checkpoint's own tokenizer must be saved beside it (tokenizer.save_pretrained)"
#: The special-token ids a config names, which must be rows of the model's embedding.
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def open_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in checkpoint folder ``path``, not yet checked against its model."""
    _check_folder(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(
            f"run config:model-path: {path}: no usable tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}); {TOKENIZER_FIX}"
        )
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            path, local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelError(
            f"run config:model-path: {path}: no usable tokenizer ({_first_line(err)}); "
            f"{TOKENIZER_FIX}"
        ) from None
    return tokenizer


def _ids(value: object) -> list[int]:
    """A config's token id setting (one id, a list of them, or none) as a list."""
    values = value if isinstance(value, list | tuple) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def tokenizer_problems(
    path: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> list[str]:
    """Where the tokenizer and the model certainly disagree, from config.json alone."""
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        return []
    ids = tokenizer.get_vocab()
    known = set(ids.values())
    largest = max(known, default=-1)
    problems = []
    if largest >= vocab:
        problems.append(
            f"run config:model-path: {path}: the tokenizer has {len(tokenizer)} tokens (ids up "
            f"to {largest}), the model's vocabulary {vocab} (config.json:vocab_size): they are "
            f"not one checkpoint; {TOKENIZER_FIX}, or resize the model's embeddings to it"
        )
    for name in SPECIAL_IDS:
        # (a negative padding index counts from the end, as nn.Embedding takes it)
        lowest = -vocab if name == "pad_token_id" else 0
        for token_id in _ids(getattr(config, name, None)):
            if not lowest <= token_id < vocab:
                problems.append(
                    f"run config:model-path: {path / 'config.json'}:{name}: {token_id} is "
                    f"outside the model's vocabulary of {vocab}; {CHECKPOINT_FIX}"
                )
            elif name != "pad_token_id" and largest < vocab and token_id not in known:
                problems.append(
                    f"run config:model-path: {path / 'config.json'}:{name}: {token_id} is no "
                    f"token of the tokenizer beside it ({len(tokenizer)} tokens): they are not "
                    f"one checkpoint; {TOKENIZER_FIX}"
                )
    return problems


def tokenizer_warnings(
    path: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase
) -> list[str]:
    """Likely, not certain, mistakes: an eos token the model's configs do not stop at."""
    eos = tokenizer.eos_token_id
    stops = set(_ids(getattr(config, "eos_token_id", None)))
    generation = path / "generation_config.json"
    if generation.is_file():
        with contextlib.suppress(OSError, ValueError, AttributeError):
            said = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
            stops |= set(_ids(said))
    if not isinstance(eos, int) or not stops or eos in stops:
        return []
    return [
        f"model-path: {path}: the tokenizer's eos token {tokenizer.eos_token!r} (id {eos}) "
        f"is not the model's (config.json:eos_token_id {sorted(stops)}): responses are trained "
        "to end with a token generation does not stop at; check that the tokenizer is the "
        "checkpoint's own"
    ]


def _refuse(problems: list[str]) -> None:
    if problems:
        raise ModelError("; ".join(problems))


def _load_tokenizer(path: Path, config: PretrainedConfig) -> PreTrainedTokenizerBase:
    tokenizer = open_tokenizer(path)
    _refuse(tokenizer_problems(path, config, tokenizer))
    return tokenizer


@dataclass
class Base:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str
    model_type: str
    #: The read-only files the frozen weights are mapped from (none when not shared).
    shared: list[MappedFile] = field(default_factory=list)
    #: A skeleton's (weights on ``meta``): the files to read them from, and how.
    files: list[Path] = field(default_factory=list)
    slicer: Slicer = field(default_factory=Slicer)


def _shares(spec: ModelSpec, device: torch.device) -> bool:
    """Mapped from a shared file on CPU only (a GPU needs its own copy; nf4 quantizes it)."""
    return device.type == "cpu" and spec.quantization == "none" and sharing_enabled()


def _preset(spec: ModelSpec) -> BaseSource:
    config = preset_config(spec.model_preset)
    tokenizer = preset_tokenizer(spec.model_preset)
    fingerprint = preset_fingerprint(spec.model_preset, config.to_dict(), spec.seed, tokenizer)
    return BaseSource(config, tokenizer, fingerprint)


def spec_tokenizer(spec: ModelSpec) -> PreTrainedTokenizerBase:
    """The tokenizer a region would read its data with, without building the model."""
    if spec.model_path:
        path = Path(spec.model_path).expanduser()
        return _load_tokenizer(path, checkpoint_config(path))
    return preset_tokenizer(spec.model_preset)


def _seeded_model(config: PretrainedConfig, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    # The same base for every party, the caller's random state untouched (drawn in fp32).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, trust_remote_code=False
        )
    torch.nn.Module.to(model, dtype=dtype)
    return model


@dataclass
class BaseSource:
    """A base's identity, and the safetensors files holding its tensors under the model's names."""

    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase
    fingerprint: str
    files: list[Path] = field(default_factory=list)

    def base(self, model: PreTrainedModel, shared: list[MappedFile] | None = None) -> Base:
        return Base(model, self.tokenizer, self.fingerprint, self.config.model_type, shared or [])

    def mapped(self, model: PreTrainedModel) -> Base:
        """Skeleton ``model`` over these files, mapped (its weights are not copied)."""
        tensors, shared = mapped_tensors(self.files)
        assign(model, tensors, self.files[0])
        return self.base(model, shared)

    def skeleton(self, model: PreTrainedModel, slicer: Slicer | None = None) -> Base:
        """``model`` on ``meta``, each training process to read its slice of these files."""
        base = self.base(model)
        base.files, base.slicer = self.files, slicer or Slicer()
        return base


def _preset_source(spec: ModelSpec, dtype: torch.dtype) -> BaseSource:
    """A preset's weights: the cached file built once per machine from the seed."""
    source = _preset(spec)
    file = cached_base_file(
        source.fingerprint,
        dtype,
        lambda: _seeded_model(source.config, spec.seed, dtype).state_dict(),
    )
    return replace(source, files=[file])


def _preset_base(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> Base:
    if not _shares(spec, device):
        source = _preset(spec)
        model = _seeded_model(source.config, spec.seed, dtype)
        torch.nn.Module.to(model, device=device)
        return source.base(model)
    source = _preset_source(spec, dtype)
    base = source.mapped(skeleton(source.config))
    torch.nn.Module.to(base.model, dtype=dtype)  # the non-persistent buffers, as built privately
    return base


def _from_pretrained(path: Path, kwargs: dict[str, Any]) -> PreTrainedModel:
    try:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            path, trust_remote_code=False, **kwargs
        )
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ModelError(
            f"run config:model-path: {path}: {_first_line(err)}; {CHECKPOINT_FIX}"
        ) from None
    return model


def _checked_checkpoint(spec: ModelSpec) -> tuple[Path, BaseSource]:
    path = Path(spec.model_path).expanduser()
    config = checkpoint_config(path)
    _refuse(weight_problems(path, config, allow_pickle=spec.allow_pickle_weights))
    return path, BaseSource(config, _load_tokenizer(path, config), checkpoint_fingerprint(path))


def _checkpoint_kwargs(spec: ModelSpec, dtype: torch.dtype) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if not spec.allow_pickle_weights:
        kwargs["use_safetensors"] = True  # never unpickle, whatever the folder holds
    return kwargs


def _checkpoint_source(
    spec: ModelSpec, dtype: torch.dtype, checked: tuple[Path, BaseSource] | None = None
) -> BaseSource:
    """Its own safetensors files if they hold the tensors in ``dtype``, else a cached copy."""
    path, source = checked or _checked_checkpoint(spec)
    kwargs = _checkpoint_kwargs(spec, dtype)
    files = checkpoint_weight_files(path, state_names(source.config), dtype) or [
        cached_base_file(
            source.fingerprint, dtype, lambda: _from_pretrained(path, kwargs).state_dict()
        )
    ]
    return replace(source, files=files)


def _checkpoint_base(spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> Base:
    if _shares(spec, device):
        source = _checkpoint_source(spec, dtype)
        base = source.mapped(skeleton(source.config, dtype))
        torch.nn.Module.eval(base.model)  # as from_pretrained leaves it
        return base
    path, source = _checked_checkpoint(spec)
    kwargs = _checkpoint_kwargs(spec, dtype)
    if device.type != "cpu":
        kwargs["device_map"] = {"": device.index or 0}  # straight to the GPU
    if spec.quantization == "nf4":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(  # type: ignore[no-untyped-call]
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=dtype if dtype != torch.float32 else torch.bfloat16,
            bnb_4bit_use_double_quant=True,
        )
    return source.base(_from_pretrained(path, kwargs))


def build_base(spec: ModelSpec, device: torch.device | None = None) -> Base:
    """The frozen base on ``device`` in the spec's dtype (or 4-bit), and its tokenizer."""
    device = device or default_device()
    check_quantization(spec, device)
    dtype = base_dtype(spec, device)
    base = (
        _checkpoint_base(spec, dtype, device)
        if spec.model_path
        else _preset_base(spec, dtype, device)
    )
    base.model.requires_grad_(False)
    return base


def _refuse_fp8(path: Path, config: PretrainedConfig) -> None:
    """FP8 weights are not sliced for sharding: their block scales would need cutting too."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    if method == "fp8":
        raise ModelError(
            f"run config:model-path: {path} holds FP8 weights, which a sharded base does not "
            "read yet; convert them to bf16 once (DeepSeek-V3's inference/fp8_cast_bf16.py "
            "--input-fp8-hf-path PATH --output-bf16-hf-path NEW, then copy the config and "
            'tokenizer and drop quantization_config) or set train-sharding = "replicate"'
        )


def base_skeleton(spec: ModelSpec, device: torch.device) -> Base:
    """The frozen base on ``meta``, with the ``files`` each training process reads a slice of."""
    dtype = base_dtype(spec, device)
    if not spec.model_path:
        source = _preset_source(spec, dtype)
        base = source.skeleton(skeleton(source.config, dtype))
    else:
        checked = _checked_checkpoint(spec)
        path, source = checked
        _refuse_fp8(path, source.config)
        model = skeleton(source.config, dtype)
        own = weight_files(path)[0]
        slicer = Slicer.of(model, _own_keys(own)) if own else None
        if slicer is not None and slicer.feeds(_loaded_shapes(model)):
            # Each rank reads its rows from the checkpoint's own files: none reads it whole.
            base = replace(source, files=own).skeleton(model, slicer)
        else:  # converted once per machine, whole, into the cache
            base = _checkpoint_source(spec, dtype, checked).skeleton(model)
    base.model.requires_grad_(False)
    return base


def _own_keys(files: list[Path]) -> set[str]:
    keys: set[str] = set()
    for file in files:
        with safe_open(file, "pt") as handle:
            keys.update(handle.keys())
    return keys


def _loaded_shapes(model: PreTrainedModel) -> dict[str, tuple[int, ...]]:
    """What a checkpoint must hold for ``model``: parameters (tied: once) and persistent buffers."""
    params = dict(model.named_parameters())
    every = dict(model.named_parameters(remove_duplicate=False))
    return {
        name: tuple(t.shape)
        for name, t in model.state_dict().items()
        if name in params or name not in every
    }


def lora_config(spec: ModelSpec, targets: list[str]) -> LoraConfig:
    return LoraConfig(
        r=spec.lora_rank,
        lora_alpha=int(spec.lora_alpha),
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        base_model_name_or_path=spec.model_path or None,
    )


@contextlib.contextmanager
def _exact_targets() -> Iterator[None]:
    """Switch off peft >= 0.18's renaming of MoE targets to transformers-4 expert names,
    which moves dense and shared-expert adapters onto 3-D tensors Opacus cannot clip."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def _with_adapters(
    model: PreTrainedModel, spec: ModelSpec, model_type: str
) -> tuple[PeftModel, list[str]]:
    targets = resolve_targets(model, model_type, spec.lora_targets)
    # Adapters start from the same seed everywhere too (B = 0, A seeded).
    with torch.random.fork_rng(devices=[]), _exact_targets():
        torch.manual_seed(spec.seed + 1)
        peft_model = get_peft_model(model, lora_config(spec, targets))
    assert isinstance(peft_model, PeftModel)
    _apply_mode(peft_model, spec.adapter_mode)
    return peft_model, targets


class RThenB(torch.nn.Linear):
    """lora-sb's ``lora_B``: the fixed B after ``lora_R``, the trained r x r matrix (a plain
    ``nn.Linear``, so Opacus computes its per-sample gradients): ``scaling * B R A``."""

    def __init__(self, fixed: torch.nn.Linear) -> None:
        rank, weight = fixed.in_features, fixed.weight
        where = {"device": weight.device, "dtype": weight.dtype}
        super().__init__(rank, fixed.out_features, bias=False, **where)
        self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        self.lora_R = torch.nn.Linear(rank, rank, bias=False, **where)
        torch.nn.init.zeros_(self.lora_R.weight)  # R = 0: the model starts as the base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.lora_R(x))


def _apply_mode(model: PeftModel, mode: AdapterMode) -> None:
    """Freeze what ``mode`` fixes (lora-fa: A; lora-sb: A and B, with R between them)."""
    if mode == "lora":
        return
    for layer in model.modules():
        if not isinstance(layer, LoraLayer) or ADAPTER_NAME not in layer.lora_A:
            continue
        fixed_b = layer.lora_B[ADAPTER_NAME]
        if not isinstance(fixed_b, torch.nn.Linear):
            raise ModelError(
                f"run config:adapter-mode: {mode} adapts nn.Linear modules only; "
                f'{type(layer).__name__} is not one: use adapter-mode = "lora" or other '
                "lora-targets"
            )
        layer.lora_A[ADAPTER_NAME].requires_grad_(False)
        if mode == "lora-sb":
            layer.lora_B[ADAPTER_NAME] = RThenB(fixed_b)


def factor_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """peft's A and B of every adapted module (trained or fixed), by name."""
    return {n: tuple(p.shape) for n, p in model.named_parameters() if n.endswith((LORA_A, LORA_B))}


def fixed_factors(
    mode: AdapterMode, shapes: Mapping[str, tuple[int, ...]], seed: int
) -> dict[str, np.ndarray]:
    """The factors ``mode`` keeps fixed, from names, shapes and seed: every party derives
    the same, and none depends on data, so they cost no privacy. lora-sb's are Haar-random
    orthonormal, so B R A moves the weight by R's own scale."""
    if mode == "lora":
        return {}
    if mode == "lora-fa":
        return {n: v for n, v in initial_adapter(shapes, seed).items() if n.endswith(LORA_A)}
    rng = np.random.default_rng([seed, 2])
    return {name: _orthonormal(rng, shapes[name]) for name in sorted(shapes)}


def _orthonormal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Haar-random orthonormal columns (rows >= cols) or rows: a Gaussian's sign-fixed Q."""
    rows, cols = shape
    gaussian = rng.standard_normal((max(rows, cols), min(rows, cols)))
    q, r = np.linalg.qr(gaussian)
    q *= np.where(np.diag(r) < 0, -1.0, 1.0)
    return np.ascontiguousarray(q if rows >= cols else q.T, np.float32)


def lora_factors(
    mode: AdapterMode, trained: Mapping[str, np.ndarray], fixed: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The adapter as standard LoRA factors, which peft loads (lora-sb's R folded: A' = R A)."""
    if mode != "lora-sb":
        return {**fixed, **trained}
    factors = dict(fixed)
    for name, r in trained.items():
        a = name.removesuffix(LORA_R) + LORA_A
        factors[a] = (np.asarray(r, np.float64) @ np.asarray(fixed[a], np.float64)).astype(
            np.float32
        )
    return factors


def write_adapter(
    spec: ModelSpec, targets: list[str], factors: Mapping[str, np.ndarray], directory: Path
) -> Path:
    """Standard LoRA ``factors`` in peft's format, with the adapter-mode beside them."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name.replace(f".{ADAPTER_NAME}.", "."): np.ascontiguousarray(value, np.float32)
        for name, value in factors.items()
    }
    save_file(tensors, str(directory / ADAPTER_WEIGHTS))
    lora_config(spec, targets).save_pretrained(str(directory))
    (directory / ADAPTER_MODE_FILE).write_text(
        json.dumps({"adapter-mode": spec.adapter_mode}) + "\n", encoding="utf-8"
    )
    return directory / ADAPTER_WEIGHTS


#: What every adapter tensor's name holds (trained or fixed), and no base tensor's.
ADAPTER_MARK = ".lora_"


class AdapterModel:
    """A frozen base with fp32 LoRA adapters. The adapter state (``name -> float32 array``
    of what the adapter-mode trains) is what is trained, sent, aggregated and checkpointed."""

    def __init__(
        self, spec: ModelSpec, device: torch.device | None = None, *, skeleton: bool = False
    ) -> None:
        """``skeleton``: the base stays on ``meta`` until each training process reads a slice."""
        self.spec = spec
        self.device = device or default_device()
        self.skeleton = skeleton
        self._build()

    def _build(self) -> None:
        spec = self.spec
        base = base_skeleton(spec, self.device) if self.skeleton else build_base(spec, self.device)
        self.tokenizer = base.tokenizer
        self.base_fingerprint = base.fingerprint
        self.shared = base.shared  # keeps the mapping this process shares alive
        #: A skeleton's: the files each rank reads its slice of the base from, and how.
        self.files = base.files
        self.slicer = base.slicer
        #: Whether the frozen base is sharded (every pass is then collective).
        self.sharded = False
        self.model, self.targets = _with_adapters(base.model, spec, base.model_type)
        for prefix, module in self.model.named_modules():
            for key, param in module.named_parameters(recurse=False):
                if param.requires_grad or ADAPTER_MARK in f"{prefix}.{key}":  # adapters in fp32
                    value = torch.zeros(param.shape) if param.is_meta else param.data
                    module._parameters[key] = torch.nn.Parameter(
                        value.to(device=self.device, dtype=torch.float32),
                        requires_grad=param.requires_grad,
                    )
        if spec.gradient_checkpointing:
            enable_checkpointing(base.model)
        # Found once, not per copy or optimizer; sharding replaces base tensors only.
        self._adapters = {
            n: p for n, p in self.model.named_parameters() if p.requires_grad or ADAPTER_MARK in n
        }
        self._names = [n for n, p in self._adapters.items() if p.requires_grad]
        fixed = fixed_factors(spec.adapter_mode, factor_shapes(self.model), spec.seed)
        self._fixed_names = sorted(fixed)
        self._copy_in(fixed)
        if self.skeleton:  # the adapters start where round 1's global adapter does
            self._copy_in(initial_adapter(self._shapes(), spec.seed))

    def unshard(self) -> None:
        """Build the whole base again, adapters kept: a sharded base dies with its group."""
        state = self.adapter_state()
        self._build()
        self.load_adapter_state(state)

    def describe(self) -> str:
        c = self.counts()
        frozen = frozen_parts(self.model)
        return (
            f"LoRA r={self.spec.lora_rank} ({self.spec.adapter_mode}) on {len(self.targets)} "
            f"modules ({', '.join(target_names(self.targets))}): {c.trainable:,} trainable of "
            f"{c.total:,} parameters, base in {next(self.model.parameters()).dtype}"
            + (f"; frozen with it: {', '.join(frozen)}" if frozen else "")
        )

    def private_bytes(self) -> int:
        """Memory held apart from the mapped base (what the region cache's bound counts)."""
        mapped = {t.untyped_storage().data_ptr() for m in self.shared for t in m.tensors.values()}
        tensors = [
            t.to_local() if isinstance(t, DTensor) else t  # a sharded base: this rank's slice
            for t in [*self.model.parameters(), *self.model.buffers()]
        ]
        return sum(
            t.untyped_storage().nbytes()
            for t in {t.untyped_storage().data_ptr(): t for t in tensors}.values()
            if t.untyped_storage().data_ptr() not in mapped and t.device.type != "meta"
        )

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [self._adapters[n] for n in self._names]

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(self._adapters[name].shape) for name in self._names}

    def counts(self) -> ParamCounts:
        params = list(self.model.parameters())
        return ParamCounts(
            total=sum(p.numel() for p in params),
            trainable=sum(p.numel() for p in params if p.requires_grad),
        )

    def _copy_out(self, names: list[str]) -> dict[str, np.ndarray]:
        return {
            n: self._adapters[n].detach().to("cpu", torch.float32).numpy().copy() for n in names
        }

    def _copy_in(self, arrays: Mapping[str, np.ndarray]) -> None:
        with torch.no_grad():
            for name, value in arrays.items():
                self._adapters[name].copy_(torch.from_numpy(np.asarray(value)))

    def adapter_state(self) -> dict[str, np.ndarray]:
        return self._copy_out(self._names)

    def fixed_state(self) -> dict[str, np.ndarray]:
        return self._copy_out(self._fixed_names)

    def load_adapter_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite the trained adapter tensors; keys and shapes must match exactly."""
        check_same_layout(arrays, self._shapes(), what="adapter")
        self._copy_in({name: arrays[name] for name in self._names})

    def save_adapter(self, directory: Path) -> Path:
        """Write the adapter in peft's format, as standard LoRA factors."""
        factors = lora_factors(self.spec.adapter_mode, self.adapter_state(), self.fixed_state())
        return write_adapter(self.spec, self.targets, factors, directory)


@dataclass
class AdapterLayout:
    """The adapter's names, shapes and initial values, from the base on ``meta``: what the
    aggregator needs, without the base. ``factors``: every A and B shape (for the fixed ones)."""

    spec: ModelSpec
    fingerprint: str
    shapes: dict[str, tuple[int, ...]]
    targets: list[str]
    initial: dict[str, np.ndarray] = field(repr=False)
    factors: dict[str, tuple[int, ...]] = field(repr=False)

    @classmethod
    def of(cls, spec: ModelSpec) -> AdapterLayout:
        if spec.model_path:
            path = Path(spec.model_path).expanduser()
            config = checkpoint_config(path)
            fingerprint = checkpoint_fingerprint(path)
        else:
            preset = _preset(spec)
            config, fingerprint = preset.config, preset.fingerprint
        with torch.device("meta"):
            base = AutoModelForCausalLM.from_config(config, trust_remote_code=False)  # type: ignore[no-untyped-call]
            peft_model, targets = _with_adapters(base, spec, config.model_type)
        shapes = {n: tuple(p.shape) for n, p in peft_model.named_parameters() if p.requires_grad}
        factors = factor_shapes(peft_model)
        return cls(spec, fingerprint, shapes, targets, initial_adapter(shapes, spec.seed), factors)

    @property
    def fixed(self) -> dict[str, np.ndarray]:
        return fixed_factors(self.spec.adapter_mode, self.factors, self.spec.seed)

    def save(self, arrays: Mapping[str, np.ndarray], directory: Path) -> Path:
        """The adapter in peft's format, as standard LoRA factors."""
        check_same_layout(arrays, self.shapes, what="adapter")
        factors = lora_factors(self.spec.adapter_mode, arrays, self.fixed)
        return write_adapter(self.spec, self.targets, factors, directory)


def initial_adapter(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """The global adapter before round 1, from names, shapes and seed: ``lora_A`` as peft's
    Kaiming default, the rest zero, so the adapted model starts as the base."""
    rng = np.random.default_rng([seed, 1])
    state: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if ".lora_A." in name:
            bound = 1.0 / np.sqrt(shape[-1])
            state[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        else:
            state[name] = np.zeros(shape, np.float32)
    return state


# -- gradient checkpointing that Opacus' per-sample hooks survive --------------------------

#: Opacus GradSampleModules whose hooks pause while a layer is recomputed (hooks mode).
_PAUSED_DURING_RECOMPUTE: list[Any] = []


@contextlib.contextmanager
def pause_on_recompute(hooks: Any) -> Iterator[None]:
    """While open, ``hooks`` (an Opacus GradSampleModule) skip checkpointed layers'
    recompute: a per-sample gradient must use the forward's activations, once."""
    _PAUSED_DURING_RECOMPUTE.append(hooks)
    try:
        yield
    finally:
        _PAUSED_DURING_RECOMPUTE.remove(hooks)


class _Recompute(contextlib.AbstractContextManager[None]):
    """Pauses the hooks while a checkpointed layer is recomputed (once per backward pass:
    ghost clipping takes two)."""

    def __init__(self) -> None:
        self.paused: list[Any] = []

    def __enter__(self) -> None:
        self.paused = [h for h in _PAUSED_DURING_RECOMPUTE if h.hooks_enabled]
        for hooks in self.paused:
            hooks.hooks_enabled = False

    def __exit__(self, *_: object) -> None:
        for hooks in self.paused:
            hooks.hooks_enabled = True
        self.paused = []


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Activation checkpointing per decoder layer, its recompute skipped by DP's hooks."""
    checkpoint: Callable[..., Any] = partial(
        torch.utils.checkpoint.checkpoint,
        use_reentrant=False,
        context_fn=lambda: (contextlib.nullcontext(), _Recompute()),
    )
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)


def check_same_layout(
    got: Mapping[str, np.ndarray], want: Mapping[str, tuple[int, ...]], *, what: str
) -> None:
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"{what} keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in want.items():
        if tuple(np.shape(got[name])) != tuple(shape):
            raise ValueError(f"{what} {name}: shape {tuple(np.shape(got[name]))}, expected {shape}")


def save_model_checkpoint(spec: ModelSpec, directory: Path) -> Path:
    """Save a preset as a checkpoint: the ``model-path`` route, without downloads."""
    base = build_base(spec, torch.device("cpu"))
    directory.mkdir(parents=True, exist_ok=True)
    base.model.save_pretrained(str(directory))
    base.tokenizer.save_pretrained(str(directory))
    return directory
