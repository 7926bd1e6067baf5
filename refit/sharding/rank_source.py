"""One rank of a sharded trainer as a weight source: the rows it holds, quantized where it holds them.

Every rank of the group runs `RankSource.stream(plan)` at the same time, on
the same plan. Each yields one part per bucket (possibly empty): the rows of
that bucket's tensors the routes (`refit.sharding.routes`) give it. Ranks
meet in collectives only to agree on the routes (once per plan, after a
flag every stream), for the preflight, and for tensors routed `GATHER`, in
plan order, so every rank calls them in the same order; the ranks stream
one sync at a time (`refit.sharding.stream_turns`).

Where the rows are is the layout's business (`refit.sharding.layout`):
FSDP2's row-sharded DTensors (`DTensorLayout`, the default for a model) or
megatron-core's parallel layers (`refit.sharding.megatron.MegatronLayout`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch

from refit import errors
from refit.errors import GatherFailedError, PlanMismatchError, RefitError, with_settlement
from refit.plan.config import QuantizeOn
from refit.plan.transfer_plan import TransferPlan
from refit.quantizer.fp8_block import loadable_form
from refit.sharding.dtensor_layout import DTensorLayout
from refit.sharding.layout import ABSENT, RankLayout
from refit.sharding.routes import Route, TensorRoute, route_tensors
from refit.sharding.stream_turns import StreamTurn, take_turn
from refit.transport.buckets import WireBucket, pack_bucket

__all__ = ["RankSource"]

log = logging.getLogger(__name__)


_ENDED_HERE: dict[int, collections.deque[str]] = {}


def _ended_here(group: torch.distributed.ProcessGroup | None) -> collections.deque[str]:
    """The latest syncs whose streams this process ended as a rank of `group`.

    Why the process's, not a source's: `take_turn` waits for a holder this rank has ended (its peers are still ending
    it) and refuses one it has not. A source made again (its model reloaded) would otherwise know of none, and refuse
    its own caller's next sync while a slower peer still ends the last one."""
    return _ENDED_HERE.setdefault(id(group), collections.deque(maxlen=16))


class RankSource:
    """The weight source of one rank; `group` is the trainer's process group (every rank of the trainer)."""

    def __init__(self, model: torch.nn.Module | RankLayout, group: torch.distributed.ProcessGroup | None = None, *,
                 wire_dtype: torch.dtype | None = None) -> None:
        """`model`: an FSDP2 (or plain) model, read through a `DTensorLayout` with `wire_dtype`, or a layout."""
        if isinstance(model, torch.nn.Module):
            self.layout: RankLayout = DTensorLayout(model, wire_dtype=wire_dtype)
        elif wire_dtype is not None:
            raise TypeError("wire_dtype is the layout's setting when a layout is given")
        else:
            self.layout = model
        self.group = group
        self.rank = torch.distributed.get_rank(group)
        self.gathered_bytes = 0  # bytes this rank received from all-gathers in the last stream
        self.sent: dict[str, int] = {}  # in the last stream: tensors sent per route, "quantized_rows", "bytes"
        self._routes: tuple[tuple, dict[str, TensorRoute]] | None = None
        self._ended_syncs = _ended_here(group)  # the latest syncs streamed here, by any source of this rank
        self._unsettled: Callable[[], None] | None = None  # what a failed stream still owes its peers (`stream`)

    def metadata(self):
        return self.layout.metadata()

    def routes(self, plan: TransferPlan) -> dict[str, TensorRoute]:
        """The plan's routes, agreed by all ranks once per plan (a collective).

        Whether to agree again is decided by all ranks together (a flag each, every stream): a rank whose source was
        made again (its model reloaded, say) has none, and agreeing alone would pair its collective with the others'
        next one, the preflight's, each reading the other's payload as its own."""
        key = (plan.quantize_on, tuple((t.target, t.shape, t.block) for t in plan.tensors))
        kept: list = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(kept, self._routes is not None and self._routes[0] == key, group=self.group)
        if not all(kept):
            # A rank that cannot say what it holds still joins the exchange, with its refusal: raised alone, it would
            # leave the others in the all-gather until the group's timeout, which breaks the group for good.
            try:
                mine: dict | str = {t.target: rows for t in plan.tensors if (rows := self.layout.held(t.source)) is not ABSENT}
            except KeyError as error:
                mine = self._lacks(error)
            except Exception as error:  # noqa: BLE001 - sent to every rank, each raises it
                mine = f"trainer rank {self.rank} cannot route the plan's tensors: {type(error).__name__}: {error}"
            held: list = [None] * torch.distributed.get_world_size(self.group)
            torch.distributed.all_gather_object(held, mine, group=self.group)
            refusals = [answer for answer in held if isinstance(answer, str)]
            if refusals:
                raise PlanMismatchError("refusing to send any weight: " + "; ".join(refusals))
            self._routes = (key, route_tensors(plan, held))
        return self._routes[1]

    def stream(self, plan: TransferPlan) -> Iterator[WireBucket]:
        """This rank's part of every bucket, in plan order; every tensor it will send is checked first.

        Refused on every rank, before any collective, while another caller's sync streams from the group
        (`refit.sharding.stream_turns`). Once the ranks agreed to send, a stream that ends early still joins every
        gather left to it: closed (the consumer is gone), at once; failed, once its error is reported (the error
        carries that as its settlement, `refit.errors.take_settlement`, which `TrainerWeights` runs).

        Why: the other ranks wait in those gathers, or will, since only the
        consumer's closing stops them; left there, they wait until the
        group's timeout, which breaks the process group for good (training's
        collectives run on it too). Why not join them before reporting a
        failure: a consumer that waits for this rank's next part takes no
        more of the others' parts, so their streams stop at their next
        yield, short of the gathers this rank would wait in.
        """
        self._settle_unsettled()
        turn, gathers = None, None
        deferred = False  # whether this stream's end is left to its error's settlement
        try:
            turn = take_turn(self.group, plan, self.rank, self._ended_syncs)
            finish_updates = getattr(self.layout, "finish_parameter_updates", None)
            if finish_updates is not None:
                finish_updates()
            routes = self.routes(plan)
            self._preflight_on_every_rank(plan)
            gathers = _Gathers(self.layout, [
                planned.source for bucket in plan.buckets for planned in bucket
                if routes[planned.target].route is Route.GATHER and self.layout.joins_gather(planned.source)
            ])
            yield from self._parts(plan, routes, gathers)
        except GeneratorExit:
            if gathers is not None:
                gathers.join_the_rest(plan.sync_id)
            raise
        except Exception as error:
            if gathers is not None and gathers.left():
                deferred = True
                self._unsettled = functools.partial(self._end_failed_stream, plan, turn, gathers)
                with_settlement(error, self._settle_unsettled)
            raise
        finally:
            if not deferred:
                self._end(plan, turn)

    def _settle_unsettled(self) -> None:
        """Join the gathers a failed stream left (its peers wait in them) and end its turn; nothing if none is left.

        The stream's consumer runs it once the error is reported; a new stream runs it first if none did."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is not None:
            unsettled()

    def _end_failed_stream(self, plan: TransferPlan, turn: StreamTurn | None, gathers: _Gathers) -> None:
        try:
            gathers.join_the_rest(plan.sync_id)
        finally:
            self._end(plan, turn)

    def _end(self, plan: TransferPlan, turn: StreamTurn | None) -> None:
        if turn is not None:
            turn.end()
        if plan.sync_id is not None:
            self._ended_syncs.append(plan.sync_id)

    def _parts(self, plan: TransferPlan, routes: dict[str, TensorRoute], gathers: _Gathers) -> Iterator[WireBucket]:
        self.gathered_bytes = 0
        self.sent = {route.value: 0 for route in Route} | {"quantized_rows": 0, "bytes": 0}
        for index, bucket in enumerate(plan.buckets):
            parts: list[tuple[str, torch.Tensor]] = []
            row_offsets: dict[str, int] = {}
            for planned in bucket:
                route = routes[planned.target]
                value = None
                if route.route is Route.GATHER and self.layout.joins_gather(planned.source):
                    value = gathers.join_next(planned.source)  # every rank that joins, in plan order
                    self.gathered_bytes += value.numel() * value.element_size()
                if self.rank not in route.senders:
                    continue
                start, stop = route.rows[self.rank]
                if route.route is not Route.GATHER:
                    value = self.layout.rows(planned.source, start, stop)
                elif value is None:
                    raise PlanMismatchError(f"{planned.target}: this rank (rank {self.rank}) is to send it whole from a "
                                            "gather, but its layout says it joins no gather of it")
                block = planned.block if plan.quantize_on is QuantizeOn.TRAINER else None
                self.sent[route.route.value] += 1
                self.sent["quantized_rows"] += route.route is Route.ROWS and block is not None
                for name, tensor in loadable_form(planned.target, value.detach(), block):
                    parts.append((name, tensor))
                    row_offsets[name] = start if name == planned.target else start // planned.block[0]
            part = pack_bucket(index, parts, row_offsets=row_offsets, key=plan.integrity_key)
            self.sent["bytes"] += part.nbytes
            yield part

    def shard_bytes(self) -> int:
        """Bytes of this rank's own shards of the model."""
        return self.layout.shard_bytes()

    def _preflight_on_every_rank(self, plan: TransferPlan) -> None:
        """`_preflight` here, then every rank refuses if any rank did (a collective).

        Why: each rank checks only what it holds (a NaN lies in one FSDP2
        shard, a shape in one pipeline stage), so one rank alone would refuse
        while the others went on into a gather it never enters, waiting there
        until the group's timeout, which breaks the process group for good.
        """
        try:
            self._preflight(plan)
            mine: tuple[str, str] | None = None
        except Exception as error:  # a bug in a layout's check too: the other ranks must not wait for this one
            mine, own = (type(error).__name__, str(error)), error
        verdicts: list = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(verdicts, mine, group=self.group)
        if mine is not None:
            raise own
        refusals = [(rank, verdict) for rank, verdict in enumerate(verdicts) if verdict is not None]
        if refusals:
            rank, (kind, message) = refusals[0]
            error_class = getattr(errors, kind, None)
            if not (isinstance(error_class, type) and issubclass(error_class, RefitError)):
                error_class = RefitError
            raise error_class(f"trainer rank {rank} refused the sync, so every rank does: {message}")

    def _preflight(self, plan: TransferPlan) -> None:
        """Global shapes and dtypes against the plan (of the tensors this rank holds), and its values finite, before
        any part is sent (a replica would refuse a changed dtype only at its first bucket)."""
        held = {m.name: (m.shape, m.dtype) for m in self.layout.metadata()}
        problems = [
            f"{t.target}: {held[t.source][0]} {held[t.source][1]} in the trainer, {t.shape} {t.dtype} in the plan; "
            "make a new plan"
            for t in plan.tensors if t.source in held and held[t.source] != (t.shape, t.dtype)
        ]
        if problems:
            raise PlanMismatchError("refusing to send any weight:\n  " + "\n  ".join(problems))
        try:
            self.layout.check_finite(plan, self.rank)
        except KeyError as error:  # a tensor gone since the routes were agreed (they are kept per plan)
            raise PlanMismatchError(f"refusing to send any weight: {self._lacks(error)}") from error

    def _lacks(self, error: KeyError) -> str:
        """What a layout's `KeyError` for a planned tensor means: this rank's model has no such tensor."""
        return f"trainer rank {self.rank}'s model has no {error.args[0]}, which the plan holds"


class _Gathers:
    """The gathers one rank joins in one stream, in plan order, and how many it has joined."""

    def __init__(self, layout: RankLayout, sources: list[str]) -> None:
        self._layout, self._sources, self._joined = layout, sources, 0
        self._failed: str | None = None  # a gather that raised

    def left(self) -> bool:
        """Whether gathers are left to join (none after one raised: `join_the_rest`)."""
        return self._failed is None and self._joined < len(self._sources)

    def join_next(self, source: str) -> torch.Tensor:
        """`source` whole, the next gather in plan order."""
        if self._joined >= len(self._sources) or self._sources[self._joined] != source:
            raise PlanMismatchError(f"{source}: gathered out of plan order (internal error)")
        self._joined += 1
        try:
            return self._layout.gathered(source)
        except GatherFailedError:
            raise  # every holder raised it having met the same collectives: later gathers stay paired
        except BaseException:
            self._failed = source
            raise

    def join_the_rest(self, sync_id: str | None) -> None:
        """Join every gather left, dropping what each brings: the peers' streams wait in them.

        None after a gather raised here: which of its collectives the peers
        met is unknown (Megatron's exchanges sizes, then rows, then
        allocates), so joining more could pair unlike collectives; but a
        `GatherFailedError`, which every holder raises alike having met the
        same collectives, leaves the rest to join. Never
        raises: it runs as a stream ends, after the error that ended it; a
        gather that fails here leaves a group that gathers no more (a peer
        is gone, say). The log says so either way.
        """
        if self._failed is not None:
            log.warning("sync %s: gathering %s failed on this rank, so it joins none of the %d gather(s) left; its "
                        "peers may wait in one until the group's timeout", sync_id, self._failed,
                        len(self._sources) - self._joined)
            return
        try:
            while self.left():
                with contextlib.suppress(GatherFailedError):  # its holders all refused it alike: on to the next
                    self.join_next(self._sources[self._joined])
        except Exception as error:
            log.warning("sync %s: this rank could not join the %d gather(s) its stream left; its peers wait in them "
                        "until the group's timeout: %s", sync_id, len(self._sources) - self._joined, error)
