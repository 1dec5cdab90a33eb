"""Tool observations as token ids, exactly as the chat template renders them, glue included.

A multi-turn trajectory is ``prompt ids + generated ids + observation ids + generated ids ...``
(:class:`megarl.agent.trajectory.Trajectory`). Generated ids are kept as sampled; everything
else must be the ids the chat template would give, or the policy trains on a conversation it
never sees at inference. The traps are the *glue*: what the template writes after an assistant
turn's end-of-turn token (Qwen's ``"\\n"`` after ``<|im_end|>``), how it groups consecutive
tool messages (Qwen2.5 puts them all in one user turn of ``<tool_response>`` blocks), and the
generation prompt of the next assistant turn.

How the observation ids are computed (:meth:`ChatRenderer.continuation_ids`): the template
renders the conversation so far (``history``, ending with the assistant turn just generated) as
text without a generation prompt, and the same conversation with the new messages (every tool
result of that turn at once -- rendering them one by one splits Qwen2.5's group) with a
generation prompt. The observation is the second text from the end of the assistant's
end-of-turn token on, tokenised alone. Two checks make this exact rather than hopeful:

* **Prefix invariant.** The first text must be a prefix of the second, and the text of the
  token ids so far (decoded, never re-encoded) must equal the first text up to the assistant's
  end-of-turn token. Both hold for templates that render each message once, in order, from its
  own content. A template that re-renders earlier turns once more messages follow breaks them:
  Qwen3's drops ``<think>`` reasoning of assistant turns before the last user query, and drops
  the (empty) think block of an earlier assistant turn without reasoning. Then no continuation
  of these ids is what the template renders, and :class:`PrefixBrokenError` says so, naming
  where the texts part and the template behaviour when it recognises it. *Decision:* the
  renderer refuses; it does not patch the template. A loop that must go on starts a new sample
  from :meth:`ChatRenderer.prompt_ids` of the whole conversation (each sample then trains on its
  own turns, prime-rl's way); :func:`prefix_problems` finds these behaviours at start-up on
  synthetic conversations, so a run can refuse before it starts.
* **Token boundary.** Tokenising the observation alone gives the ids the whole text would have
  there only if BPE cannot merge across its start. The start follows the end-of-turn token, so
  the renderer requires that token to be an added (special) token of the tokenizer, which a
  tokenizer splits out before BPE (Qwen's ``<|im_end|>``, Llama-3's ``<|eot_id|>``); a template
  whose end-of-turn marker is plain text in this vocabulary is refused at construction
  (:class:`ChatTemplateError`). The observation's end is the generation prompt, where an
  engine's prompt always ends: the next generated ids follow it exactly as the first turn's
  follow the prompt, whatever BPE would do with the joined text.

Templates without tool support (they ignore ``tools``, e.g. SmolLM2's, which renders only role
and content): the renderer puts the tool format's description of the tools
(:meth:`megarl.agent.tool_calls.ToolFormat.system_prompt`) into the system message and shows
consecutive tool results as one *user* message of ``<tool_response>`` blocks (the hermes
format's words, and Qwen2.5's layout). A ``tool`` role would also render, but such models never
saw it; a user turn is a role they know, and the system prompt says results come back there.
Callers keep format-neutral messages (``role: tool``); the conversion happens at every render,
so it is the same for the prompt and every continuation.

This module imports neither torch nor transformers: it is given a tokenizer object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from megarl.agent.tool_calls import ToolFormat, get_tool_format
from megarl.errors import BadInputError

Message = Mapping[str, Any]

_PROBE_QUESTION = "What is 12 + 7?"
_PROBE_REPLY = "Let me compute that."
_PROBE_REASONING = "<think>\nAdd the ones, then the tens.\n</think>\n\n"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "megarl_probe_calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


class ChatTemplateError(BadInputError, ValueError):
    """A chat template (with this tokenizer) that exact token-in/token-out rendering cannot
    use: the message names what it does. Bad input: exit 2."""


class PrefixBrokenError(ChatTemplateError):
    """The conversation so far is not a prefix of the template's rendering of its
    continuation: no observation ids can continue these token ids faithfully."""


@dataclass(frozen=True)
class PrefixProblem:
    """A synthetic conversation on which the template breaks the prefix invariant."""

    case: str
    message: str


def _first_difference(a: str, b: str) -> int:
    limit = min(len(a), len(b))
    return next((i for i in range(limit) if a[i] != b[i]), limit)


def _excerpt(text: str, start: int) -> str:
    """40 characters of ``text`` from ``start``, quoted."""
    return repr(text[start : start + 40] + ("..." if len(text) > start + 40 else ""))


def _known_behaviour(expected: str, at: int) -> str:
    """A name for a recognised template behaviour behind a divergence at ``at``, or ''."""
    opened = expected.rfind("<think>", 0, at + len("<think>"))
    if opened != -1 and opened > expected.rfind("</think>", 0, at):  # inside a think block
        return (
            " (the template drops or rewrites <think> blocks of earlier assistant turns, as "
            "Qwen3's does once later messages follow)"
        )
    return ""


def _divergence(what: str, expected: str, actual: str) -> str:
    """One line saying where ``actual`` stops continuing ``expected`` (excerpts start a few
    characters before the first difference, so a token cut in two stays readable)."""
    at = _first_difference(expected, actual)
    start = max(0, at - 8)
    became = _excerpt(actual, start) if start < len(actual) else "nothing"
    behaviour = _known_behaviour(expected, at)
    return f"{what} at character {at}: {_excerpt(expected, start)} became {became}{behaviour}"


class ChatRenderer:
    """Renders prompts and observations of one tokenizer's chat template as token ids.

    ``tools`` are OpenAI tool schemas (:attr:`megarl.agent.tools.base.Tool.tool_schema`);
    ``template_kwargs`` go to every ``apply_chat_template`` call (e.g. ``enable_thinking``).
    Construction probes the template once (a few renders, milliseconds): which token ends an
    assistant turn, what follows it, and whether the template renders tools itself.
    """

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[Mapping[str, Any]] = (),
        *,
        tool_format: str | ToolFormat = "hermes",
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "the tokenizer has no chat template: multi-turn rendering needs one"
            )
        self.tokenizer = tokenizer
        self.tools = tuple(tools)
        self.tool_format = (
            get_tool_format(tool_format) if isinstance(tool_format, str) else tool_format
        )
        self.template_kwargs = dict(template_kwargs or {})
        self.native_tools = self._renders_tools()
        """Whether the template renders ``tools`` itself; else the system-prompt fallback."""
        self.end_of_turn, self.end_of_turn_id, self.after_turn = self._turn_end()
        """The added token that ends an assistant turn (the model's stop token), its id, and
        the text the template writes after it (Qwen: ``"\\n"``; Llama-3: nothing)."""

    # --- rendering ---------------------------------------------------------------------------

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The template's text of ``messages`` (tools added as this renderer shows them)."""
        tools = list(self.tools) if self.tools and self.native_tools else None
        return self._apply(self._template_messages(messages), tools, add_generation_prompt)

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The ids of ``messages`` with the generation prompt: a first turn's prompt (what
        :func:`megarl.trainer.rollout.encode_prompt` gives when there are no tools), or a new
        sample's after :class:`PrefixBrokenError`."""
        return self.encode(self.render_text(messages, add_generation_prompt=True))

    def assistant_message(self, generated_ids: Sequence[int]) -> dict[str, str]:
        """The assistant message of a generated turn: its text without the end-of-turn token
        (for rendering later continuations; the ids themselves stay as sampled)."""
        ids = list(generated_ids)
        if ids and ids[-1] == self.end_of_turn_id:
            ids.pop()
        return {"role": "assistant", "content": self.decode(ids)}

    def closes_turn(self, generated_ids: Sequence[int]) -> bool:
        """Whether a generated turn ended with the end-of-turn token (not cut by a length
        limit or a stop string): ``continuation_ids``' ``turn_closed``."""
        return bool(generated_ids) and generated_ids[-1] == self.end_of_turn_id

    def continuation_ids(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        context_ids: Sequence[int],
        turn_closed: bool = True,
    ) -> list[int]:
        """The ids after ``context_ids`` (prompt and generated ids so far, ending with the
        assistant turn ``history[-1]``): the template's glue, ``new_messages`` (all of them
        at once: consecutive tool messages are one group) and the next generation prompt.

        ``turn_closed=False`` when the assistant turn did not end with the end-of-turn token
        (a stop string): the observation then starts with that token. Raises
        :class:`PrefixBrokenError` when the template does not continue ``context_ids``.
        """
        if not history or history[-1].get("role") != "assistant":
            raise ValueError("continuation_ids: history must end with the assistant turn")
        if not new_messages:
            raise ValueError("continuation_ids: no new messages to render")
        before = self.render_text(history, add_generation_prompt=False)
        after = self.render_text([*history, *new_messages], add_generation_prompt=True)
        turn_end = self._assistant_turn_end(before)
        so_far = before[: turn_end if turn_closed else turn_end - len(self.end_of_turn)]
        context = self.decode(context_ids)
        if context != so_far:
            where = _divergence("the template's rendering", context, so_far)
            raise PrefixBrokenError(
                f"the chat template does not render the conversation as its tokens so far "
                f"read: {where}; the tokens cannot be continued exactly (start a new sample "
                f"from ChatRenderer.prompt_ids of the conversation)"
            )
        if not after.startswith(before):
            where = _divergence("once the new messages follow", before, after)
            raise PrefixBrokenError(
                f"the chat template re-renders earlier turns when messages follow, so a "
                f"conversation is not a prefix of its continuation: {where}; the tokens cannot "
                f"be continued exactly (start a new sample from ChatRenderer.prompt_ids of the "
                f"conversation)"
            )
        return self.encode(after[len(so_far) :])

    # --- tokenizer -----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """``text``'s ids as the engine's prompts are encoded (no BOS/EOS added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """The exact text of ``ids`` (special tokens kept, no clean-up)."""
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    # --- internals ---------------------------------------------------------------------------

    def _apply(
        self,
        messages: Sequence[Message],
        tools: list[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                [dict(message) for message in messages],
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except TemplateError as exc:
            roles = ", ".join(str(message.get("role")) for message in messages)
            raise ChatTemplateError(
                f"the chat template refused a conversation of roles [{roles}]: {exc}"
            ) from exc

    def _template_messages(self, messages: Sequence[Message]) -> list[Message]:
        """``messages`` as the template is given them: unchanged where it renders tools;
        otherwise the tools described in the system message and each run of tool messages
        as one user message (see the module docstring)."""
        if self.native_tools:
            return list(messages)
        out: list[Message] = []
        if self.tools:
            description = self.tool_format.system_prompt(self.tools)
            if messages and messages[0].get("role") == "system":
                system = dict(messages[0])
                system["content"] = f"{system['content']}\n\n{description}"
                out.append(system)
                messages = messages[1:]
            else:
                out.append({"role": "system", "content": description})
        results: list[str] = []
        for message in messages:
            if message.get("role") == "tool":
                results.append(str(message.get("content", "")))
                continue
            if results:
                out.append({"role": "user", "content": self.tool_format.results_text(results)})
                results = []
            out.append(message)
        if results:
            out.append({"role": "user", "content": self.tool_format.results_text(results)})
        return out

    def _renders_tools(self) -> bool:
        """Whether giving the template ``tools`` changes its text (it renders them)."""
        messages = [{"role": "user", "content": _PROBE_QUESTION}]
        plain = self._apply(messages, None, add_generation_prompt=True)
        return self._apply(messages, [_PROBE_TOOL], add_generation_prompt=True) != plain

    def _turn_end(self) -> tuple[str, int, str]:
        """The end-of-turn token (text, id) and what the template writes after it, read from
        the text that follows an assistant message's content."""
        conversation = [
            {"role": "user", "content": _PROBE_QUESTION},
            {"role": "assistant", "content": _PROBE_REPLY},
        ]
        text = self.render_text(conversation, add_generation_prompt=False)
        at = text.rfind(_PROBE_REPLY)
        if at == -1:
            raise ChatTemplateError(
                "the chat template does not render an assistant message's content as given"
            )
        tail = text[at + len(_PROBE_REPLY) :]
        ids = self.encode(tail)
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        token = self.decode(ids[:1])
        if not ids or ids[0] not in added or not tail.startswith(token):
            raise ChatTemplateError(
                f"the chat template ends an assistant turn with {tail[:40]!r}, which does not "
                f"start with an added (special) token of this tokenizer: the ids after a "
                f"generated turn could merge with the template's glue under BPE, so turns "
                f"cannot be joined exactly"
            )
        return token, ids[0], tail[len(token) :]

    def _assistant_turn_end(self, text: str) -> int:
        """Where the last assistant turn's end-of-turn token ends in ``text`` (rendered
        without a generation prompt, ending with that turn)."""
        ending = self.end_of_turn + self.after_turn
        if not text.endswith(ending):
            raise ChatTemplateError(
                f"the chat template does not end the last assistant turn with {ending!r} as "
                f"it did when probed (it ends {text[-40:]!r})"
            )
        return len(text) - len(self.after_turn)


def _probe_cases() -> dict[str, tuple[list[Message], list[Message]]]:
    """Synthetic (history, new messages) pairs that exercise the known ways templates break
    the prefix invariant. Each history ends with an assistant turn."""
    user = {"role": "user", "content": _PROBE_QUESTION}
    call = (
        '<tool_call>\n{"name": "megarl_probe_calculator", '
        '"arguments": {"expression": "12 + 7"}}\n</tool_call>'
    )
    plain = {"role": "assistant", "content": call}
    thinking = {"role": "assistant", "content": _PROBE_REASONING + call}
    answer = {"role": "assistant", "content": _PROBE_REASONING + "19"}
    tool = {"role": "tool", "content": "19"}
    follow_up = {"role": "user", "content": "And 19 + 1?"}
    return {
        "a tool result after a turn without reasoning": ([user, plain], [tool]),
        "two tool results after a turn without reasoning": (
            [user, plain],
            [tool, dict(tool, content="20")],
        ),
        "a tool result after a turn with reasoning": ([user, thinking], [tool]),
        "a second tool turn": ([user, plain, tool, thinking], [tool]),
        "a user turn after a turn with reasoning": ([user, answer], [follow_up]),
    }


def prefix_problems(renderer: ChatRenderer) -> tuple[PrefixProblem, ...]:
    """The synthetic conversations on which ``renderer``'s template breaks the prefix
    invariant (empty: none found), with the one-line reason for each.

    The token ids so far are the template's own rendering of each history, so only the
    template's behaviour is under test. A start-up check: a run whose loop meets one of these
    cases can refuse (or plan new samples) before generating anything.
    """
    problems = []
    for case, (history, new) in _probe_cases().items():
        before = renderer.render_text(history, add_generation_prompt=False)
        context = renderer.encode(before[: renderer._assistant_turn_end(before)])
        try:
            renderer.continuation_ids(history, new, context)
        except PrefixBrokenError as exc:
            problems.append(PrefixProblem(case, str(exc)))
    return tuple(problems)
