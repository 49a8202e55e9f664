"""Chat records under the published templates of DeepSeek-R1, its distills, V3 and Qwen3
(copies in tests/data/templates): the loss is on the assistant turns and nothing else,
each turn after the very prompt the template gives it at inference."""

# DeepSeek's special tokens are spelt with FULLWIDTH VERTICAL LINE (｜) on purpose.
# ruff: noqa: RUF001, RUF003

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedciuic.config import Fields, ModelSpec, NodeConfig
from fedciuic.data.corpus import ExampleSet, load_region_data
from fedciuic.data.records import Renderer, check_chat_template, parse_record
from fedciuic.data.tokenized import IGNORE
from fedciuic.errors import DataError
from fedciuic.model.adapter import AdapterModel
from fedciuic.model.presets import tiny_checkpoint
from fedciuic.model.train import example_losses
from tests.data.helpers import TEMPLATES, data_run, template, template_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
#: The templates whose generation prompt opens a reasoning block and that drop the
#: reasoning of earlier turns.
R1_FAMILY = ("deepseek-r1", "deepseek-r1-distill-qwen", "deepseek-r1-distill-llama")


def turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


QUESTION = turn("user", "Where does the data stay?")
#: One question, answered without reasoning, and with it.
SINGLE = [QUESTION, turn("assistant", "At home.")]
REASONED = [QUESTION, turn("assistant", "<think>\nThe policy says so.\n</think>\n\nAt home.")]
#: Two turns, the first one's reasoning dropped by the R1 and Qwen3 templates afterwards.
MULTI = [
    turn("system", "Be brief."),
    turn("user", "Who checks?"),
    turn("assistant", "<think>\nBoth ends do.\n</think>\n\nBoth ends."),
    turn("user", "And the relay?"),
    turn("assistant", "It sees ciphertext."),
]
CONVERSATIONS = {"single": SINGLE, "reasoned": REASONED, "multi": MULTI}
FILLER = {"text": "filler so that the split has a second record " * 2}

Rows = list[list[tuple[str, bool]]]  # each example: its runs of (text, trained)


def r1_rows(name: str) -> Rows:
    """R1's prompt ends in ``<think>\\n``: the model writes the rest of the reasoning
    (an empty block for an answer without any), the answer and EOS."""
    ask = BOS + USER + "Where does the data stay?" + ASSISTANT + "<think>\n"
    first = BOS + "Be brief." + USER + "Who checks?" + ASSISTANT
    # The first turn as the template writes it afterwards: its reasoning dropped.
    later = first + "\n\nBoth ends." + EOS + USER + "And the relay?" + ASSISTANT
    return {
        "single": [[(ask, False), ("\n</think>\n\nAt home." + EOS, True)]],
        "reasoned": [[(ask, False), ("The policy says so.\n</think>\n\nAt home." + EOS, True)]],
        "multi": [
            [(first + "<think>\n", False), ("Both ends do.\n</think>\n\nBoth ends." + EOS, True)],
            [(later + "<think>\n", False), ("\n</think>\n\nIt sees ciphertext." + EOS, True)],
        ],
    }[name]


def qwen3_rows(name: str) -> Rows:
    """Qwen3 writes the last turn's reasoning block itself (empty without reasoning)."""
    end = IM_END + "\n"
    ask = IM_START + "user\nWhere does the data stay?" + end + IM_START + "assistant\n"
    first = IM_START + "system\nBe brief." + end + IM_START + "user\nWho checks?" + end
    first += IM_START + "assistant\n"
    # The first turn as the template writes it afterwards: its reasoning dropped.
    later = first + "Both ends." + end + IM_START + "user\nAnd the relay?" + end
    later += IM_START + "assistant\n"
    return {
        "single": [[(ask, False), ("<think>\n\n</think>\n\nAt home." + end, True)]],
        "reasoned": [
            [(ask, False), ("<think>\nThe policy says so.\n</think>\n\nAt home." + end, True)]
        ],
        "multi": [
            [(first, False), ("<think>\nBoth ends do.\n</think>\n\nBoth ends." + end, True)],
            [(later, False), ("<think>\n\n</think>\n\nIt sees ciphertext." + end, True)],
        ],
    }[name]


def v3_rows(name: str) -> Rows:
    """V3 keeps every turn as written: one example per conversation."""
    ask = BOS + USER + "Where does the data stay?" + ASSISTANT
    reasoned = "<think>\nThe policy says so.\n</think>\n\nAt home." + EOS
    return {
        "single": [[(ask, False), ("At home." + EOS, True)]],
        "reasoned": [[(ask, False), (reasoned, True)]],
        "multi": [
            [
                (BOS + "Be brief." + USER + "Who checks?" + ASSISTANT, False),
                ("<think>\nBoth ends do.\n</think>\n\nBoth ends." + EOS, True),
                (USER + "And the relay?" + ASSISTANT, False),
                ("It sees ciphertext." + EOS, True),
            ]
        ],
    }[name]


EXPECTED = {
    **dict.fromkeys(R1_FAMILY, r1_rows),
    "qwen3": qwen3_rows,
    "deepseek-v3": v3_rows,
}


def chat_examples(tmp_path: Path, tokenizer: Any, messages: list[dict[str, str]], **changes: Any):
    """The examples (ids, labels) of one chat record, as a region trains on them."""
    root = tmp_path / "eu"
    root.mkdir(exist_ok=True)
    rows = [{"messages": messages}, FILLER]
    (root / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    node = NodeConfig(region="eu", data_path=str(root), state_path=str(tmp_path / "state"))
    run = data_run(**{"seq-len": 256, "eval-fraction": 0.01, **changes})
    table = load_region_data(run, node, tokenizer).train.table
    ours = [i for i in range(table.num_rows) if table[i]["record"] == 0]  # line 1
    return [(table[i]["input_ids"], table[i]["labels"]) for i in ours]


def runs(tokenizer: Any, ids: list[int], labels: list[int]) -> list[tuple[str, bool]]:
    """An example as runs of text with and without loss."""
    out = []
    for trained, run in itertools.groupby(zip(ids, labels, strict=True), lambda p: p[1] != IGNORE):
        tokens = [token for token, _ in run]
        out.append((str(tokenizer.decode(tokens)), trained))
    return out


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_published_templates_train_the_assistant_turns_and_only_them(tmp_path, name, conversation):
    tokenizer = template_tokenizer(name)
    messages = CONVERSATIONS[conversation]
    got = [runs(tokenizer, *example) for example in chat_examples(tmp_path, tokenizer, messages)]
    assert got == EXPECTED[name](conversation)
    if name == "deepseek-v3":
        return
    # One example per assistant turn, each after the prompt the template itself gives
    # that turn at inference (add_generation_prompt=True).
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    assert len(got) == len(turns)
    for (prompt, trained), i in zip((example[0] for example in got), turns, strict=True):
        assert not trained
        assert prompt == tokenizer.apply_chat_template(
            messages[:i], tokenize=False, add_generation_prompt=True
        )


@pytest.mark.parametrize("name", R1_FAMILY)
def test_an_earlier_turns_dropped_reasoning_is_trained_only_where_it_was_written(tmp_path, name):
    tokenizer = template_tokenizer(name)
    first, second = chat_examples(tmp_path, tokenizer, MULTI)
    assert "Both ends do." in runs(tokenizer, *first)[1][0]  # trained where it is written
    later = str(tokenizer.decode(second[0]))
    assert "Both ends do." not in later and "<think>\nBoth" not in later  # as at inference
    assert later.count("Both ends.") == 1  # the earlier answer: context, not trained again
    assert all(not trained for text, trained in runs(tokenizer, *second) if "Both ends." in text)


def test_a_prefix_stable_template_keeps_a_conversation_in_one_example(tmp_path):
    tokenizer = template_tokenizer("deepseek-v3")
    [(ids, _)] = chat_examples(tmp_path, tokenizer, MULTI)
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(MULTI, tokenize=False)


def test_the_template_copies_are_the_published_ones():
    """Spot checks of the copies: R1's prompt opens <think>, its distills share one
    template (whose size llama.cpp records for its Llama-8B copy), Qwen3 opens none."""
    distill = (TEMPLATES / "deepseek-r1-distill-qwen.jinja").read_bytes()
    assert distill == (TEMPLATES / "deepseek-r1-distill-llama.jinja").read_bytes()
    assert len(distill) == 2237
    for name in R1_FAMILY:  # R1 spells a newline in a Jinja string "\\n", its distills do not
        assert (
            template(name)
            .replace("\\n", "\n")
            .endswith(
                "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}"
                "{% endif %}"
            )
        )
        assert "{% set content = content.split('</think>')[-1] %}" in template(name)
    assert template("deepseek-v3").endswith("{{'<｜Assistant｜>'}}{% endif %}")
    assert "</think>" not in template("deepseek-v3")
    assert template("qwen3").endswith(
        "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and "
        "enable_thinking is false %}\n        {{- '<think>\\n\\n</think>\\n\\n' }}\n    "
        "{%- endif %}\n{%- endif %}"
    )


@pytest.mark.parametrize(
    "opener", ["{{'<｜Assistant｜><answer>\n'}}", "{{'<｜Bot｜>'}}", "{{'<｜Assistant｜>Sure! '}}"]
)
def test_a_template_that_cannot_be_masked_is_refused_naming_the_rule_and_the_fix(opener):
    tokenizer = template_tokenizer("deepseek-r1-distill-qwen")
    tokenizer.chat_template = template("deepseek-r1-distill-qwen").replace(
        "{{'<｜Assistant｜><think>\n'}}", opener
    )
    record = parse_record({"messages": SINGLE}, Fields())
    with pytest.raises(DataError) as err:
        Renderer(tokenizer).render(record)
    text = str(err.value)
    assert "\n" not in text
    assert "chat template cannot be masked for training" in text
    assert "its generation prompt is not how it begins an assistant turn" in text
    assert "The rule: rendered up to an assistant turn with add_generation_prompt=True" in text
    assert "Fix: give the checkpoint the chat template it was trained with" in text


def test_a_models_chat_template_can_be_checked_before_any_data_is_read():
    for name in EXPECTED:
        check_chat_template(template_tokenizer(name))  # each published one passes
    broken = template_tokenizer("deepseek-r1-distill-qwen")
    broken.chat_template = template("deepseek-r1-distill-qwen").replace("<think>\n'}}", "OK'}}")
    with pytest.raises(DataError, match=r"cannot be masked for training.*The rule: .*Fix: "):
        check_chat_template(broken)
    broken.chat_template = None
    with pytest.raises(DataError, match="no usable chat template"):
        check_chat_template(broken)
    strict = template_tokenizer("deepseek-v3")  # a template that refuses every conversation
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match=r"refuses a plain conversation \(record: .*alternate"):
        check_chat_template(strict)


def test_a_template_that_drops_the_reasoning_of_the_turn_being_written_still_trains_it(
    tmp_path,
):
    """R1's template before its prompt opened <think>: the reasoning is the model's to
    write, so it is trained on although the template drops it."""
    tokenizer = template_tokenizer("deepseek-r1")
    tokenizer.chat_template = template("deepseek-r1").replace(
        "{{'<｜Assistant｜><think>\\n'}}", "{{'<｜Assistant｜>'}}"
    )
    [example] = chat_examples(tmp_path, tokenizer, REASONED)
    assert runs(tokenizer, *example) == [
        (BOS + USER + "Where does the data stay?" + ASSISTANT, False),
        ("<think>\nThe policy says so.\n</think>\n\nAt home." + EOS, True),
    ]


def test_a_qwen2_checkpoint_with_r1_distills_template_trains_on_chat(tmp_path):
    """The bank's case: a Qwen2 model shaped like R1-Distill-Qwen, with its template."""
    folder = tiny_checkpoint(
        "qwen2", tmp_path / "model", tokenizer=template_tokenizer("deepseek-r1-distill-qwen")
    )
    model = AdapterModel(ModelSpec(model_path=str(folder)), device=torch.device("cpu"))
    examples = chat_examples(tmp_path, model.tokenizer, MULTI)
    assert [runs(model.tokenizer, *e) for e in examples] == r1_rows("multi")
    table = load_region_data(
        data_run(**{"seq-len": 256, "eval-fraction": 0.01}),
        NodeConfig(region="eu", data_path=str(tmp_path / "eu"), state_path=str(tmp_path / "state")),
        model.tokenizer,
    ).train.table
    ours = np.asarray([i for i in range(table.num_rows) if table[i]["record"] == 0])
    batch = ExampleSet(table, ours, ours, pad_id=0).batch(range(len(ours)))
    losses = example_losses(model.model, batch)
    assert losses.shape == (2,) and bool(torch.isfinite(losses).all()) and bool((losses > 0).all())
    losses.sum().backward()
    grads = [p.grad for p in model.model.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
