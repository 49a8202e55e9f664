"""Named presets: DeepSeek-V3-shaped configs built with a seeded random init, and the
tokenizers they use. No weights can be downloaded, and every party must build the
very same base, so a preset is a config plus a seed."""

from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import DeepseekV3Config, PreTrainedTokenizerFast

from fedciuic.errors import ModelError

BYTE_SPECIALS = ("<bos>", "<eos>", "<pad>")
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIALS)


def _tiny() -> DeepseekV3Config:
    # Two layers keep the DeepSeek-V3 shape: layer 0 dense, layer 1 MoE with
    # 4 routed experts (2 per token) and a shared expert; MLA with low-rank q and kv.
    # initializer_range is raised from 0.02 so that a random base has logits an
    # adapter can steer; with 0.02 the output layer is nearly flat.
    return DeepseekV3Config(
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=512,
        num_mtp_layers=0,
        initializer_range=0.1,
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


#: Named presets; a config string picks one, an unknown name lists them all.
PRESETS: dict[str, Callable[[], DeepseekV3Config]] = {"tiny": _tiny, "small": _small}


def preset_config(name: str) -> DeepseekV3Config:
    """Return the config of a named preset, or say which names exist."""
    if name not in PRESETS:
        raise ModelError(
            f"run config:model-preset: unknown preset {name!r}; choose one of "
            f"{', '.join(sorted(PRESETS))} or set model-path to a checkpoint directory"
        )
    return PRESETS[name]()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (ids 0-255 are bytes, then <bos>, <eos>, <pad>).

    Built locally so presets need no download; any UTF-8 text round-trips.
    """
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab.update({tok: 256 + i for i, tok in enumerate(BYTE_SPECIALS)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible map from bytes to printable characters, which the
    # ByteLevel pre-tokenizer uses for its alphabet.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}
