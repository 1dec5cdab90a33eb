"""Python's cyclic garbage collector and a run's long-lived objects.

A rank imports torch, Megatron-Core and transformers and builds its model: about half a million
Python objects that live as long as the process. CPython's collector walks every tracked object
on each full collection, and a training step allocates enough (token lists, metric dicts, the
rollout's Python loop) to trigger several: measured on the 2-core machine, a full collection
took 0.3 s and a 3-step tiny run spent 0.6 s of its 4.7 s in them. In a rank forked from the
fork server the walk also writes to each inherited object's header, copying the server's shared
pages into the rank one by one.

:func:`gc.freeze` moves the objects that exist now out of the collector's sight (reference
counting still frees them), so later collections walk only what the run allocates since
(after the freeze above: 0.1 s for the same run). It is done only in processes the run owns --
a rank's process the launcher started, a Ray actor, the ``megarl-train`` command -- never in a
caller's process, where a world of one runs inside someone else's program (a test session, a
notebook, ``megarl.train.main`` called with arguments) whose objects are not ours to pin. Frozen objects are given back to the collector at
exit, so the interpreter's own clean-up sees them as it would have.
"""

from __future__ import annotations

import atexit
import gc

_owned = False


def own_this_process() -> None:
    """Declare this process the run's own and freeze what it holds now (its imports).

    Called first thing by a launched rank, a Ray actor and the ``megarl-train`` command;
    :func:`freeze_after_startup` freezes again once the rank has built everything."""
    global _owned
    if not _owned:
        _owned = True
        atexit.register(gc.unfreeze)  # extension modules' leak checks expect a full clean-up
    gc.freeze()


def freeze_after_startup() -> None:
    """Freeze the objects a rank built at start-up (models, engines, data), in an owned process.

    A no-op in a caller's process (see the module docstring)."""
    if _owned:
        gc.freeze()


def owned() -> bool:
    """Whether this process declared itself the run's own (:func:`own_this_process`)."""
    return _owned
