"""User agent loops that training runs name by class path (``rollout.agent.loop=agent_loops:...``)."""

from __future__ import annotations

import contextlib

from helpers.agent_loops import TwoTurns

__all__ = ["TwoTurns"]  # the user-loop example of docs/agents.md, named by runs from here


class OwnReward(TwoTurns):
    """TwoTurns scoring its trajectories itself: 0.75 each (no dataset reward gives that)."""

    async def run(self, sample, ctx):
        traj = await super().run(sample, ctx)
        traj.reward = 0.75
        return traj


class EndsAtSample2(TwoTurns):
    """A loop whose own code ends abruptly on sample 2, once its trajectory is built: how is
    :meth:`end`."""

    def end(self) -> None:
        raise NotImplementedError

    async def run(self, sample, ctx):
        traj = await super().run(sample, ctx)
        if sample.index == 2:
            self.end()
        return traj


class ExitsZero(EndsAtSample2):
    """``sys.exit(0)`` on sample 2 (as ``unittest.main()`` does)."""

    def end(self) -> None:
        import sys

        sys.exit(0)


class Interrupts(EndsAtSample2):
    """``KeyboardInterrupt`` raised by the loop itself on sample 2 (no Ctrl-C)."""

    def end(self) -> None:
        raise KeyboardInterrupt


class QuitsProcess(EndsAtSample2):
    """``os._exit(0)`` on sample 2 (a one-process run's own process)."""

    def end(self) -> None:
        import os

        os._exit(0)


class AbandonsAThread(TwoTurns):
    """Sample 0 gives up on a worker thread that goes on for 3 s (a tool call that timed out)."""

    async def run(self, sample, ctx):
        import asyncio
        import time

        if sample.index == 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(time.sleep, 3), 0.05)
        return await super().run(sample, ctx)
