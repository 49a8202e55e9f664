"""DeepSeek-V3 model factory with LoRA adapters: the only weights that train and travel.

A model is either a named preset built with a seeded random init (no weights can be
downloaded here, and every party must build the very same base) or a local
checkpoint directory saved with ``save_pretrained``. LoRA adapters (peft) sit on the
MLA attention projections; everything else, the MoE router included, stays frozen,
because Opacus cannot compute per-sample gradients for the router and because only
adapters should cross a border.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoTokenizer,
    DeepseekV3ForCausalLM,
    PreTrainedTokenizerBase,
)

from fedciuic.config import RunConfig
from fedciuic.errors import ModelError
from fedciuic.model.presets import byte_tokenizer, preset_config

# peft calls a transformers property that transformers 5 deprecates; the warning is
# noise for our users, who cannot act on it.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

#: MLA projections of ``DeepseekV3Attention`` that carry adapters.
ATTENTION_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


@dataclass(frozen=True)
class ModelSpec:
    """Which model to build: a preset (seeded random init) or a checkpoint directory."""

    preset: str = "tiny"
    path: str = ""
    lora_rank: int = 8
    lora_alpha: int = 16
    seed: int = 0

    @classmethod
    def from_run(cls, run: RunConfig) -> ModelSpec:
        return cls(
            preset=run.model_preset,
            path=run.model_path,
            lora_rank=run.lora_rank,
            lora_alpha=run.lora_alpha,
            seed=run.seed,
        )


@dataclass(frozen=True)
class ParamCounts:
    total: int
    trainable: int


def default_device() -> torch.device:
    """CUDA when present, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_base(spec: ModelSpec) -> tuple[DeepseekV3ForCausalLM, PreTrainedTokenizerBase]:
    """Build the frozen base model and its tokenizer (no adapters yet)."""
    if spec.path:
        return _load_checkpoint(Path(spec.path).expanduser())
    config = preset_config(spec.preset)
    # Every party builds the same base from the same seed, without disturbing
    # the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = DeepseekV3ForCausalLM(config)
    return model, byte_tokenizer()


CHECKPOINT_FIX = (
    "point model-path at a folder written by save_pretrained (config.json, weights, tokenizer)"
)


def check_model_spec(spec: ModelSpec) -> None:
    """Fail fast, before any training, on an unknown preset or a non-checkpoint path."""
    if not spec.path:
        preset_config(spec.preset)
        return
    path = Path(spec.path).expanduser()
    config_file = path / "config.json"
    if not path.is_dir():
        raise ModelError(f"run config:model-path: {path} is not a directory; {CHECKPOINT_FIX}")
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ModelError(
            f"{config_file}: cannot read a model config ({err}); {CHECKPOINT_FIX}"
        ) from None
    if model_type != "deepseek_v3":
        raise ModelError(
            f"{config_file}:model_type: {model_type!r} is not 'deepseek_v3'; {CHECKPOINT_FIX}"
        )


def _load_checkpoint(path: Path) -> tuple[DeepseekV3ForCausalLM, PreTrainedTokenizerBase]:
    check_model_spec(ModelSpec(path=str(path)))
    try:
        model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"run config:model-path: {path}: {first}; {CHECKPOINT_FIX}") from None
    return model, tokenizer


class AdapterModel:
    """A DeepSeek-V3 base with LoRA adapters; only adapter tensors are read or written.

    The adapter state is a flat ``name -> float32 array`` mapping, the unit that is
    trained, sent, aggregated and saved.
    """

    def __init__(self, spec: ModelSpec, device: torch.device | None = None) -> None:
        self.spec = spec
        self.device = device or default_device()
        base, self.tokenizer = build_base(spec)
        self.base_fingerprint = fingerprint(base.state_dict())
        lora = LoraConfig(
            r=spec.lora_rank,
            lora_alpha=int(spec.lora_alpha),
            target_modules=list(ATTENTION_TARGETS),
            lora_dropout=0.0,
            bias="none",
        )
        # Adapters start from the same seed everywhere too (B = 0, A seeded).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed + 1)
            peft_model = get_peft_model(base, lora)
        assert isinstance(peft_model, PeftModel)
        self.model: PeftModel = peft_model.to(self.device)
        self._names = [n for n, p in self.model.named_parameters() if p.requires_grad]

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def counts(self) -> ParamCounts:
        params = list(self.model.parameters())
        return ParamCounts(
            total=sum(p.numel() for p in params),
            trainable=sum(p.numel() for p in params if p.requires_grad),
        )

    def adapter_state(self) -> dict[str, np.ndarray]:
        """Copy the adapter tensors out as float32 NumPy arrays."""
        params = dict(self.model.named_parameters())
        return {n: params[n].detach().to("cpu", torch.float32).numpy().copy() for n in self._names}

    def load_adapter_state(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Overwrite the adapters; keys and shapes must match exactly."""
        params = dict(self.model.named_parameters())
        shapes = {name: tuple(params[name].shape) for name in self._names}
        check_same_layout(arrays, shapes, what="adapter")
        with torch.no_grad():
            for name in self._names:
                params[name].copy_(torch.from_numpy(np.asarray(arrays[name])))

    def save_adapter(self, directory: Path) -> Path:
        """Write the adapter in peft's format (adapter_model.safetensors + config)."""
        self.model.save_pretrained(str(directory))
        return directory / "adapter_model.safetensors"


def check_same_layout(
    got: Mapping[str, np.ndarray], want: Mapping[str, tuple[int, ...]], *, what: str
) -> None:
    """Raise ``ValueError`` naming the first key or shape that differs from ``want``."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        raise ValueError(f"{what} keys differ: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in want.items():
        if tuple(np.shape(got[name])) != tuple(shape):
            raise ValueError(f"{what} {name}: shape {tuple(np.shape(got[name]))}, expected {shape}")


def fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over a state dict's names, shapes and bytes, in name order.

    Parties compare it to make sure they fine-tune the very same base model.
    """
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_checkpoint(spec: ModelSpec, directory: Path) -> Path:
    """Save a preset's base model and tokenizer as a checkpoint directory.

    This is how the ``model-path`` loading route is exercised without downloads.
    """
    model, tokenizer = build_base(spec)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return directory
