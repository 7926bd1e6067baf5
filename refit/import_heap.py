"""The objects that importing torch, transformers and vLLM makes, kept out of the garbage collector's way.

Those imports make over a million objects (modules, classes, functions,
dataclass and pydantic machinery) that live as long as the process. While
they are being made, the cyclic collector runs its automatic passes, and
each full pass walks every object made so far: about a quarter of the
imports' CPU (on a 2-core AVX-512 CPU, what a rollout process imports takes
~10 CPU-s with those passes and ~7.6 without). Every actor process refit
starts pays for its imports once, and an RL job starts many (as does this
repository's test suite, which runs on CPU time), so the passes are skipped
while importing.
"""

from __future__ import annotations

import atexit
import functools
import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused", "freeze_import_heap"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Import inside this block without the cyclic collector's passes.

    Safe in any process: nothing is lost, only deferred. Cycles that become
    garbage inside the block (imports make few) are found by the first
    collection after it, which the collector runs as usual.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_import_heap() -> None:
    """Move every object alive now (the imports of torch, transformers and vLLM) out of the garbage collector's reach.

    After the imports, each full collection would still walk all of them:
    vLLM's start runs a full `gc.collect()` five times, ~0.2 s apiece on a
    2-core CPU, half the start of a small engine. vLLM freezes its heap itself once
    started (`freeze_gc_heap`); freezing before the start saves those walks.
    Objects frozen are never collected, so call it only where that is what is
    wanted: in a process a refit actor owns, after its imports and before the
    work that makes objects meant to die (an engine, a model).

    The heap is unfrozen again when the process exits, so that the
    interpreter's shutdown frees it as it would have: extension modules built
    with nanobind (triton's, which torch and transformers import) report every
    object of theirs still alive at shutdown, one line each, into the actor's
    log.
    """
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)
