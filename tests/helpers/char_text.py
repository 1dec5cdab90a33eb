"""Character-level text fakes for rollout tests: a tokenizer whose ids are the characters' code
points and an engine that answers with scripted texts.

Reward, shaping and dynamic-sampling tests drive the real :class:`RolloutProducer` and read its
rewards from response *texts*; with one id per character, what a test scripts is exactly what
the reward function sees after decoding, and lengths in tokens are lengths in characters.
"""

from __future__ import annotations

from megarl.engines.base import Generation


class CharTokenizer:
    """One token per character (id = ``ord``), no chat template, no special tokens."""

    chat_template = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class TextQueueEngine:
    """Answers every request with the next text of ``texts``, in order (finished, logprobs 0);
    only ``generate_requests`` exists, which is all the rollout producer calls."""

    def __init__(self, texts: list[str]):
        self.texts = list(texts)

    def generate_requests(self, requests, params, interrupt=None):
        out = []
        for request in requests:
            response = tuple(ord(c) for c in self.texts.pop(0))
            out.append(Generation(request.prompt_ids, response, (0.0,) * len(response), True))
        return out
