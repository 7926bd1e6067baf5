"""The public API is the contract: what `refit` exports is visible to type checkers, and the actors implement the protocols.

Pure source inspection: no Ray, no vLLM.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import enum
import inspect
import typing
from pathlib import Path

import pytest

import refit
from refit import errors
from refit.protocols import RolloutReplica, WeightSource

ROOT = Path(refit.__file__).parent


def test_every_lazy_name_is_also_imported_for_type_checkers_and_resolves():
    tree = ast.parse((ROOT / "__init__.py").read_text())
    typed = {alias.name for node in ast.walk(tree) if isinstance(node, ast.If)
             for stmt in ast.walk(node) if isinstance(stmt, ast.ImportFrom) for alias in stmt.names}
    assert typed == set(refit._LAZY)
    for name in refit.__all__:
        assert getattr(refit, name) is not None, name


def test_the_package_is_marked_typed():
    assert (ROOT / "py.typed").is_file()


def test_the_config_enums_are_exported_together():
    """Every enum a `SyncConfig` setting takes is a public name of `refit`, so a caller never reaches into a submodule."""
    hints = typing.get_type_hints(refit.SyncConfig)
    enums = {hints[field.name] for field in dataclasses.fields(refit.SyncConfig)
             if isinstance(hints[field.name], type) and issubclass(hints[field.name], enum.Enum)}
    assert {cls.__name__ for cls in enums} >= {"Verify", "Transport", "Pause", "QuantizeOn", "Delta", "KvScalePolicy"}
    for cls in enums:
        assert cls.__name__ in refit.__all__ and getattr(refit, cls.__name__) is cls, cls.__name__


def test_every_exception_lives_in_errors_and_every_public_one_is_exported():
    """`refit.errors.__all__` lists every exception the package defines; `refit` exports each that a caller can catch
    (a `RefitError`), and nothing beside them and the lazy names."""
    def is_exception(base: ast.expr) -> bool:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        builtin = getattr(builtins, name, None)
        return name in errors.__all__ or (isinstance(builtin, type) and issubclass(builtin, BaseException))

    elsewhere = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name}" for path in sorted(ROOT.rglob("*.py"))
                 if path != ROOT / "errors.py" for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ClassDef) and any(map(is_exception, node.bases))]
    assert not elsewhere, "exceptions outside refit/errors.py: " + ", ".join(elsewhere)
    classes = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == errors.__name__}
    assert set(errors.__all__) == classes
    public = {name for name in classes if issubclass(getattr(errors, name), errors.RefitError)}
    assert set(refit.__all__) == public | set(refit._LAZY)
    for name in public:
        assert getattr(refit, name) is getattr(errors, name), name


def _methods(protocol: type) -> list[str]:
    return [n for n in protocol.__dict__ if not n.startswith("_") and callable(getattr(protocol, n))]


def _actor_classes():
    from actors import AsyncRolloutActor, RolloutActor, ServerRollout, TrainerActor, TrainerRank

    return [pytest.param(protocol, actor, id=f"{actor.__ray_metadata__.class_name}-{protocol.__name__}")
            for protocol, actor in [(WeightSource, TrainerActor), (WeightSource, TrainerRank),
                                    (RolloutReplica, RolloutActor), (RolloutReplica, AsyncRolloutActor),
                                    (RolloutReplica, ServerRollout)]]


@pytest.mark.parametrize(("protocol", "actor"), _actor_classes())
def test_the_actors_implement_their_protocol_method_by_method(protocol, actor):
    _assert_implements(protocol, actor.__ray_metadata__.modified_class)


@pytest.mark.parametrize("mixin", ["ReplicaMethods", "AsyncReplicaMethods"])
def test_the_replica_mixins_for_users_engines_implement_the_protocol_method_by_method(mixin):
    _assert_implements(RolloutReplica, getattr(refit, mixin))


def _assert_implements(protocol: type, cls: type) -> None:
    for name in _methods(protocol):
        declared, implemented = inspect.signature(getattr(protocol, name)), inspect.signature(getattr(cls, name))
        # Every parameter of the protocol, in its order and with its default; an implementation may take more.
        wanted = [(p.name, p.default) for p in declared.parameters.values()]
        given = [(p.name, p.default) for p in implemented.parameters.values()][: len(wanted)]
        assert given == wanted, (cls.__name__, name, str(implemented))
        assert implemented.return_annotation == declared.return_annotation, (cls.__name__, name, str(implemented))
