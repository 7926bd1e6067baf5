"""Which adapter a replica serves, which it is retiring, and which is staged: the bookkeeping of a swap.

Pure Python (no vLLM), beside the `UpdateLifecycle`, and for the same
reason: every transition is tested in milliseconds.

Why a swap needs bookkeeping at all: an adapter sync never touches the
base, so a replica keeps serving through it. A new version is *staged*
first (installed in the engine, served to no one), on every replica of the
fleet, and only once all of them hold it does each one *serve* it: requests
admitted from then on use it, requests already running finish on the old
one. The old one is *retiring* until its last request ends; only then may
it be unloaded. A request takes its adapter under the same lock a swap
moves the pointers under, so no request ever holds an adapter that is
being unloaded.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from refit.errors import LifecycleError, SyncTimeoutError

__all__ = ["AdapterSlots", "ServedAdapter"]


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """An adapter version as a replica holds it: the fleet's name and version, and the engine's own id for it."""

    name: str
    version: int  # the fleet's: every replica serving it gives it the same number
    lora_id: int  # vLLM's `lora_int_id`, this replica's own (never reused, so no two loaded adapters share one)

    @property
    def lora_name(self) -> str:
        # vLLM tells LoRA requests apart by name: each loaded adapter needs its own.
        return f"{self.name}-v{self.version}-{self.lora_id}"

    def lora_request(self) -> Any:
        """vLLM's `LoRARequest` for it. Its path names no directory: the adapter was installed from memory, so
        a request for it after it was unloaded fails in vLLM's loader ("No adapter found") instead of loading
        another one."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.lora_name, self.lora_id, f"refit://adapter/{self.lora_name}")

    def __str__(self) -> str:
        return f"{self.name} v{self.version}"


@dataclass(slots=True)
class _Staged:
    sync_id: str
    adapter: ServedAdapter
    at: float


class AdapterSlots:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.serving: ServedAdapter | None = None
        self.retiring: ServedAdapter | None = None
        self._staged: _Staged | None = None
        self._in_flight: Counter[int] = Counter()  # requests running, by lora id
        self._last_lora_id = 0

    @contextmanager
    def using(self) -> Iterator[ServedAdapter | None]:
        """Run one request on the adapter served now (None: the base alone), counted until it ends."""
        with self._cond:
            adapter = self.serving
            if adapter is not None:
                self._in_flight[adapter.lora_id] += 1
        try:
            yield adapter
        finally:
            if adapter is not None:
                with self._cond:
                    self._in_flight[adapter.lora_id] -= 1
                    self._cond.notify_all()

    def stage(self, sync_id: str, name: str, version: int, *,
              stale_after_s: float) -> tuple[ServedAdapter, ServedAdapter | None]:
        """Claim the staged slot for `sync_id`'s adapter `name` at `version`; returns it, and an abandoned staged one
        to unload first.

        Another sync's staged adapter is refused while it is fresh (two adapter syncs at once on one replica),
        and replaced once it is older than `stale_after_s` (its sync died between stage and serve).
        """
        with self._cond:
            if self.serving is not None and version <= self.serving.version:
                raise LifecycleError(
                    f"adapter version {version} is not above {self.serving.version}, the version served here; "
                    "a version never names two adapters"
                )
            abandoned = None
            if self._staged is not None:
                age = time.monotonic() - self._staged.at
                if self._staged.sync_id != sync_id and age < stale_after_s:
                    raise LifecycleError(
                        f"sync {self._staged.sync_id} staged adapter {self._staged.adapter} {age:.1f} s ago and has not "
                        "served it yet; run one adapter sync at a time per replica"
                    )
                abandoned = self._staged.adapter
            self._last_lora_id += 1
            adapter = ServedAdapter(name, version, self._last_lora_id)
            self._staged = _Staged(sync_id, adapter, time.monotonic())
            return adapter, abandoned

    def unstage(self, sync_id: str, version: int) -> ServedAdapter | None:
        """Give up `sync_id`'s staged `version` (a failed install, or the fleet's sync failed); returns it to unload."""
        with self._cond:
            staged = self._staged
            if staged is None or staged.sync_id != sync_id or staged.adapter.version != version:
                return None
            self._staged = None
            return staged.adapter

    def serve(self, sync_id: str, version: int) -> ServedAdapter:
        """Serve `sync_id`'s staged `version` from now on; the adapter served until now retires."""
        with self._cond:
            staged = self._staged
            if staged is None or staged.sync_id != sync_id or staged.adapter.version != version:
                held = "nothing" if staged is None else f"{staged.adapter} of sync {staged.sync_id}"
                raise LifecycleError(f"serve_adapter: sync {sync_id} staged no version {version} here (staged: {held})")
            if self.retiring is not None:
                raise LifecycleError(f"serve_adapter: {self.retiring} still retires; stage_adapter unloads it first")
            self._staged = None
            self.retiring, self.serving = self.serving, staged.adapter
            return staged.adapter

    def retired(self, timeout_s: float | None) -> ServedAdapter | None:
        """The retiring adapter once its last request has ended (to unload), waiting up to `timeout_s`
        (None: not at all: then None while it still runs a request)."""
        with self._cond:
            retiring = self.retiring
            if retiring is None:
                return None
            idle = lambda: self._in_flight[retiring.lora_id] == 0  # noqa: E731
            if timeout_s is None:
                if not idle():
                    return None
            elif not self._cond.wait_for(idle, timeout=timeout_s):
                raise SyncTimeoutError(
                    f"{self._in_flight[retiring.lora_id]} request(s) on adapter {retiring} still running after "
                    f"{timeout_s:.0f} s; it cannot be unloaded yet, and the new adapter was not staged"
                )
            self.retiring = None
            del self._in_flight[retiring.lora_id]
            return retiring
