"""What the data tests share: a small run config for one region, and tokenizers with
copies of published chat templates (tests/data/templates)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from fedciuic.config import RunConfig
from fedciuic.model.presets import TINY_VOCAB_SIZE, bpe_tokenizer

#: Copies of the chat templates (tokenizer_config.json's chat_template) of published
#: checkpoints; templates/README.md says where each is from.
TEMPLATES = Path(__file__).parent / "templates"
#: The reasoning block's tags: added tokens of R1's and Qwen3's tokenizers.
THINK_TOKENS = ["<think>", "</think>"]
#: Qwen's chat markers and end of text: special tokens of its tokenizer.
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]


def data_run(**changes: Any) -> RunConfig:
    """Region eu's run config with a short training; ``changes`` by kebab-case key."""
    values = {
        "regions": "eu",
        "num-server-rounds": 1,
        "seed": 0,
        "local-steps": 1,
        "batch-size": 2,
        "learning-rate": 0.1,
        "seq-len": 128,
        "max-eval-examples": 100,
        "eval-fraction": 0.3,
        "node-wait-timeout": 1.0,
        "round-timeout": 1.0,
        **changes,
    }
    return RunConfig.from_user_config(values, source="test")


def template(name: str) -> str:
    """The chat template ``templates/NAME.jinja``, as the checkpoint's tokenizer holds it."""
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def template_tokenizer(name: str) -> PreTrainedTokenizerFast:
    """The tests' small BPE tokenizer (DeepSeek's special tokens) with the published chat
    template ``name`` and the tokens it writes: ``<think>`` and ``</think>``, and for
    Qwen3 Qwen's markers, its end of turn as EOS and no BOS (as Qwen's tokenizers)."""
    tokenizer = bpe_tokenizer(TINY_VOCAB_SIZE)
    tokenizer.add_tokens(THINK_TOKENS)
    if name.startswith("qwen"):
        tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIALS})
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.pad_token = "<|endoftext|>"
        tokenizer.bos_token = None
    tokenizer.chat_template = template(name)
    return tokenizer
