"""``rollout.agent.gateway.*``: where the gateway listens and how long a session may run.

Pure: a frozen dataclass, validated on creation (a bad value is one line, exit 2)."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.errors import BadInputError


@dataclass(frozen=True)
class GatewaySettings:
    """How the OpenAI/Anthropic-compatible gateway (``rollout.agent.loop=openai``) serves."""

    host: str = "127.0.0.1"
    """The address it listens on; ``0.0.0.0`` lets agents on other hosts or containers reach
    it (each request still needs the run's random API key)."""
    port: int = 0
    """0: a free port, chosen when the run starts."""
    session_timeout_s: float = 600.0
    """Wall-clock limit of one agent call (one sample's session); past it the session is
    closed (its requests get 410) and the sample fails as ``data.reward_error`` says."""

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise BadInputError(f"rollout.agent.gateway.host={self.host!r}: must be an address")
        if not 0 <= self.port <= 65535:
            raise BadInputError(f"rollout.agent.gateway.port={self.port}: must be in [0, 65535]")
        if not self.session_timeout_s > 0:
            raise BadInputError(
                f"rollout.agent.gateway.session_timeout_s={self.session_timeout_s}: "
                "must be > 0 seconds"
            )
