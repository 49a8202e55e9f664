"""Which model fits one 80 GB GPU with DP: weights in bf16 and NF4, computed, not measured.

Each model is built from its published shape on the ``meta`` device (no memory, no
download) with transformers' own classes, and its parameters are counted:

* bf16: every parameter at 2 bytes.
* NF4 (``quantization = "nf4"``): bitsandbytes replaces only modules whose type is
  exactly ``nn.Linear`` (``transformers.integrations.bitsandbytes.replace_with_bnb_linear``),
  never the output projection (``lm_head``). Those weights cost 4 bits plus, with
  double quantization (fedciuic's setting), an 8-bit absmax per 64 weights and an fp32
  constant per 256 absmax: 0.516 bytes a weight. Everything else stays bf16: the
  embedding, ``lm_head``, norms, routers and the **fused routed experts** of the MoE
  families (3-D ``nn.Parameter`` tensors, not ``nn.Linear``), and V4's grouped output
  projection (a subclass of ``nn.Linear``).
* the rest of a DP step (LoRA r=8 on ``lora-targets = auto``, hooks mode, AdamW, batch
  8 x 512 tokens, gradient checkpointing on): the adapters in fp32 with their gradient,
  two AdamW moments and one per-sample gradient per example; each layer's bf16 input
  kept for the recompute (V4's residual stream is ``hc_mult`` wide); the logits, their
  log-softmax and gradient (about 8 bytes per vocabulary entry per token).

A model fits when weights plus that come to at most 72 GB (90 % of 80 GB: the CUDA
context, the allocator's slack and one layer's recomputed activations take the rest).

    PYTHONPATH=. .venv/bin/python benchmarks/model_memory.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

#: bytes per quantized weight: 4 bits, an 8-bit absmax per 64, an fp32 per 256 absmax
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
GB = 1e9
#: 90 % of an 80 GB card
BUDGET_GB = 72.0
#: The GPUs a sharded region is sized for: A100/H100 80 GB and H200 141 GB.
CAPACITIES_GB = (80, 141)
#: The region the sharded table asks about: one node of this many H200s.
NODE_GPUS = 8
LORA_RANK = 8
BATCH, SEQ = 8, 512
#: fp32 adapter, its gradient, two AdamW moments, one per-sample gradient per example
ADAPTER_BYTES = 4 + 4 + 8 + 4 * BATCH
#: bf16 logits, their log-softmax and gradient, the shifted copy
LOGIT_BYTES = 8


@dataclass(frozen=True)
class Shape:
    """A published model: its transformers ``model_type`` and the config's fields
    that differ from that config class's defaults."""

    name: str
    model_type: str
    fields: dict[str, Any] = field(default_factory=dict)
    #: the published total, where it counts layers transformers does not build (MTP)
    published: str = ""


QWEN25_VOCAB = 152064
LLAMA3_VOCAB = 128256

SHAPES: tuple[Shape, ...] = (
    Shape(
        "R1-Distill-Qwen-1.5B",
        "qwen2",
        {
            "vocab_size": 151936,
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
        },
    ),
    Shape(
        "R1-Distill-Qwen-7B",
        "qwen2",
        {
            "vocab_size": QWEN25_VOCAB,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "tie_word_embeddings": False,
        },
    ),
    Shape(
        "R1-Distill-Llama-8B",
        "llama",
        {
            "vocab_size": LLAMA3_VOCAB,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
        },
    ),
    Shape(
        # Qwen3Config's defaults are not Qwen3-8B's (22016 / 32 layers / 32 KV heads)
        "R1-0528-Qwen3-8B",
        "qwen3",
        {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "tie_word_embeddings": False,
        },
    ),
    Shape(
        "DeepSeek-V2-Lite (16B MoE)",
        "deepseek_v2",
        {
            "vocab_size": 102400,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "q_lora_rank": None,
        },
    ),
    Shape(
        "DeepSeek-V2 (236B MoE)",
        "deepseek_v2",
        {
            "vocab_size": 102400,
            "hidden_size": 5120,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "num_hidden_layers": 60,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_routed_experts": 160,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "q_lora_rank": 1536,
        },
    ),
    Shape(
        "R1-Distill-Qwen-32B",
        "qwen2",
        {
            "vocab_size": QWEN25_VOCAB,
            "hidden_size": 5120,
            "intermediate_size": 27648,
            "num_hidden_layers": 64,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
        },
    ),
    Shape(
        "R1-Distill-Llama-70B",
        "llama",
        {
            "vocab_size": LLAMA3_VOCAB,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "tie_word_embeddings": False,
        },
    ),
    # DeepseekV3Config's and DeepseekV32Config's defaults are the published V3 / V3.2 shape
    Shape("DeepSeek-V3 / R1 (671B MoE)", "deepseek_v3", published="685B with the MTP layer"),
    Shape(
        "DeepSeek-V3.1-Terminus / V3.2 (671B MoE)",
        "deepseek_v32",
        published="685B with the MTP layer",
    ),
    # DeepseekV4Config's defaults: V4-Flash (its docstring's checkpoint)
    Shape("DeepSeek-V4-Flash (284B MoE)", "deepseek_v4", published="284B, 13B active"),
)


def _meta_model(shape: Shape) -> PreTrainedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(shape.model_type, **shape.fields)
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, trust_remote_code=False
        )
    return model


def _adapter_targets(model: nn.Module, model_type: str) -> list[nn.Linear]:
    """The modules ``lora-targets = auto`` adapts."""
    from fedciuic.model.families import resolve_targets

    linears = {p: m for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    return [linears[path] for path in resolve_targets(model, model_type, "auto")]


def expert_lora(model: nn.Module) -> tuple[int, int, int]:
    """What LoRA r=8 on every routed expert would add (not built; docs/models.md,
    "Routed experts"): trainable entries, experts per layer, MoE layers. Each expert's
    ``gate_up_proj[e]`` (2I x H) and ``down_proj[e]`` (H x I) gets its own A and B."""
    entries = layers = experts = 0
    for module in model.modules():
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter):
            experts, two_i, hidden = gate_up.shape
            entries += experts * LORA_RANK * ((two_i + hidden) + sum(down.shape[1:]))
            layers += 1
    return entries, experts, layers


def count(shape: Shape) -> dict[str, Any]:
    """One model's parameters and memory, in bytes and GB."""
    model = _meta_model(shape)
    config: Any = model.config
    total = sum(p.numel() for p in model.parameters())  # a tied weight once
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]
    quantized = sum(
        module.weight.numel()
        for module in model.modules()
        if type(module) is nn.Linear and module is not head
    )
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}")
    trainable = sum(
        LORA_RANK * (m.in_features + m.out_features)
        for m in _adapter_targets(model, shape.model_type)
    )
    expert_entries, experts_per_layer, moe_layers = expert_lora(model)
    width = config.hidden_size * getattr(config, "hc_mult", 1)
    activations = (
        config.num_hidden_layers * BATCH * SEQ * width * 2
        + BATCH * SEQ * config.vocab_size * LOGIT_BYTES
    )
    step = trainable * ADAPTER_BYTES + activations
    bf16 = total * 2
    nf4 = quantized * NF4_BYTES + (total - quantized) * 2
    layers = getattr(getattr(model, "model", model), "layers", [])
    layer = max((sum(p.numel() for p in block.parameters()) for block in layers), default=0)
    fits_bf16 = (bf16 + step) / GB <= BUDGET_GB
    fits_nf4 = (nf4 + step) / GB <= BUDGET_GB
    verdict = (
        "yes, either"
        if fits_bf16
        else "NF4 only"
        if fits_nf4
        else "no: the base sharded over GPUs (below)"
    )
    return {
        "model": shape.name,
        "model_type": shape.model_type,
        "parameters": total,
        "published": shape.published,
        "routed_expert_parameters": experts,
        "nf4_quantized_parameters": quantized,
        "lora_r8_auto_trainable": trainable,
        "expert_lora_r8_trainable": expert_entries,
        "experts_per_layer": experts_per_layer,
        "moe_layers": moe_layers,
        "bf16_gb": bf16 / GB,
        "nf4_gb": nf4 / GB,
        "dp_step_gb": step / GB,
        "one_80gb_gpu": verdict,
        "largest_layer_gb": layer * 2 / GB,
        **{
            f"gpus_{capacity}gb_{kind}": sharded_gpus(
                weights / GB, layer * 2 / GB, step / GB, capacity
            )
            for capacity in CAPACITIES_GB
            for kind, weights in (("bf16", bf16), ("nf4", nf4))
        },
    }


def sharded_gpus(weights: float, layer: float, step: float, capacity: int) -> int | None:
    """The fewest GPUs of ``capacity`` GB one region needs with its base sharded over them
    (``train-sharding = "shard"``): each holds 1/N of the weights, the whole adapters
    and the rest of a DP step for its own batch, and two layers gathered whole at a time
    (the one running and the next, fetched ahead); 90 % of each card. One GPU: the whole
    base, nothing gathered. None: more than 64. Sizes in bytes."""
    budget = 0.9 * capacity * GB
    if weights + step <= budget:
        return 1
    for n in (2, 4, 8, 16, 32, 64):
        if weights / n + 2 * layer + step <= budget:
            return n
    return None


def _size(gb: float) -> str:
    return f"{gb / 1000:.2f} TB" if gb >= 1000 else f"{gb:.0f} GB" if gb >= 10 else f"{gb:.1f} GB"


def _params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n < 100e9 else f"{n / 1e9:.0f}B"


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table docs/models.md and the README show."""
    lines = [
        "| model | parameters | bf16 weights | NF4 weights | rest of a DP step | one 80 GB GPU |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        params = _params(row["parameters"])
        if row["routed_expert_parameters"]:
            params += f" ({_params(row['routed_expert_parameters'])} routed experts)"
        lines.append(
            f"| {row['model']} | {params} | {_size(row['bf16_gb'])} | {_size(row['nf4_gb'])} "
            f"| {_size(row['dp_step_gb'])} | {row['one_80gb_gpu']} |"
        )
    return "\n".join(lines)


def sharded_table(rows: list[dict[str, Any]]) -> str:
    """GPUs per region with the base sharded, and what one node of 8 x H200 trains."""

    def n(row: dict[str, Any], key: str) -> str:
        return str(row[key]) if row[key] else "> 64"

    lines = [
        "| model | largest layer | GPUs of 80 GB, bf16 / NF4 | GPUs of 141 GB, bf16 / NF4 "
        f"| one node of {NODE_GPUS} x H200 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        h200 = row["gpus_141gb_bf16"]
        verdict = (
            f"yes, bf16 on {h200}"
            if h200 and h200 <= NODE_GPUS
            else "NF4 only (not yet sharded)"
            if row["gpus_141gb_nf4"] and row["gpus_141gb_nf4"] <= NODE_GPUS
            else "no"
        )
        lines.append(
            f"| {row['model']} | {_size(row['largest_layer_gb'])} "
            f"| {n(row, 'gpus_80gb_bf16')} / {n(row, 'gpus_80gb_nf4')} "
            f"| {n(row, 'gpus_141gb_bf16')} / {n(row, 'gpus_141gb_nf4')} | {verdict} |"
        )
    return "\n".join(lines)


def expert_table(rows: list[dict[str, Any]]) -> str:
    """LoRA r=8 on the routed experts against on attention, per MoE model."""
    lines = [
        "| model | experts x MoE layers | LoRA r=8 on attention (auto) | on every routed "
        "expert | ratio | its per-sample gradients, batch 8, fp32 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        experts = row["expert_lora_r8_trainable"]
        if not experts:
            continue
        attention = row["lora_r8_auto_trainable"]
        lines.append(
            f"| {row['model']} | {row['experts_per_layer']} x {row['moe_layers']} "
            f"| {attention / 1e6:.1f} M | {experts / 1e6:,.0f} M | {experts / attention:.0f}x "
            f"| {_size(experts * 4 * BATCH / GB)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    rows = [count(shape) for shape in SHAPES]
    print(table(rows))
    print()
    print(sharded_table(rows))
    print()
    print(expert_table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
