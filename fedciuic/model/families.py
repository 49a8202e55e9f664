"""Which modules carry LoRA adapters, per architecture (run config ``lora-targets``).

``auto`` puts adapters on the attention projections of each supported family, ``auto+mlp``
adds the dense and shared-expert MLPs, and a comma list names ``nn.Linear`` modules by
their last name. The MoE router is never adapted (it is not an ``nn.Linear`` in
transformers 5, and Opacus cannot compute its per-sample gradients), and neither are the
routed experts: transformers 5 stores them fused as 3-D tensors, out of reach of peft and
Opacus (docs/models.md says what that means for quality).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from fedciuic.errors import ModelError

#: DeepSeek's multi-head latent attention: ``q_proj`` (V2-Lite, ``q_lora_rank`` unset) or
#: ``q_a_proj``/``q_b_proj`` (V3, V2), then the compressed key/value projections.
MLA = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
#: Grouped-query attention of the R1-Distill models (Qwen2, Llama, and Qwen3, whose
#: per-head q_norm/k_norm are RMSNorms, not projections: frozen with the base).
GQA = ("q_proj", "k_proj", "v_proj", "o_proj")
#: A dense or shared-expert SwiGLU MLP.
MLP = ("gate_proj", "up_proj", "down_proj")

#: ``model_type`` -> the attention projections ``auto`` adapts.
ATTENTION: dict[str, tuple[str, ...]] = {
    "deepseek_v3": MLA,
    #: V3.1-Terminus / V3.2: MLA plus the sparse-attention indexer (``indexer.wq_b``,
    #: ``wk``, ``weights_proj``), which picks the keys attended and stays frozen.
    "deepseek_v32": MLA,
    "deepseek_v2": MLA,
    "qwen2": GQA,
    "qwen3": GQA,
    "llama": GQA,
}
SUPPORTED = tuple(ATTENTION)

AUTO = "auto"
AUTO_MLP = "auto+mlp"
#: A module under this name holds routed experts: never adapted, even by a listed name.
_EXPERTS = "experts"


def linear_modules(model: nn.Module) -> dict[str, str]:
    """Every ``nn.Linear`` outside the routed experts: full path -> last name."""
    found: dict[str, str] = {}
    for path, module in model.named_modules():
        parts = path.split(".")
        if isinstance(module, nn.Linear) and _EXPERTS not in parts[:-1]:
            found[path] = parts[-1]
    return found


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
    """The full paths of the modules to adapt; a listed name that matches no
    ``nn.Linear`` is an error naming the ones there are."""
    linears = linear_modules(model)
    wanted = wanted_names(model_type, targets)
    present = set(linears.values())
    explicit = targets not in (AUTO, AUTO_MLP)
    missing = [name for name in wanted if name not in present]
    if explicit and missing:
        raise ModelError(
            f"run config:lora-targets: {', '.join(missing)} match no nn.Linear module of this "
            f"{model_type} model (routed experts and the router cannot be adapted); its "
            f"nn.Linear names are: {', '.join(sorted(present))}"
        )
    paths = [path for path, name in linears.items() if name in wanted]
    if not paths:
        raise ModelError(
            f"run config:lora-targets: {targets} matches no nn.Linear module of this "
            f"{model_type} model; set it to a comma list of: {', '.join(sorted(present))}"
        )
    return paths


def target_names(paths: Iterable[str]) -> list[str]:
    """The distinct last names of the adapted modules, for logs and adapter_config.json."""
    return sorted({path.rsplit(".", 1)[-1] for path in paths})
