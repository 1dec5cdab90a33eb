"""SFT rows as token ids and assistant masks, on SmolLM2's real tokenizer (no tool support in its
template: the system-message convention) and a Qwen2.5-style template (tools rendered natively).

What is checked is what training reads: the ids are the chat template's rendering of the whole
conversation, token for token where the agent loop would build them; the mask is 1 on exactly
the assistant turns and their end-of-turn token; an SFT'd tool call is one the tool loop parses.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.chat import CALCULATOR_TOOL, tool_call_message

from megarl.agent.render import ChatRenderer
from megarl.agent.tool_calls import HermesFormat
from megarl.algo.policy_losses import ClipSettings, get_policy_loss
from megarl.sft.conversations import BadRow, SFTKeys, conversation_of, load_examples, tokenize
from megarl.trainer.rollout import mask_runs

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOOL_ROW = {
    "messages": [
        {"role": "user", "content": "What is 12 + 7?"},
        tool_call_message("calculator", '{"expression": "12 + 7"}'),
        {"role": "tool", "tool_call_id": "c1", "content": "19"},
        {"role": "assistant", "content": "12 + 7 = 19. #### 19"},
    ],
    "tools": [CALCULATOR_TOOL],
}


@pytest.fixture(scope="module")
def tokenizer():
    from megarl.models.hf_io import load_hf_tokenizer

    return load_hf_tokenizer(None)


@pytest.fixture(scope="module")
def qwen_tokenizer(tokenizer):
    """SmolLM2's vocabulary (``<|im_end|>`` is an added token) with a Qwen2.5-style template
    that renders tools and tool calls itself."""
    import copy

    qwen = copy.deepcopy(tokenizer)
    qwen.chat_template = (FIXTURES / "chat_templates" / "qwen2_5_style.jinja").read_text()
    return qwen


def _example(tokenizer, row, keys: SFTKeys | None = None):
    conversation = conversation_of(row, keys or SFTKeys())
    renderer = ChatRenderer(tokenizer, conversation.tools)
    return tokenize(conversation, renderer, "rows.jsonl:1"), renderer


def _trained_texts(tokenizer, example) -> list[str]:
    response = example.token_ids[example.prompt_len :]
    return [
        tokenizer.decode(ids, skip_special_tokens=False)
        for ids, trained in mask_runs(response, example.mask)
        if trained
    ]


@pytest.mark.parametrize("which", ["smollm2", "qwen2_5"])
def test_a_tool_conversation_is_the_templates_rendering_with_only_assistant_turns_trained(
    tokenizer, qwen_tokenizer, which
):
    tok = tokenizer if which == "smollm2" else qwen_tokenizer
    example, renderer = _example(tok, TOOL_ROW)
    call_text, answer = _trained_texts(tok, example)
    assert answer == "12 + 7 = 19. #### 19<|im_end|>"
    assert call_text.endswith("<|im_end|>")
    # the SFT'd call is one the tool loop reads back
    parsed = HermesFormat().parse(
        call_text.removesuffix("<|im_end|>"), {"calculator": CALCULATOR_TOOL}
    )
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("calculator", {"expression": "12 + 7"})
    ]
    # the prompt is what the tool loop starts from (tools described), the whole is the template's
    assert list(example.token_ids[: example.prompt_len]) == renderer.prompt_ids(
        [{"role": "user", "content": "What is 12 + 7?"}]
    )
    conversation = conversation_of(TOOL_ROW, SFTKeys())
    from megarl.agent.gateway.sessions import template_message

    whole = renderer.render_text(
        [template_message(m, renderer) for m in conversation.messages], add_generation_prompt=False
    )
    assert (
        tok.decode(list(example.token_ids), skip_special_tokens=False) + renderer.after_turn
        == whole
    )
    assert len(example.mask) == len(example.token_ids) - example.prompt_len


def test_prompt_response_rows_and_the_runs_system_prompt(tokenizer):
    example, _ = _example(
        tokenizer,
        {"prompt": "Say hi.", "response": "Hi!"},
        SFTKeys(system_prompt="Be brief."),
    )
    assert _trained_texts(tokenizer, example) == ["Hi!<|im_end|>"]
    assert "Be brief." in tokenizer.decode(list(example.token_ids[: example.prompt_len]))
    listed, _ = _example(
        tokenizer,
        {"prompt": json.dumps([{"role": "user", "content": "Say hi."}]), "response": "Hi!"},
    )
    assert _trained_texts(tokenizer, listed) == ["Hi!<|im_end|>"]


@pytest.mark.parametrize(
    ("row", "why"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
        ({"text": "x"}, "no 'messages' column"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}],
                    },
                ]
            },
            "arguments are not valid JSON",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "content": "a"},
                    {"role": "assistant", "content": "b"},
                ]
            },
            "two assistant messages in a row",
        ),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "unknown role"),
    ],
)
def test_bad_rows_say_why(row, why):
    with pytest.raises(BadRow, match=why):
        conversation_of(row, SFTKeys())


def test_bad_rows_stop_the_load_naming_file_and_row_or_are_skipped_and_counted(tokenizer):
    rows = [
        ("d.jsonl:1", {"prompt": "Say hi.", "response": "Hi!"}),
        ("d.jsonl:2", {"messages": [{"role": "user", "content": "x"}]}),
        ("d.jsonl:3", {"prompt": "Say hi.", "response": "word " * 200}),
    ]
    renderer = ChatRenderer(tokenizer)
    with pytest.raises(BadRow, match=r"^d\.jsonl:2: no assistant turn"):
        load_examples(rows, lambda _: renderer, SFTKeys(), 128, skip_bad_rows=False)
    examples, skipped = load_examples(rows, lambda _: renderer, SFTKeys(), 128, True)
    assert [e.location for e in examples] == ["d.jsonl:1"]
    assert [s.split(":")[1] for s in skipped] == ["2", "3"]
    assert "more than the 128 allowed" in skipped[1]


def test_the_sft_loss_is_the_negative_log_likelihood_of_the_trained_tokens():
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(3, 5, 7), -1)[..., 0].requires_grad_()
    adv = torch.tensor([[1.0] * 5, [1.0] * 5, [0.0] * 5])
    out = get_policy_loss("sft").per_token(
        logp, logp.detach(), adv, torch.ones(3, 5), ClipSettings()
    )
    assert torch.equal(out.loss_BT, -adv * logp)
    out.loss_BT.sum().backward()
    assert torch.equal(logp.grad, -adv)
    assert not out.clipped_BT.any()
