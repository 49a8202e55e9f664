"""Presets, the locally trained BPE tokenizer and the tiny checkpoints of each architecture."""

# DeepSeek's special tokens are spelt with FULLWIDTH VERTICAL LINE (｜) on purpose.
# ruff: noqa: RUF001, RUF003

from __future__ import annotations

import math
import time

import jinja2
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from fedciuic.errors import ModelError
from fedciuic.model import presets
from fedciuic.model.presets import (
    ASSISTANT,
    BOS,
    BYTE_ASSISTANT,
    BYTE_BOS,
    BYTE_EOS,
    BYTE_USER,
    BYTE_VOCAB_SIZE,
    EOS,
    PAD,
    PRESETS,
    TINY_FAMILIES,
    TINY_VOCAB_SIZE,
    USER,
    Preset,
    bpe_tokenizer,
    byte_tokenizer,
    chat_template,
    preset_config,
    preset_tokenizer,
    tiny_checkpoint,
)

TEXTS = [
    "def f(x):\n    return x + 1  # plain ASCII , with odd spacing .",
    "数据出境前需要进行安全评估。个人信息保护法",
    "Grüße aus Köln: Straße, Maß und Übermut — ÄÖÜ äöü ß",
    "e\u0301 (not NFC), Ａ ﬁ 🤖, tabs\tand\r\nnewlines  ",
]

#: The nn.Linear leaves of each architecture's attention (what LoRA can target).
ATTENTION_LINEARS = {
    "deepseek_v3": ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"],
    "deepseek_v32": [
        "indexer.weights_proj",
        "indexer.wk",
        "indexer.wq_b",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        "q_a_proj",
        "q_b_proj",
    ],
    # layer 0 is compressed sparse attention: its compressor pools windows of keys and
    # holds the lightning indexer
    "deepseek_v4": [
        "compressor.gate_proj",
        "compressor.indexer.gate_proj",
        "compressor.indexer.kv_proj",
        "compressor.indexer.q_b_proj",
        "compressor.indexer.scorer.weights_proj",
        "compressor.kv_proj",
        "kv_proj",
        "o_a_proj",
        "o_b_proj",
        "q_a_proj",
        "q_b_proj",
    ],
    "deepseek_v2": ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_proj"],
    "qwen2": ["k_proj", "o_proj", "q_proj", "v_proj"],
    "qwen3": ["k_proj", "o_proj", "q_proj", "v_proj"],
    "llama": ["k_proj", "o_proj", "q_proj", "v_proj"],
}


#: A conversation with a system prompt, two exchanges and text beyond ASCII.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again"},
    {"role": "assistant", "content": "Grüße, 数据 🤖\n\tdone."},
]


@pytest.fixture(scope="module")
def bpe():
    return bpe_tokenizer(TINY_VOCAB_SIZE)


@pytest.fixture(scope="module")
def chat_tokenizers(bpe):
    return {"byte": byte_tokenizer(), "bpe": bpe}


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_tokenizer_round_trips_any_utf8(bpe, text):
    ids = bpe(text, add_special_tokens=False)["input_ids"]
    assert bpe.decode(ids) == text
    assert max(ids) < len(bpe) == TINY_VOCAB_SIZE


def test_bpe_tokenizer_merges_common_text(bpe):
    text = "Return the value of the function."
    assert len(bpe(text, add_special_tokens=False)["input_ids"]) < len(text) / 2


def test_bpe_special_tokens_come_first_and_stay_whole(bpe):
    assert [bpe.bos_token, bpe.eos_token, bpe.pad_token] == [BOS, EOS, PAD]
    assert bpe.convert_tokens_to_ids([BOS, EOS, PAD, USER, ASSISTANT]) == [0, 1, 2, 3, 4]
    assert set(bpe.all_special_tokens) == {BOS, EOS, PAD, USER, ASSISTANT}
    ids = bpe(f"{USER}hi{ASSISTANT}", add_special_tokens=False)["input_ids"]
    assert ids[0] == 3 and ids[-1] == 4


def test_chat_template_renders_deepseek_turns(bpe):
    messages = CONVERSATION[:4]
    turns = f"{BOS}Be brief.{USER}Hi{ASSISTANT}Hello!{EOS}{USER}Again"
    assert bpe.apply_chat_template(messages, tokenize=False) == turns
    prompt = bpe.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == turns + ASSISTANT
    no_system = bpe.apply_chat_template(messages[1:2], tokenize=False)
    assert no_system == f"{BOS}{USER}Hi"


def test_chat_template_joins_system_prompts_and_refuses_late_ones(bpe):
    messages = [
        {"role": "system", "content": "One."},
        {"role": "system", "content": "Two."},
        {"role": "user", "content": "Q"},
    ]
    assert bpe.apply_chat_template(messages, tokenize=False) == f"{BOS}One.\n\nTwo.{USER}Q"
    late = [messages[0], messages[2], messages[1]]
    with pytest.raises(jinja2.TemplateError, match="system turn must come before"):
        bpe.apply_chat_template(late, tokenize=False)


@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_chat_templates_refuse_unknown_roles(chat_tokenizers, name):
    with pytest.raises(jinja2.TemplateError, match="unknown chat role tool"):
        chat_tokenizers[name].apply_chat_template(
            [{"role": "tool", "content": "x"}], tokenize=False
        )


def test_byte_chat_template_renders_turns_with_its_own_markers():
    byte = byte_tokenizer()
    assert byte.chat_template == chat_template(BYTE_USER, BYTE_ASSISTANT, BYTE_EOS)
    turns = f"{BYTE_BOS}Be brief.{BYTE_USER}Hi{BYTE_ASSISTANT}Hello!{BYTE_EOS}{BYTE_USER}Again"
    assert byte.apply_chat_template(CONVERSATION[:4], tokenize=False) == turns
    prompt = byte.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
    assert prompt == turns + BYTE_ASSISTANT
    assert byte.apply_chat_template(CONVERSATION[1:2], tokenize=False) == f"{BYTE_BOS}{BYTE_USER}Hi"


def test_both_tokenizers_share_one_template_builder(bpe):
    assert bpe.chat_template == chat_template(USER, ASSISTANT, EOS)
    quoted = chat_template("it's\\", "\n", "\\n'")
    rendered = (
        jinja2.Environment()
        .from_string(quoted)
        .render(messages=CONVERSATION[1:3], bos_token="", add_generation_prompt=True)
    )
    assert rendered == "it's\\Hi\nHello!\\n'\n"


@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_chat_templates_are_prefix_stable(chat_tokenizers, name):
    tok = chat_tokenizers[name]
    whole = tok.apply_chat_template(CONVERSATION, tokenize=False)
    answers = [i for i, message in enumerate(CONVERSATION) if message["role"] == "assistant"]
    assert len(answers) == 2
    for i in answers:
        prompt = tok.apply_chat_template(
            CONVERSATION[:i], tokenize=False, add_generation_prompt=True
        )
        assert whole.startswith(prompt), (i, prompt)
        answered = tok.apply_chat_template(CONVERSATION[: i + 1], tokenize=False)
        assert whole.startswith(answered) and answered.endswith(tok.eos_token)


@pytest.mark.parametrize("name", ["byte", "bpe"])
def test_rendered_chats_round_trip_through_the_tokenizer(chat_tokenizers, name):
    tok = chat_tokenizers[name]
    text = tok.apply_chat_template(CONVERSATION, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 2
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == text


def test_chat_template_is_saved_and_reloaded(bpe, tmp_path):
    bpe.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.chat_template == bpe.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    text = again.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"{BOS}{USER}Hi{ASSISTANT}"
    ids = again(text, add_special_tokens=False)["input_ids"]
    assert ids == [0, 3, *bpe.encode("Hi", add_special_tokens=False), 4]


def test_bpe_cache_is_reused_and_training_is_deterministic(tmp_path, monkeypatch):
    first = bpe_tokenizer(512, cache_dir=tmp_path / "a")
    (folder,) = (tmp_path / "a").iterdir()  # no staging folder left behind
    assert folder.name.startswith("bpe512-py")
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns

    def no_training(vocab_size):
        raise AssertionError("trained again instead of loading the cache")

    with monkeypatch.context() as patch:
        patch.setattr(presets, "_train_bpe", no_training)
        began = time.perf_counter()
        again = bpe_tokenizer(512, cache_dir=tmp_path / "a")
        assert time.perf_counter() - began < 1.0
    assert (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    assert again.get_vocab() == first.get_vocab()

    bpe_tokenizer(512, cache_dir=tmp_path / "b")
    (other,) = (tmp_path / "b").iterdir()
    assert other.name == folder.name
    assert (other / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


def test_bpe_cache_defaults_to_fedciuic_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDCIUIC_CACHE", str(tmp_path))
    bpe_tokenizer(TINY_VOCAB_SIZE)
    (folder,) = (tmp_path / "tokenizers").iterdir()
    assert (folder / "tokenizer.json").is_file() and (folder / "chat_template.jinja").is_file()
    assert (folder / "fedciuic-tokenizer.json").is_file()


def test_bpe_vocab_size_out_of_reach_is_an_error(tmp_path):
    with pytest.raises(ModelError, match="at least 261"):
        bpe_tokenizer(100, cache_dir=tmp_path)
    with pytest.raises(ModelError, match="supports only"):
        bpe_tokenizer(1_000_000, cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_presets_name_their_tokenizers():
    assert all(isinstance(preset, Preset) for preset in PRESETS.values())
    assert set(PRESETS) == {"tiny", "small", "realistic"}
    assert len(preset_tokenizer("tiny")) == BYTE_VOCAB_SIZE == preset_config("tiny").vocab_size


def test_realistic_preset_is_deepseek_v3_shaped_with_the_bpe_vocabulary():
    config = preset_config("realistic")
    assert config.model_type == "deepseek_v3" and config.num_mtp_layers == 0
    assert config.q_lora_rank and config.kv_lora_rank
    assert config.first_k_dense_replace == 1 < config.num_hidden_layers
    assert config.n_shared_experts >= 1
    assert config.num_experts_per_tok is not None
    assert 1 < config.num_experts_per_tok < config.n_routed_experts
    tok = preset_tokenizer("realistic")
    assert config.vocab_size == len(tok) == 8192
    ids = (config.bos_token_id, config.eos_token_id, config.pad_token_id)
    assert ids == (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    assert 100_000_000 <= total <= 250_000_000
    assert total == 206_914_048


@pytest.mark.parametrize("lookup", [preset_config, preset_tokenizer])
def test_unknown_preset_lists_the_known_ones(lookup):
    with pytest.raises(ModelError, match=r"unknown preset 'huge'.*realistic, small, tiny"):
        lookup("huge")


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_checkpoint_loads_with_auto_classes(tiny_checkpoints, family):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[family])
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoints[family])
    assert model.config.model_type == family
    assert model.config.vocab_size == len(tokenizer) == TINY_VOCAB_SIZE
    assert model.config.pad_token_id == tokenizer.pad_token_id == 2
    assert 100_000 <= model.num_parameters() <= 1_000_000
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Was ist 数据?"}, {"role": "assistant", "content": "Daten."}],
        tokenize=False,
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids[0, 0] == tokenizer.bos_token_id and ids[0, -1] == tokenizer.eos_token_id
    loss = model(input_ids=ids, labels=ids).loss
    assert math.isfinite(loss.item())
    attention = model.model.layers[0].self_attn
    linears = sorted(
        name for name, module in attention.named_modules() if isinstance(module, torch.nn.Linear)
    )
    assert linears == ATTENTION_LINEARS[family]


def test_tiny_deepseek_checkpoints_keep_their_moe_layouts(tiny_checkpoints):
    v3 = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["deepseek_v3"]).config
    v2 = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["deepseek_v2"]).config
    assert v3.q_lora_rank and v2.q_lora_rank is None
    for config in (v3, v2):
        assert config.first_k_dense_replace == 1 < config.num_hidden_layers
        assert config.n_shared_experts >= 1 and config.n_routed_experts >= 4
    v4 = AutoModelForCausalLM.from_pretrained(tiny_checkpoints["deepseek_v4"])
    assert v4.config.layer_types == [
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert v4.config.mlp_layer_types == ["hash_moe", "moe"] and v4.config.hc_mult > 1
    # The hash router's token -> expert table reaches every expert, as a real one does.
    routes = v4.model.layers[0].mlp.gate.tid2eid
    assert set(routes.flatten().tolist()) == set(range(v4.config.n_routed_experts))


def test_tiny_checkpoint_is_seeded_and_leaves_the_callers_random_state(tmp_path, bpe):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    paths = [
        tiny_checkpoint("llama", tmp_path / name, seed=seed, tokenizer=bpe)
        for name, seed in (("a", 0), ("b", 0), ("c", 1))
    ]
    assert torch.equal(torch.rand(3), expected)
    a, b, c = (load_file(path / "model.safetensors") for path in paths)
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_unknown_family_names_the_known_ones(tmp_path):
    with pytest.raises(
        ModelError,
        match=r"'gpt2'.*deepseek_v3, deepseek_v32, deepseek_v4, deepseek_v2, qwen2, qwen3, llama",
    ):
        tiny_checkpoint("gpt2", tmp_path)
    assert not list(tmp_path.iterdir())
