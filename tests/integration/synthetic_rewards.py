"""Rewards for tests on random-init models, which never answer arithmetic right.

Importable by spawned workers (``data.reward=synthetic_rewards:char_parity``) because pytest puts
this folder on ``sys.path`` and spawned processes inherit it.
"""


def char_parity(response: str, answer: str) -> float:
    """1.0 for an even number of characters: mixed, deterministic rewards within a group."""
    return float(len(response) % 2 == 0)
