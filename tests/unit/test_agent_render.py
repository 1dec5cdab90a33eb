"""Tool observations rendered as the chat template renders them: the prefix invariant.

For each template family, a loop that appends generated ids as sampled and observation ids from
:class:`ChatRenderer` must end with exactly the ids ``apply_chat_template(..., tokenize=True)``
gives for the whole conversation, when the generated ids are the template's own tokenisation
of each assistant message. Templates: SmolLM2's real one (no tool support: the fallback), and
fixtures in the style of Qwen2.5, Qwen3 and Llama-3.1 on SmolLM2's vocabulary. SmolLM2 knows
ChatML's ``<|im_start|>``/``<|im_end|>``; for the Llama-3 fixture the test gives the tokenizer
Llama-3's special tokens and pre-tokenizer regex (what Llama-3's own tokenizer has), and shows
separately what goes wrong without them. One tokenizer load per module (~10 s).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from helpers.chat import CALCULATOR_TOOL

from megarl.agent import GenerateOutput, Trajectory
from megarl.agent.render import (
    ChatRenderer,
    ChatTemplateError,
    PrefixBrokenError,
    prefix_problems,
)
from megarl.agent.tool_calls import render_tools_system_prompt

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
FAMILIES = ("smollm2", "qwen2_5_style", "qwen3_style", "llama3_style")

TOOLS = [
    CALCULATOR_TOOL,
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
]
PROMPT = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "What is 12 + 7? Check it."},
]
CALC = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call>'
SEARCH = '<tool_call>\n{"name": "search", "arguments": {"query": "12 + 7"}}\n</tool_call>'
SCENARIOS = {
    "no tool call": [("The answer is 19.", [])],
    "one tool call": [(CALC, ["19"]), ("The answer is 19.", [])],
    "two tool turns": [(CALC, ["19"]), (SEARCH, ["No results."]), ("It is 19.", [])],
    "two consecutive calls": [(f"Both.\n{CALC}\n{SEARCH}", ["19", "3 results"]), ("19.", [])],
    "ends after a tool result": [(CALC, ["19"])],
}


@pytest.fixture(scope="module")
def smollm2():
    from megarl.models.hf_io import load_hf_tokenizer

    return load_hf_tokenizer(None)


def _llama3_tokenizer(smollm2, split_like_llama3: bool = True):
    """SmolLM2's vocabulary with Llama-3's special tokens (and pre-tokenizer regex)."""
    from tokenizers import Regex, pre_tokenizers

    tokenizer = copy.deepcopy(smollm2)
    if split_like_llama3:
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_SPECIAL})
    tokenizer.chat_template = (FIXTURES / "llama3_style.jinja").read_text()
    return tokenizer


@pytest.fixture(scope="module")
def tokenizers(smollm2) -> dict:
    """Each family's tokenizer: copies of SmolLM2's with the fixture template assigned."""
    out = {"smollm2": smollm2, "llama3_style": _llama3_tokenizer(smollm2)}
    for family in ("qwen2_5_style", "qwen3_style"):
        tokenizer = copy.deepcopy(smollm2)
        tokenizer.chat_template = (FIXTURES / f"{family}.jinja").read_text()
        out[family] = tokenizer
    return out


def _turn_text(family: str, index: int, content: str) -> str:
    """The assistant text a model of ``family`` writes: Qwen3 thinks before every turn."""
    if family != "qwen3_style":
        return content
    return f"<think>\nStep {index}: check the sum.\n</think>\n\n{content}"


def _run(renderer: ChatRenderer, turns, family: str = "", prompt=PROMPT):
    """A tool loop on canned turns: the generated ids are the assistant text's own tokens."""
    traj = Trajectory(renderer.prompt_ids(prompt))
    history = list(prompt)
    for index, (content, results) in enumerate(turns):
        generated = [*renderer.encode(_turn_text(family, index, content)), renderer.end_of_turn_id]
        traj.add_generated(GenerateOutput(generated, [-0.25] * len(generated), "stop"))
        history.append(renderer.assistant_message(generated))
        if results:
            new = [{"role": "tool", "content": result} for result in results]
            traj.add_observation(renderer.continuation_ids(history, new, traj.token_ids))
            history += new
    return traj, history


def _expected_ids(tokenizer, family: str, history, add_generation_prompt: bool) -> list[int]:
    """``apply_chat_template(..., tokenize=True)`` of the whole conversation, built here
    independently of the renderer (the fallback's layout spelled out for SmolLM2)."""
    tools = TOOLS
    if family == "smollm2":
        tools = None
        system = f"{PROMPT[0]['content']}\n\n{render_tools_system_prompt(TOOLS)}"
        messages = [{"role": "system", "content": system}]
        for message in history[1:]:
            if message["role"] != "tool":
                messages.append(message)
                continue
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if messages[-1]["role"] == "user" and messages[-1]["content"].startswith("<tool_"):
                messages[-1] = {"role": "user", "content": f"{messages[-1]['content']}\n{block}"}
            else:
                messages.append({"role": "user", "content": block})
        history = messages
    encoded = tokenizer.apply_chat_template(
        history, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    return list(encoded["input_ids"])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_invariant_ids_equal_the_whole_conversation_tokenized(tokenizers, family, scenario):
    tokenizer = tokenizers[family]
    renderer = ChatRenderer(tokenizer, TOOLS)
    traj, history = _run(renderer, SCENARIOS[scenario], family)
    ends_with_tool = history[-1]["role"] == "tool"
    expected = _expected_ids(tokenizer, family, history, add_generation_prompt=ends_with_tool)
    trailer = [] if ends_with_tool else renderer.encode(renderer.after_turn)
    assert list(traj.token_ids) + trailer == expected


def test_mask_one_tokens_are_the_model_text_only(tokenizers):
    renderer = ChatRenderer(tokenizers["qwen2_5_style"], TOOLS)
    traj, _ = _run(renderer, SCENARIOS["two consecutive calls"])
    pairs = list(zip(traj.response_ids, traj.response_mask, strict=True))
    trained = renderer.decode([token for token, mask in pairs if mask])
    observed = renderer.decode([token for token, mask in pairs if not mask])
    assert trained == f"Both.\n{CALC}\n{SEARCH}<|im_end|>19.<|im_end|>"
    for marker in ("<tool_response>", "<|im_start|>", "3 results"):
        assert marker not in trained
    assert observed == (
        "\n<|im_start|>user\n<tool_response>\n19\n</tool_response>\n<tool_response>\n"
        "3 results\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert {traj.response_logprobs[i] for i, (_, m) in enumerate(pairs) if not m} == {0.0}


def test_turn_markers_and_tool_support_are_probed(tokenizers):
    found = {
        family: (r.native_tools, r.end_of_turn, r.after_turn)
        for family in FAMILIES
        for r in [ChatRenderer(tokenizers[family], TOOLS)]
    }
    assert found == {
        "smollm2": (False, "<|im_end|>", "\n"),
        "qwen2_5_style": (True, "<|im_end|>", "\n"),
        "qwen3_style": (True, "<|im_end|>", "\n"),
        "llama3_style": (True, "<|eot_id|>", ""),
    }
    smollm2 = ChatRenderer(tokenizers["smollm2"], TOOLS)
    assert smollm2.end_of_turn_id == tokenizers["smollm2"].convert_tokens_to_ids("<|im_end|>")


def test_the_fallback_describes_tools_in_the_system_message(tokenizers):
    renderer = ChatRenderer(tokenizers["smollm2"], TOOLS)
    text = renderer.decode(renderer.prompt_ids(PROMPT))
    assert text.startswith("<|im_start|>system\nYou are a careful assistant.\n\n# Tools\n")
    assert '"name": "calculator"' in text and "<tool_call>" in text
    alone = renderer.decode(renderer.prompt_ids(PROMPT[1:]))
    assert alone.startswith("<|im_start|>system\n# Tools\n")  # replaces SmolLM2's default
    assert "named SmolLM" not in alone
    bare = ChatRenderer(tokenizers["smollm2"])  # no tools: the template's own prompt
    assert "named SmolLM" in bare.decode(bare.prompt_ids(PROMPT[1:]))


def test_a_turn_cut_by_a_stop_string_is_closed_by_the_observation(tokenizers):
    renderer = ChatRenderer(tokenizers["qwen2_5_style"], TOOLS)
    prompt_ids = renderer.prompt_ids(PROMPT)
    generated = renderer.encode(CALC)  # the engine stopped at "</tool_call>", no <|im_end|>
    assert not renderer.closes_turn(generated)
    history = [*PROMPT, renderer.assistant_message(generated)]
    new = [{"role": "tool", "content": "19"}]
    observation = renderer.continuation_ids(history, new, prompt_ids + generated, turn_closed=False)
    assert observation[0] == renderer.end_of_turn_id
    expected = _expected_ids(tokenizers["qwen2_5_style"], "qwen2_5_style", history + new, True)
    assert prompt_ids + generated + observation == expected


def test_ids_that_do_not_read_as_the_conversation_are_refused(tokenizers):
    renderer = ChatRenderer(tokenizers["qwen2_5_style"], TOOLS)
    traj, history = _run(renderer, [(CALC, ["19"]), (SEARCH, [])])
    lost_glue = list(traj.token_ids)
    del lost_glue[len(traj.prompt_ids) + len(renderer.encode(CALC)) + 1]  # the "\n" after it
    new = [{"role": "tool", "content": "none"}]
    with pytest.raises(PrefixBrokenError, match="does not render the conversation as its tokens"):
        renderer.continuation_ids(history, new, lost_glue)
    with pytest.raises(ValueError, match="history must end with the assistant turn"):
        renderer.continuation_ids(history[:-1], new, traj.token_ids)
    with pytest.raises(ValueError, match="no new messages"):
        renderer.continuation_ids(history, [], traj.token_ids)


def test_qwen3_reasoning_stripping_is_detected_and_named(tokenizers):
    renderer = ChatRenderer(tokenizers["qwen3_style"], TOOLS)
    tool = [{"role": "tool", "content": "19"}]
    plain = [*PROMPT, {"role": "assistant", "content": CALC}]  # a turn without reasoning
    context = renderer.prompt_ids(PROMPT) + renderer.encode(
        "<think>\n\n</think>\n\n" + CALC + "<|im_end|>"
    )
    with pytest.raises(PrefixBrokenError) as caught:
        renderer.continuation_ids(plain, tool, context)
    message = str(caught.value)
    assert "\n" not in message and caught.value.exit_code == 2
    assert "not a prefix of its continuation" in message
    assert "drops or rewrites <think> blocks of earlier assistant turns" in message
    assert "start a new sample from ChatRenderer.prompt_ids" in message

    traj, history = _run(renderer, [("The answer is 19.", [])], "qwen3_style")
    follow_up = [{"role": "user", "content": "And 19 + 1?"}]
    with pytest.raises(PrefixBrokenError, match="drops or rewrites <think> blocks"):
        renderer.continuation_ids(history, follow_up, traj.token_ids)
    assert renderer.prompt_ids(history + follow_up)  # a new sample can start from here


def test_qwen3_with_thinking_disabled_breaks_at_the_first_tool_result(tokenizers):
    renderer = ChatRenderer(
        tokenizers["qwen3_style"], TOOLS, template_kwargs={"enable_thinking": False}
    )
    prompt_ids = renderer.prompt_ids(PROMPT)
    assert renderer.decode(prompt_ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    generated = [*renderer.encode(CALC), renderer.end_of_turn_id]
    history = [*PROMPT, renderer.assistant_message(generated)]
    with pytest.raises(PrefixBrokenError, match="drops or rewrites <think> blocks"):
        renderer.continuation_ids(
            history, [{"role": "tool", "content": "19"}], prompt_ids + generated
        )


def test_prefix_problems_finds_qwen3s_behaviours_and_nothing_elsewhere(tokenizers):
    found = {
        family: [p.case for p in prefix_problems(ChatRenderer(tokenizers[family], TOOLS))]
        for family in FAMILIES
    }
    assert found == {
        "smollm2": [],
        "qwen2_5_style": [],
        "llama3_style": [],
        "qwen3_style": [
            "a tool result after a turn without reasoning",
            "two tool results after a turn without reasoning",
            "a user turn after a turn with reasoning",
        ],
    }


def test_an_end_of_turn_that_is_plain_text_is_refused(smollm2):
    """Without Llama-3's special tokens, '<|eot_id|>' is plain text to SmolLM2: BPE merges
    it with the next header, so the ids of a turn and of the glue cannot be joined."""
    plain = copy.deepcopy(smollm2)
    plain.chat_template = (FIXTURES / "llama3_style.jinja").read_text()
    joined = plain.encode("<|eot_id|><|start_header_id|>", add_special_tokens=False)
    apart = plain.encode("<|eot_id|>", add_special_tokens=False) + plain.encode(
        "<|start_header_id|>", add_special_tokens=False
    )
    assert joined != apart
    with pytest.raises(ChatTemplateError, match=r"ends an assistant turn with '<\|eot_id\|>'"):
        ChatRenderer(plain, TOOLS)


def test_a_generation_prompt_boundary_is_where_an_engine_prompt_ends(smollm2):
    """SmolLM2's GPT-2-style pre-tokenizer splits "\\n\\n" before a letter but keeps it whole
    at the end of a text. Llama-3's generation prompt ends with "\\n\\n", so with that
    pre-tokenizer the prompt's ids (what an engine is given, at every turn) differ from the
    joined conversation's there -- and only there: cut at each generation prompt, the ids agree.
    Llama-3's own pre-tokenizer keeps "\\n\\n" whole (the exact test above)."""
    tokenizer = _llama3_tokenizer(smollm2, split_like_llama3=False)
    renderer = ChatRenderer(tokenizer, TOOLS)
    traj, history = _run(renderer, SCENARIOS["two tool turns"])
    joined = _expected_ids(tokenizer, "llama3_style", history, add_generation_prompt=False)
    assert list(traj.token_ids) != joined
    text = tokenizer.apply_chat_template(history, tools=TOOLS, tokenize=False)
    assert renderer.decode(traj.token_ids) == text
    assistant_at = [i for i, message in enumerate(history) if message["role"] == "assistant"]
    cuts = [
        len(
            tokenizer.apply_chat_template(
                history[:i], tools=TOOLS, tokenize=False, add_generation_prompt=True
            )
        )
        for i in assistant_at
    ]
    pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert list(traj.token_ids) == [t for piece in pieces for t in renderer.encode(piece)]


def test_templates_that_cannot_be_used_are_refused(tokenizers, smollm2):
    bare = copy.deepcopy(smollm2)
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatRenderer(bare, TOOLS)
    renderer = ChatRenderer(tokenizers["llama3_style"], TOOLS)
    with pytest.raises(ChatTemplateError, match=r"refused a conversation of roles \[system\]"):
        renderer.prompt_ids([{"role": "system", "content": "tools need a user message"}])
