"""Imports without the collector's passes leave it as they found it; refit's actor processes freeze what their imports made."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from refit.import_heap import collector_paused
from tests.support.scripts import REPO


def test_the_collector_is_paused_inside_and_enabled_again_after_even_on_error():
    assert gc.isenabled()
    with pytest.raises(ImportError), collector_paused():
        assert not gc.isenabled()
        import refit._no_such_module  # noqa: F401
    assert gc.isenabled()


def test_a_collector_paused_by_the_caller_stays_paused():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_driver_importing_the_actors_keeps_its_collector_and_a_trainer_freezes_its_imports_and_exits_quietly():
    """A driver imports `actors` too: only a process refit's actor owns freezes its heap (at the actor's start).

    Unfrozen at exit: frozen, triton's nanobind bindings would report each of their objects as leaked.
    """
    check = """
import gc, actors
from fixtures import model_dir
assert gc.isenabled() and gc.get_freeze_count() == 0, (gc.isenabled(), gc.get_freeze_count())
actors.TrainerActor.__ray_metadata__.modified_class.__ray_actor_class__(str(model_dir(True, "bf16")))
assert gc.isenabled() and gc.get_freeze_count() > 0, (gc.isenabled(), gc.get_freeze_count())
"""
    done = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaked" not in done.stderr, done.stderr[-3000:]


def test_a_started_trainer_and_rollout_collect_again_with_their_import_heap_frozen(actors_factory):
    from fixtures import model_dir
    from tests.support.actors import collector_state, run_in

    trainer = actors_factory.trainer(model_dir(True, "bf16"))
    rollout = actors_factory.rollout(model_dir(True, "bf16"), load_format="dummy")
    assert run_in(trainer, collector_state) == run_in(rollout, collector_state) == (True, True)
