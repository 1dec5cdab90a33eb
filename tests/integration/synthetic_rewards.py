"""Rewards for tests on random-init models, which never answer arithmetic right.

Importable by spawned workers (``data.reward=synthetic_rewards:char_parity``) because pytest puts
this folder on ``sys.path`` and spawned processes inherit it.
"""

import os
import time


def char_parity(response: str, answer: str) -> float:
    """1.0 for an even number of characters: mixed, deterministic rewards within a group."""
    return float(len(response) % 2 == 0)


def mixed_groups(response: str, answer: str) -> float:
    """All-equal (zero-advantage) groups for even answers, mixed rewards for odd ones.

    Every member of a GRPO group shares the answer, so even-answer groups are pruned by the
    planner and, when a mini-batch is one such group, become ghost steps.
    """
    if int(answer) % 2 == 0:
        return 1.0
    return float(len(response) % 2 == 0)


def always_raises(response: str, answer: str) -> float:
    """A reward function with a bug: every call raises."""
    raise ValueError("this reward function always raises")


_calls = 0


def hangs_at_step_2(response: str, answer: str) -> float:
    """:func:`char_parity` for the first 8 samples (step 1 of 2 prompts x 4 samples), then a
    call that never returns, as a stuck network call would. Writes the time it started hanging
    to ``MEGARL_FAULT_INJECT_MARK`` (once)."""
    global _calls
    _calls += 1
    if _calls > 8:
        mark = os.environ.get("MEGARL_FAULT_INJECT_MARK")
        if mark and not os.path.exists(mark):
            with open(mark, "w") as handle:
                handle.write(f"{time.time():.3f}\n")
        while True:
            time.sleep(3600)
    return char_parity(response, answer)


_slow_calls = 0


def slow_for_3_s(response: str, answer: str) -> float:
    """The first call takes 3 s (longer than a test's short collective timeout); then scores
    as :func:`char_parity`."""
    global _slow_calls
    _slow_calls += 1
    if _slow_calls == 1:
        time.sleep(3)
    return char_parity(response, answer)
