"""Which modules carry LoRA adapters, per architecture (run config ``lora-targets``).

The MoE router and routed experts are never adapted: transformers 5 stores them out of
reach of peft and Opacus' per-sample gradients (docs/models.md). Nor are the blocks in
:data:`FROZEN_BLOCKS`, whatever their projections' names, or an ``nn.Linear`` subclass
with a forward of its own (LoRA would add ``B @ A @ x`` as if it were a plain product).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fedciuic.errors import ModelError

#: DeepSeek's multi-head latent attention: ``q_proj`` (V2-Lite, ``q_lora_rank`` unset) or
#: ``q_a_proj``/``q_b_proj`` (V3, V2), then the compressed key/value projections.
MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
#: DeepSeek-V4's attention projections (:data:`ATTENTION`).
V4_ATTENTION = ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")
#: Grouped-query attention of the R1-Distill models (Qwen2, Llama, and Qwen3, whose
#: per-head q_norm/k_norm are RMSNorms, not projections: frozen with the base).
GQA = ("q_proj", "k_proj", "v_proj", "o_proj")
#: A dense or shared-expert SwiGLU MLP.
MLP = ("gate_proj", "up_proj", "down_proj")

#: ``model_type`` -> the attention projections ``auto`` adapts.
ATTENTION: dict[str, tuple[str, ...]] = {
    "deepseek_v3": MLA,
    #: V3.2: MLA plus the sparse-attention indexer, which stays frozen.
    "deepseek_v32": MLA,
    "deepseek_v2": MLA,
    #: V4: shared-KV attention, low-rank q and a grouped output; its block-diagonal
    #: ``o_a_proj`` (an ``nn.Linear`` subclass), hyper-connections, sinks, compressors: frozen.
    "deepseek_v4": V4_ATTENTION,
    "qwen2": GQA,
    "qwen3": GQA,
    "llama": GQA,
}
SUPPORTED = tuple(ATTENTION)

AUTO = "auto"
AUTO_MLP = "auto+mlp"
#: Blocks whose modules stay frozen even by a listed name, and what each is (for errors).
FROZEN_BLOCKS: dict[str, str] = {
    "experts": "the routed experts (fused 3-D tensors in transformers 5)",
    "indexer": "the sparse-attention indexer (it picks the keys attended)",
    "compressor": "DeepSeek-V4's KV compressor (it pools windows of keys)",
}
#: ``nn.Linear`` subclasses peft adapts as linear: the bases of ``quantization = "nf4"``.
_QUANTIZED_LINEAR = "bitsandbytes."


def _is_plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` computing ``x @ W.T (+ b)``, around which LoRA and Opacus are exact."""
    kind = type(module)
    return isinstance(module, nn.Linear) and (
        kind.forward is nn.Linear.forward or kind.__module__.startswith(_QUANTIZED_LINEAR)
    )


def _why_frozen(path: str, module: nn.Module) -> str | None:
    """Why the ``nn.Linear`` at ``path`` is never adapted, or None if it can be."""
    for part in reversed(path.split(".")[:-1]):  # the innermost block says most
        if part in FROZEN_BLOCKS:
            return f"is in {FROZEN_BLOCKS[part]}"
    if not _is_plain_linear(module):
        return f"is a {type(module).__name__}, an nn.Linear with a forward of its own"
    return None


def _linears(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """Every ``nn.Linear``: adaptable path -> last name, and frozen last name -> why."""
    found: dict[str, str] = {}
    frozen: dict[str, str] = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear):
            name = path.rsplit(".", 1)[-1]
            if (why := _why_frozen(path, module)) is None:
                found[path] = name
            else:
                frozen.setdefault(name, f"{path} {why}")
    return found, frozen


#: Parts the start-of-run log names as frozen with the base: a path's last part -> name.
_NAMED_FROZEN = {
    "gate": "the router",  # DeepSeek's MoE gate (mlp.gate), not a *_proj
    "experts": "the routed experts",
    "indexer": "the sparse-attention indexer",
    "compressor": "the KV compressors",
    "attn_hc": "the hyper-connections",
}


def frozen_parts(model: nn.Module) -> list[str]:
    present = {path.rsplit(".", 1)[-1] for path, _ in model.named_modules()}
    return [name for part, name in _NAMED_FROZEN.items() if part in present]


def wanted_names(model_type: str, targets: str) -> tuple[str, ...]:
    """The last names that ``targets`` asks for on a ``model_type`` model."""
    if targets not in (AUTO, AUTO_MLP):
        names = tuple(dict.fromkeys(t.strip() for t in targets.split(",") if t.strip()))
        if not names:
            raise ModelError(
                "run config:lora-targets: empty; use auto, auto+mlp or a comma list of "
                "nn.Linear module names such as q_proj,v_proj"
            )
        return names
    if model_type not in ATTENTION:
        raise ModelError(
            f"run config:lora-targets: {targets} knows no adapter targets for model_type "
            f"{model_type!r} (known: {', '.join(SUPPORTED)}); set lora-targets to a comma "
            "list of its attention nn.Linear module names, such as q_proj,k_proj,v_proj,o_proj"
        )
    return ATTENTION[model_type] + (MLP if targets == AUTO_MLP else ())


def resolve_targets(model: nn.Module, model_type: str, targets: str) -> list[str]:
    """The full paths of the modules to adapt."""
    linears, frozen = _linears(model)
    wanted = wanted_names(model_type, targets)
    present = set(linears.values())
    explicit = targets not in (AUTO, AUTO_MLP)
    missing = [name for name in wanted if name not in present]
    if explicit and missing:
        why = "".join(f"; {frozen[name]}" for name in missing if name in frozen)
        raise ModelError(
            f"run config:lora-targets: {', '.join(missing)} match no adaptable nn.Linear "
            f"module of this {model_type} model (the router, routed experts, indexers and "
            f"compressors stay frozen{why}); its adaptable nn.Linear names are: "
            f"{', '.join(sorted(present))}"
        )
    if not (paths := [path for path, name in linears.items() if name in wanted]):
        raise ModelError(
            f"run config:lora-targets: {targets} matches no nn.Linear module of this "
            f"{model_type} model; set it to a comma list of: {', '.join(sorted(present))}"
        )
    return paths


def target_names(paths: Iterable[str]) -> list[str]:
    """The distinct last names of the adapted modules, for logs and adapter_config.json."""
    return sorted({path.rsplit(".", 1)[-1] for path in paths})
