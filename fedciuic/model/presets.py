"""Named presets: DeepSeek-V3-shaped configs built with a seeded random init, and the
tokenizers they use. Nothing is downloaded and every party builds the same base, so a
preset is a config plus a seed. Also a byte-level BPE tokenizer trained locally on
CPython's own text, and tiny checkpoints of each supported architecture for tests.
"""

# DeepSeek's special tokens are spelt with FULLWIDTH VERTICAL LINE (｜) on purpose.
# ruff: noqa: RUF001, RUF003

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import tokenizers
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    DeepseekV4Config,
    DeepseekV32Config,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's, as ByteLevel's

from fedciuic.data import FAMILIES, module_docs
from fedciuic.digests import cache_dir as fedciuic_cache
from fedciuic.errors import ModelError

BYTE_BOS, BYTE_EOS, BYTE_PAD = "<bos>", "<eos>", "<pad>"
BYTE_SPECIALS = (BYTE_BOS, BYTE_EOS, BYTE_PAD)
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIALS)
#: The byte tokenizer's chat role markers: plain text, as it has no tokens to spare.
BYTE_USER, BYTE_ASSISTANT = "\n### User:\n", "\n### Assistant:\n"


def chat_template(user: str, assistant: str, end_of_turn: str) -> str:
    """DeepSeek-R1's chat template with these role markers, less tool calls and ``<think>``.

    Rendering is prefix-stable, so a trainer finds the tokens to learn by rendering prompts;
    hence a late system turn is refused (DeepSeek would move it to the front).
    """
    user, assistant, end_of_turn = (_jinja_string(s) for s in (user, assistant, end_of_turn))
    return (
        "{% if add_generation_prompt is not defined %}{% set add_generation_prompt = false %}"
        "{% endif %}"
        "{% set ns = namespace(began=false, system=false) %}"
        "{{ bos_token }}"
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{% if ns.began %}{{ raise_exception('a system turn must come before the first "
        "user or assistant turn') }}{% endif %}"
        "{% if ns.system %}{{ '\\n\\n' }}{% endif %}{% set ns.system = true %}"
        "{{ message['content'] }}"
        "{% elif message['role'] == 'user' %}{% set ns.began = true %}"
        f"{{{{ {user} + message['content'] }}}}"
        "{% elif message['role'] == 'assistant' %}{% set ns.began = true %}"
        f"{{{{ {assistant} + message['content'] + {end_of_turn} }}}}"
        "{% else %}"
        "{{ raise_exception('unknown chat role ' + message['role'] "
        "+ '; use system, user or assistant') }}"
        "{% endif %}{% endfor %}"
        f"{{% if add_generation_prompt %}}{{{{ {assistant} }}}}{{% endif %}}"
    )


def _jinja_string(text: str) -> str:
    # A single-quoted Jinja string literal; Jinja reads backslash escapes in it.
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"'{escaped}'"


#: The byte tokenizer's chat template (:func:`chat_template`).
BYTE_CHAT_TEMPLATE = chat_template(BYTE_USER, BYTE_ASSISTANT, BYTE_EOS)


#: Every tiny config's. initializer_range is raised from 0.02, with which a random base's
#: output layer is nearly flat, so that an adapter can steer its logits.
_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}

#: DeepSeek-V3's layout in two layers: layer 0 dense, layer 1 MoE with 4 routed experts
#: (2 per token) and a shared expert; MLA with low-rank q and kv.
_TINY_V3_LAYOUT: dict[str, Any] = {
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}

_tiny = partial(
    DeepseekV3Config,
    **_TINY_COMMON,
    **_TINY_V3_LAYOUT,
    vocab_size=BYTE_VOCAB_SIZE,
    num_mtp_layers=0,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)


def _small() -> DeepseekV3Config:
    # Tens of millions of parameters, for a GPU: 8 layers, 8 routed experts.
    return DeepseekV3Config(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1536,
        moe_intermediate_size=512,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=64,
        max_position_embeddings=2048,
        num_mtp_layers=0,
        initializer_range=0.05,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    )


def _realistic() -> DeepseekV3Config:
    # About 207M parameters, for a GPU: the DeepSeek-V3 layout at small scale.
    return DeepseekV3Config(
        vocab_size=REALISTIC_VOCAB_SIZE,
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=256,
        num_hidden_layers=12,
        first_k_dense_replace=1,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_shared_experts=1,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=64,
        v_head_dim=64,
        max_position_embeddings=4096,
        num_mtp_layers=0,
        initializer_range=0.02,
        bos_token_id=BPE_SPECIALS.index(BOS),
        eos_token_id=BPE_SPECIALS.index(EOS),
        pad_token_id=BPE_SPECIALS.index(PAD),
    )


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Bytes as ids 0-255, then <bos>, <eos>, <pad>: built locally, so presets need no download."""
    vocab = {char: byte for byte, char in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
    vocab.update({tok: 256 + i for i, tok in enumerate(BYTE_SPECIALS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token=BYTE_BOS, eos_token=BYTE_EOS, pad_token=BYTE_PAD
    )
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


# --- A byte-level BPE tokenizer trained locally ----------------------------------------

#: DeepSeek's special tokens; the trainer gives them ids 0-4 in this order.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
BPE_SPECIALS = (BOS, EOS, PAD, USER, ASSISTANT)

#: Vocabulary of the ``realistic`` preset's tokenizer.
REALISTIC_VOCAB_SIZE = 8192

#: DeepSeek-R1's chat template with DeepSeek's markers (:func:`chat_template`).
CHAT_TEMPLATE = chat_template(USER, ASSISTANT, EOS)

#: Bumped whenever the training text, recipe or chat template changes (a new cache key).
_BPE_RECIPE = 2
#: Pairs seen fewer times are not merged; bounds the vocabulary the text supports.
_BPE_MIN_FREQUENCY = 2
_BPE_META = "fedciuic-tokenizer.json"


def bpe_tokenizer(
    vocab_size: int = REALISTIC_VOCAB_SIZE, *, cache_dir: Path | None = None
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with DeepSeek's special tokens and chat template, trained
    on CPython's own documentation and cached under ``cache_dir`` (by default
    ``$FEDCIUIC_CACHE/tokenizers``). The text depends on the Python build, so parties that
    share a vocabulary must run the same Python (the cache key names it).
    """
    if vocab_size < 256 + len(BPE_SPECIALS):
        raise ModelError(
            f"bpe tokenizer:vocab_size: {vocab_size} cannot hold the 256 bytes and "
            f"{len(BPE_SPECIALS)} special tokens; ask for at least {256 + len(BPE_SPECIALS)}"
        )
    folder = (cache_dir or fedciuic_cache() / "tokenizers") / _bpe_key(vocab_size)
    if not (folder / "tokenizer.json").is_file():
        _save_atomically(_train_bpe(vocab_size), folder)
    try:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ModelError(
            f"{folder}: cannot load the cached tokenizer ({err}); delete the folder to retrain it"
        ) from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelError(f"{folder}: not a fast tokenizer; delete the folder to retrain it")
    return tokenizer


def _bpe_key(vocab_size: int) -> str:
    python = ".".join(str(part) for part in sys.version_info[:3])
    return f"bpe{vocab_size}-py{python}-tokenizers{tokenizers.__version__}-r{_BPE_RECIPE}"


def bpe_training_text() -> list[str]:
    """The texts the BPE tokenizer is trained on, in a fixed order."""
    texts = [doc for region in FAMILIES for doc in module_docs(FAMILIES[region])]
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python stripped of pydoc's data
        return texts
    return texts + [topics[name] for name in sorted(topics)]


def _train_bpe(vocab_size: int) -> PreTrainedTokenizerFast:
    began = time.perf_counter()
    texts = bpe_training_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=_BPE_MIN_FREQUENCY,
        special_tokens=list(BPE_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ModelError(
            f"bpe tokenizer:vocab_size: the training text supports only "
            f"{tok.get_vocab_size()} tokens, not {vocab_size}; ask for at most that many"
        )
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[USER, ASSISTANT],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    digest = hashlib.sha256()
    for text in texts:
        digest.update(hashlib.sha256(text.encode()).digest())
    tokenizer.init_kwargs["fedciuic"] = {
        "texts": len(texts),
        "chars": sum(len(text) for text in texts),
        "text_sha256": digest.hexdigest(),
        "python": sys.version.split()[0],
        "tokenizers": tokenizers.__version__,
        "train_seconds": round(time.perf_counter() - began, 3),
    }
    return tokenizer


def _save_atomically(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    # Renamed into place, so no reader sees half a tokenizer; a concurrent (identical) copy wins.
    meta = tokenizer.init_kwargs.pop("fedciuic")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        tokenizer.save_pretrained(staging)
        (staging / _BPE_META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        try:
            staging.rename(folder)
        except OSError:
            if not (folder / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --- The preset table ------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A named base: its config (built with a seeded random init) and its tokenizer."""

    config: Callable[[], PreTrainedConfig]
    tokenizer: Callable[[], PreTrainedTokenizerFast]


#: Named presets; a config string picks one, an unknown name lists them all.
PRESETS: dict[str, Preset] = {
    "tiny": Preset(_tiny, byte_tokenizer),
    "small": Preset(_small, byte_tokenizer),
    "realistic": Preset(_realistic, bpe_tokenizer),
}


def _preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ModelError(
            f"run config:model-preset: unknown preset {name!r}; choose one of "
            f"{', '.join(sorted(PRESETS))} or set model-path to a checkpoint directory"
        )
    return PRESETS[name]


def preset_config(name: str) -> PreTrainedConfig:
    return _preset(name).config()


def preset_tokenizer(name: str) -> PreTrainedTokenizerFast:
    return _preset(name).tokenizer()


# --- Tiny checkpoints of each supported architecture -----------------------------------

#: Vocabulary of the BPE tokenizer tiny checkpoints use unless given another.
TINY_VOCAB_SIZE = 1024


def tiny_checkpoint(
    family: str, directory: Path, *, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None
) -> Path:
    """Save a tiny random-init model of ``family`` (loadable offline by the Auto classes)
    and its tokenizer to ``directory``; the same seed writes the same weights."""
    if family not in _TINY_CONFIGS:
        raise ModelError(
            f"tiny checkpoint:family: unknown architecture {family!r}; "
            f"choose one of {', '.join(TINY_FAMILIES)}"
        )
    tok = tokenizer if tokenizer is not None else bpe_tokenizer(TINY_VOCAB_SIZE)
    config = _TINY_CONFIGS[family](
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)  # type: ignore[no-untyped-call]
        _spread_hash_routes(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    save_tokenizer(tok, directory)
    return directory


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """Save a tokenizer saying it has no unknown token: Qwen2Tokenizer would otherwise add
    "<|endoftext|>" as one, an id past the model's vocabulary."""
    tokenizer.save_pretrained(directory)
    config_file = Path(directory) / "tokenizer_config.json"
    saved = json.loads(config_file.read_text(encoding="utf-8"))
    saved.setdefault("unk_token", None)
    config_file.write_text(json.dumps(saved, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _spread_hash_routes(model: torch.nn.Module) -> None:
    """Give V4's hash routers (``tid2eid``, zeros from transformers) a random table, so
    that a tiny checkpoint's tokens reach every expert."""
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor):
            experts = int(getattr(module, "num_experts"))  # noqa: B009
            table.copy_(torch.stack([torch.randperm(experts)[: table.shape[1]] for _ in table]))


_TINY_CONFIGS: dict[str, Callable[..., PreTrainedConfig]] = {
    "deepseek_v3": _tiny,
    # V3's layout plus V3.2's sparse-attention indexer, which keeps index_topk keys a query.
    "deepseek_v32": partial(
        DeepseekV32Config,
        **_TINY_COMMON,
        **_TINY_V3_LAYOUT,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=2,
    ),
    # V4's blocks, each at least once, window and compression rates small enough for tests.
    "deepseek_v4": partial(
        DeepseekV4Config,
        **_TINY_COMMON,
        moe_intermediate_size=32,
        head_dim=32,
        q_lora_rank=32,
        partial_rotary_factor=0.25,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        hc_mult=2,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
    ),
    # The V2-Lite layout: a plain q_proj (no q_lora_rank), low-rank kv, a dense then a MoE layer.
    "deepseek_v2": partial(
        DeepseekV2Config,
        **_TINY_COMMON,
        num_key_value_heads=4,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_shared_experts=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
    "qwen2": partial(Qwen2Config, **_TINY_COMMON, num_key_value_heads=2),
    # DeepSeek-R1-0528-Qwen3-8B's layout: GQA with an explicit head_dim, q/k RMSNorms.
    "qwen3": partial(Qwen3Config, **_TINY_COMMON, num_key_value_heads=2, head_dim=16),
    "llama": partial(LlamaConfig, **_TINY_COMMON, num_key_value_heads=2),
}
#: Architectures :func:`tiny_checkpoint` builds (``model_type`` of their configs).
TINY_FAMILIES = tuple(_TINY_CONFIGS)
