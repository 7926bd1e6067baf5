"""The transfer plan: what is sent, in which form, in which bucket.

Made once per (trainer, rollout model) pair from metadata alone, then reused
by every sync: names, shapes, which tensors are FP8_BLOCK-quantized, the
tied aliases, and the bucket layout. The producer checks each tensor
against it, so a trainer whose model changed shape is refused before any
byte is sent.

Trainer and driver processes import this module, so it must not import
vLLM (5 s, and images without it). The one thing it would take from vLLM is
the decoder-layer order of names (`layerwise_groups` in
vllm/distributed/weight_transfer/base.py); `_layer_order` follows the same
rule and tests/plan/test_layer_order.py checks it against vLLM's.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from refit.errors import ConfigError, InvalidTensorError, PlanMismatchError
from refit.plan.config import Draft, QuantizeOn, SyncConfig
from refit.plan.expected_weights import ExpectedWeight, expected_weights, may_stream
from refit.plan.mtp_layers import mtp_prefixes
from refit.plan.tensors import TensorMeta, checked_metadata, module_classes
from refit.quantizer import Fp8BlockQuantizer, Fp8BlockScheme
from refit.quantizer.fp8_block import SUPPORTED_DTYPES
from refit.transport.buckets import wire_dtype_problem

__all__ = ["DRAFT_PREFIX", "TIED_HEAD", "PlannedTensor", "RolloutModelInfo", "TransferPlan", "bucket_bound",
           "layer_key", "make_plan"]

_QUANTIZABLE = tuple(str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES)

TIED_HEAD = "lm_head.weight"
"""The name a rollout that ties its embeddings loads its output head under: planned as a copy of the embedding."""

DRAFT_PREFIX = "draft."
"""How a trainer names its speculative draft model's tensors: `draft.` + the draft checkpoint's name. The plan
and the wire keep the prefix; the replica loads them into its draft model without it.

MTP layers (`RolloutModelInfo.mtp_prefixes`) are the one exception on the trainer's side: they are in the
target's own checkpoint, so a trainer names them as it does (`model.mtp_layers.0.*`); the plan still sends them
as `draft.` + that name, so the replica routes every draft tensor one way."""


@dataclass(frozen=True, slots=True)
class RolloutModelInfo:
    """What a plan needs to know about the rollout's model: its quantization, tying, and expected weights."""

    quantization_config: dict[str, Any] | None
    tie_word_embeddings: bool
    weights: tuple[ExpectedWeight, ...] | None = None  # None: unknown, the plan is not checked against it
    vocab_size: int | None = None  # for the logprob probe's prompts
    draft: RolloutModelInfo | None = None  # its speculative draft model's, if it decodes with one
    mtp_prefixes: tuple[str, ...] = ()
    """A draft of MTP layers: where the target's checkpoint holds them (`model.mtp_layers.0.`), and so the names a
    trainer sends them under; empty for a draft model of its own checkpoint (sent as `draft.` + its names)."""
    serves_lora: bool = False
    """The engine applies LoRA adapters over its base itself (vLLM's `enable_lora`, `EngineConfig.lora_rank`)."""

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> RolloutModelInfo:
        """From a `config.json` as a dict alone (no expected weights); multimodal configs keep the text
        model's fields in `text_config`."""
        text_config = config.get("text_config") or config
        quantization = config.get("quantization_config")
        vocab = text_config.get("vocab_size")
        return cls(dict(quantization) if quantization else None, _ties_embeddings(config, text_config),
                   vocab_size=int(vocab) if vocab else None)

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, *, from_files: bool, mtp: bool = False) -> RolloutModelInfo:
        """From a rollout's model directory, with its expected weights (see `expected_weights`).

        `from_files`: the engine loaded the checkpoint's files (not `load_format="dummy"`). `mtp`: the engine
        drafts with the checkpoint's MTP layers (vLLM's `method="mtp"`): they become its draft's expected
        weights, planned in the draft's own quantization form (the target's scheme, which vLLM's drafter
        shares), and leave the target's.
        """
        path = Path(model_dir) / "config.json"
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: not valid JSON ({error})") from None
        if not isinstance(config, dict):
            raise ConfigError(f"{path}: expected a JSON object, not a {type(config).__name__}")
        info = cls.from_hf_config(config)
        weights = expected_weights(model_dir, info.quantization_config, from_files=from_files)
        if not mtp:
            return cls(info.quantization_config, info.tie_word_embeddings, weights, info.vocab_size)
        prefixes = mtp_prefixes(config)
        draft = cls(info.quantization_config, False, tuple(w for w in weights if w.name.startswith(prefixes)),
                    info.vocab_size, mtp_prefixes=prefixes)  # untied: it shares the target's lm_head, never loads one
        return cls(info.quantization_config, info.tie_word_embeddings,
                   tuple(w for w in weights if not w.name.startswith(prefixes)), info.vocab_size, draft)

    def with_draft(self, draft: RolloutModelInfo | None) -> RolloutModelInfo:
        return replace(self, draft=draft)


def _ties_embeddings(config: Mapping[str, Any], text_config: Mapping[str, Any]) -> bool:
    """`tie_word_embeddings` as vLLM reads it: transformers writes a config.json without the keys equal to their
    default, and that default is True for some model types (Gemma, GPT-2), so a missing key is the type's default."""
    if "tie_word_embeddings" in text_config:
        return bool(text_config["tie_word_embeddings"])
    from transformers import AutoConfig

    model_type = text_config.get("model_type") or config.get("model_type")
    try:
        default = AutoConfig.for_model(model_type).get_text_config()
    except ValueError as error:
        raise ConfigError(
            f"the rollout's config.json has no tie_word_embeddings, and transformers does not know its "
            f"model_type={model_type!r}, whose default it would be; set tie_word_embeddings in config.json"
        ) from error
    return bool(getattr(default, "tie_word_embeddings", False))


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    target: str  # the name the rollout's loaders take (its checkpoint format)
    source: str  # the trainer parameter it is read from
    shape: tuple[int, ...]
    dtype: str
    block: tuple[int, int] | None  # FP8_BLOCK block structure if the rollout expects it quantized

    @property
    def is_quantized(self) -> bool:
        return self.block is not None

    @property
    def source_bytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize

    @property
    def quantized_bytes(self) -> int:
        """FP8 codes plus block scales if quantized, else the tensor itself."""
        if self.block is None:
            return self.source_bytes
        (rows, cols), (bh, bw) = self.shape, self.block
        return math.prod(self.shape) + -(-rows // bh) * -(-cols // bw) * getattr(torch, self.dtype).itemsize

    def wire_bytes(self, quantize_on: QuantizeOn) -> int:
        return self.quantized_bytes if quantize_on is QuantizeOn.TRAINER else self.source_bytes


class _PlanText:
    """A plan's buckets and copies as JSON text, or None until first asked for (`TransferPlan.to_plain`)."""

    __slots__ = ("text",)

    def __init__(self, text: str | None = None) -> None:
        self.text = text

    def of(self, plan: TransferPlan) -> str:
        if self.text is None:  # two threads may both encode: the same text, either kept
            plain = {"quantize_on": str(plan.quantize_on),
                     "buckets": [[[t.target, t.source, list(t.shape), t.dtype, None if t.block is None else list(t.block)]
                                  for t in bucket] for bucket in plan.buckets],
                     "copies": [list(pair) for pair in plan.copies], "lora_served": plan.lora_served}
            self.text = json.dumps(plain, separators=(",", ":"))
        return self.text


@dataclass(frozen=True, slots=True)
class TransferPlan:
    buckets: tuple[tuple[PlannedTensor, ...], ...]
    quantize_on: QuantizeOn
    integrity_key: bytes | None = field(default=None, repr=False, compare=False)
    """One sync's secret for the integrity tags of its bytes (refit/transport/integrity.py), or None for a
    plan not yet handed to a sync, or a sync with `verify="off"`. Set by the Syncer per sync (`for_sync`),
    so it reaches the trainer and the replicas with the plan, over Ray, never over the data plane."""
    sync_id: str | None = field(default=None, compare=False)
    """The sync attempt this copy of the plan is for (`for_sync`), or None for a plan not handed to one. A
    sharded trainer's ranks take turns by it: they stream one sync at a time (refit/sharding/stream_turns.py)."""
    timeout_s: float | None = field(default=None, compare=False)
    """That sync's deadline for each remote call (`SyncConfig.timeout_s`): how long its turn may hold the ranks."""
    copies: tuple[tuple[str, str], ...] = ()
    """`(target, of)`: targets the replica loads from the bytes of target `of` when they arrive, never sent.

    A tied alias (a tied `lm_head`) must be loaded under its own name, since a layerwise reload breaks the
    tie, but its bytes are its source's: sending them twice cost a tied model's every sync (and delta) a
    second copy of its embedding, the largest bf16 tensor on the wire."""
    lora_served: bool = False
    """The rollout applies LoRA adapters itself (`RolloutModelInfo.serves_lora`): a source training one sends its
    base without the adapter merged in, since the rollout serves that adapter on top of it (`Syncer.sync_adapter`);
    a merged base would apply it twice."""

    _text: _PlanText = field(default_factory=_PlanText, repr=False, compare=False)
    """The buckets and copies as JSON text, made on first use and shared by every `for_sync` copy (`to_plain`)."""

    def for_sync(self, integrity_key: bytes | None, sync_id: str | None = None, timeout_s: float | None = None) -> TransferPlan:
        """This plan for one sync: the same buckets, that sync's integrity key, id and deadline."""
        if (sync_id is None) != (timeout_s is None):
            raise ConfigError("a sync's plan names both its sync_id and its timeout_s, or neither")
        return replace(self, integrity_key=integrity_key, sync_id=sync_id, timeout_s=timeout_s)

    def to_plain(self) -> dict[str, Any]:
        """JSON-able data (vLLM's RPC and a server's HTTP carry no refit classes, and nothing is pickled): the plan
        as JSON text and the sync's key.

        Why text, kept: every sync hands the plan to every replica and every trainer rank, and a worker of each
        replica, and a plan names every tensor (tens of thousands in an MoE model), so encoding it anew, and
        decoding it again on each side, would cost each sync that much work per member. The text is made once per
        plan and shared by its `for_sync` copies; a receiver decodes each text it has not seen yet once
        (`from_plain`). Pickling (over Ray) sends the same text.
        """
        return {"plan": self._text.of(self), "integrity_key": None if self.integrity_key is None else self.integrity_key.hex(),
                "sync_id": self.sync_id, "timeout_s": self.timeout_s}

    @classmethod
    def from_plain(cls, plain: Mapping[str, Any]) -> TransferPlan:
        """The plan `to_plain` described; refuses data of any other shape, naming what is wrong."""
        try:
            text, key, sync_id, timeout_s = plain["plan"], plain["integrity_key"], plain["sync_id"], plain["timeout_s"]
            if not isinstance(text, str) or not (key is None or isinstance(key, str)):
                raise TypeError(f"a str plan and a str or null key, not {type(text).__name__} and {type(key).__name__}")
            if not (sync_id is None or isinstance(sync_id, str)) or not (
                    timeout_s is None or (type(timeout_s) in (int, float) and 0 < timeout_s < math.inf)):
                raise TypeError(f"a str or null sync_id and a positive or null timeout_s, not {sync_id!r} and {timeout_s!r}")
            return _decoded(text).for_sync(None if key is None else bytes.fromhex(key), sync_id, timeout_s)
        except (KeyError, TypeError, ValueError) as error:
            raise PlanMismatchError(f"not a transfer plan ({type(error).__name__}: {error}); the sender is not refit's") from None

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return _plan_from_plain, (self.to_plain(),)

    @property
    def tensors(self) -> list[PlannedTensor]:
        """What travels (copies do not)."""
        return [t for bucket in self.buckets for t in bucket]

    @property
    def targets(self) -> list[str]:
        """Every name the replica loads: what travels, then the copies."""
        return [t.target for t in self.tensors] + [target for target, _ in self.copies]

    @property
    def source_bytes(self) -> int:
        """The trainer's bytes of every tensor a replica loads, copies counted too: the model's size in a checkpoint
        (a tied `lm_head` as its own tensor)."""
        by_target = {t.target: t.source_bytes for t in self.tensors}
        return sum(by_target.values()) + sum(by_target[of] for _, of in self.copies)

    @property
    def wire_bytes(self) -> int:
        """Bytes each replica fetches per sync."""
        return sum(t.wire_bytes(self.quantize_on) for t in self.tensors)


_DECODED: OrderedDict[str, TransferPlan] = OrderedDict()  # text -> its plan (no key), the last few decoded here
_DECODED_KEPT = 4  # a process serves one Syncer's plan, or a few (a trainer shared by several fleets)
_DECODED_LOCK = threading.Lock()


def _decoded(text: str) -> TransferPlan:
    """The plan (without a key) that `text` encodes, decoded once per process while it stays among the last few;
    a hit is the same text, compared whole."""
    with _DECODED_LOCK:
        plan = _DECODED.get(text)
        if plan is not None:
            _DECODED.move_to_end(text)
            return plan
    plain = json.loads(text)
    buckets = tuple(tuple(_planned_tensor(row) for row in bucket) for bucket in plain["buckets"])
    copies = tuple((target, of) for target, of in plain["copies"] if isinstance(target, str) and isinstance(of, str))
    if len(copies) != len(plain["copies"]):
        raise TypeError(f"copies {plain['copies']!r} are not [target, of] names")
    plan = TransferPlan(buckets, QuantizeOn(plain["quantize_on"]), copies=copies,
                        lora_served=plain.get("lora_served") is True, _text=_PlanText(text))
    with _DECODED_LOCK:
        _DECODED[text] = plan
        while len(_DECODED) > _DECODED_KEPT:
            _DECODED.popitem(last=False)
    return plan


def _planned_tensor(row: Any) -> PlannedTensor:
    target, source, shape, dtype, block = row
    if not (isinstance(target, str) and isinstance(source, str) and isinstance(dtype, str) and _ints(shape)
            and (block is None or _ints(block) and len(block) == 2)):
        raise TypeError(f"{row!r} is not [target, source, [int, ...], dtype, [int, int] or null]")
    return PlannedTensor(target, source, tuple(shape), dtype, None if block is None else (block[0], block[1]))


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(type(n) is int for n in value)


def _plan_from_plain(plain: Mapping[str, Any]) -> TransferPlan:
    """Unpickling a plan (a module's function: pickled by name)."""
    return TransferPlan.from_plain(plain)


def layer_key(name: str) -> str:
    """The decoder layer a name belongs to (`model.layers.3`, the prefix up to its outermost index), else the name."""
    parts = name.split(".")
    index = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return name if index is None else ".".join(parts[: index + 1])


def make_plan(sources: Sequence[TensorMeta], rollout_model: RolloutModelInfo, config: SyncConfig) -> TransferPlan:
    """Plan a transfer of `sources` into a rollout running `rollout_model`.

    Every problem found is reported at once, before anything runs. Tensors named `draft.` + a name go to the
    rollout's draft model (planned against its own checkpoint), after the target's, unless `config.draft` is
    "frozen" or the rollout has no draft; so do a rollout's MTP layers (`RolloutModelInfo.mtp_prefixes`), which
    the trainer names as the target's checkpoint does, and which are then sent as `draft.` + that name.
    """
    sources = checked_metadata(sources)
    draft_info = rollout_model.draft
    mtp = draft_info.mtp_prefixes if draft_info is not None else ()

    def is_draft(name: str) -> bool:
        return name.startswith(DRAFT_PREFIX) or bool(mtp) and name.startswith(mtp)

    ordered, copies = _planned([m for m in sources if not is_draft(m.name)], rollout_model, config)
    drafts = [m for m in sources if is_draft(m.name)]
    if drafts and draft_info is not None and config.draft is Draft.SYNC:
        sent_as = {m.name.removeprefix(DRAFT_PREFIX): m.name for m in drafts}  # a draft's name -> the trainer's

        def trainer_name(name: str) -> str:
            # The target has the same names: refusals name a draft tensor as the trainer does (or should) send it.
            return sent_as.get(name) or (name if mtp and name.startswith(mtp) else DRAFT_PREFIX + name)

        planned, draft_copies = _planned([m.renamed(lambda name: name.removeprefix(DRAFT_PREFIX)) for m in drafts],
                                         draft_info, config, model="the draft", named=trainer_name)
        ordered += [replace(t, target=DRAFT_PREFIX + t.target, source=sent_as.get(t.source, DRAFT_PREFIX + t.source))
                    for t in planned]
        copies += [(DRAFT_PREFIX + target, DRAFT_PREFIX + of) for target, of in draft_copies]
    return TransferPlan(_pack(ordered, config.bucket_bytes, config.quantize_on), config.quantize_on, copies=tuple(copies),
                        lora_served=rollout_model.serves_lora)


def _planned(sources: Sequence[TensorMeta], rollout_model: RolloutModelInfo, config: SyncConfig,
             model: str = "the rollout", named: Callable[[str], str] = str,
             ) -> tuple[list[PlannedTensor], list[tuple[str, str]]]:
    """One model's planned tensors in layer order, and its copies (`TransferPlan.copies`); `model` names it in
    what is refused, `named` its tensors."""
    by_name = {m.name: m for m in sources}
    targets = [(m.name, m.alias_of or m.name) for m in sources]
    if rollout_model.tie_word_embeddings and TIED_HEAD not in by_name:
        targets.append((TIED_HEAD, _embedding_name(by_name)))

    quantizer = None
    if rollout_model.quantization_config is not None:
        scheme = Fp8BlockScheme.from_quantization_config(rollout_model.quantization_config)
        quantizer = Fp8BlockQuantizer(scheme, module_classes(sources))

    problems: list[str] = []
    planned: dict[str, PlannedTensor] = {}
    for target, source in targets:
        meta = by_name[source]
        # A tied alias carries exactly its source's values (the reload breaks
        # the tie, so both names must match), hence its source's form too.
        quantize = quantizer is not None and quantizer.is_quantized(source)
        if quantize and len(meta.shape) != 2:
            problems.append(f"{named(target)}: {model} expects it FP8_BLOCK-quantized, but its shape is {meta.shape}, "
                            "not 2-D")
        # By torch's own name, as the trainer's tensors are checked against the plan: an alias ("float", "half")
        # passed here and refused every sync as "the model changed".
        if quantize and meta.dtype not in _QUANTIZABLE:
            problems.append(f"{named(target)}: dtype {meta.dtype} cannot be FP8_BLOCK-quantized; expected one of "
                            f"{', '.join(_QUANTIZABLE)}")
        elif not quantize and (problem := wire_dtype_problem(named(target), meta.dtype)):
            problems.append(problem)
        block = quantizer.scheme.block if quantize else None
        planned[target] = PlannedTensor(target, source, meta.shape, meta.dtype, block)
    if problems:
        raise InvalidTensorError(f"cannot plan the transfer into {model}:\n  " + "\n  ".join(problems))
    if config.check_against_rollout and rollout_model.weights is not None:
        _check_against_rollout(list(planned.values()), rollout_model, model, named)
    ordered = [planned[name] for name in _layer_order(list(planned))]
    # Targets read from one source carry the same bytes: the first in layer order travels, the rest are copies.
    sent: dict[str, PlannedTensor] = {}
    copies = [(t.target, sent[t.source].target) for t in ordered if sent.setdefault(t.source, t) is not t]
    copied = {target for target, _ in copies}
    return [t for t in ordered if t.target not in copied], copies


def _check_against_rollout(planned: list[PlannedTensor], rollout_model: RolloutModelInfo, model: str,
                           named: Callable[[str], str]) -> None:
    """Every target is a weight of the rollout's model in the form and shape it expects, and every weight
    it expects is covered; all mismatches reported together, before any byte moves."""
    expected = {w.name: w for w in rollout_model.weights}
    problems: list[str] = []
    for t in planned:
        weight = expected.get(t.target)
        if weight is None:
            tied_head = t.target == TIED_HEAD and rollout_model.tie_word_embeddings
            if tied_head and t.source == TIED_HEAD:
                problems.append(f"{named(t.target)}: a tensor of the trainer's own (its model does not tie it), but {model}'s "
                                "model ties its output head to its input embeddings (tie_word_embeddings): it would serve "
                                "the embedding as its head, not the trainer's head")
            elif not tied_head and not may_stream(t.target):
                problems.append(f"{named(t.target)}: {model}'s model has no such weight (renamed, or extra in the trainer?)")
        elif weight.shape != t.shape:
            problems.append(f"{named(t.target)}: shape {t.shape} from the trainer, {weight.shape} in {model}'s model")
        elif weight.fp8_block != t.is_quantized:
            want, got = ("FP8_BLOCK", t.dtype) if weight.fp8_block else (t.dtype, "FP8_BLOCK")
            problems.append(f"{named(t.target)}: {model} expects it {want}, the plan would send {got}")
    covered = {t.target for t in planned}
    problems += [
        f"{named(name)}: {model}'s model has it, the trainer sends nothing (missing in the trainer?)"
        for name in expected if name not in covered
    ]
    if problems:
        raise PlanMismatchError(
            f"the trainer's weights do not match {model}'s model ({len(problems)} problem(s)); nothing was sent:\n  "
            + "\n  ".join(problems)
            + "\n(if vLLM maps these names itself, SyncConfig(check_against_rollout=False) skips this check)"
        )


def _layer_order(names: list[str]) -> list[str]:
    """Names grouped by decoder layer, as vLLM's layerwise reload completes them.

    A layer is keyed by the outermost integer segment of a name (so an
    expert index inside a layer does not split it); names before the first
    layer come first, all other un-indexed names (final norm, `lm_head`) last;
    stacks in first-appearance order of their prefix, layers ascending.
    """
    pre: list[str] = []
    post: list[str] = []
    stacks: dict[tuple[str, int], list[str]] = {}
    for name in names:
        key = layer_key(name)
        if key == name:
            (post if stacks else pre).append(name)
            continue
        prefix, _, index = key.rpartition(".")
        stacks.setdefault((prefix, int(index)), []).append(name)
    prefix_rank: dict[str, int] = {}
    for prefix, _ in stacks:
        prefix_rank.setdefault(prefix, len(prefix_rank))
    ordered = sorted(stacks, key=lambda key: (prefix_rank[key[0]], key[1]))
    return pre + [name for key in ordered for name in stacks[key]] + post


def _embedding_name(by_name: dict[str, TensorMeta]) -> str:
    candidates = [n for n in by_name if n.endswith("embed_tokens.weight")]
    if len(candidates) != 1:
        raise PlanMismatchError(
            "the rollout model ties lm_head to the input embeddings, but the trainer reports no "
            f"{TIED_HEAD} and {len(candidates)} embedding candidates {candidates}; report {TIED_HEAD} "
            "as a TensorMeta with alias_of=<embedding name>"
        )
    return candidates[0]


def _pack(
    tensors: list[PlannedTensor], bucket_bytes: int, quantize_on: QuantizeOn
) -> tuple[tuple[PlannedTensor, ...], ...]:
    """Greedy, order-preserving, each bucket within its bound (`bucket_bound`); a larger tensor travels alone."""
    buckets: list[list[PlannedTensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.wire_bytes(quantize_on)
        if not buckets or size + nbytes > bucket_bound(len(buckets) - 1, bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return tuple(tuple(b) for b in buckets)


_RAMP = (4, 2)  # the first buckets' bounds: bucket_bytes / 4, then / 2, then bucket_bytes


def bucket_bound(index: int, bucket_bytes: int) -> int:
    """The most wire bytes bucket `index` holds: a quarter of `bucket_bytes` for the first, half for the second,
    then all of it.

    Why smaller first buckets: a sync overlaps the trainer making bucket i+1 with the rollout loading bucket i,
    but nothing overlaps the making of the first bucket (the rollout waits), nor the second's beyond the first's
    load. Starting small shortens that wait, and doubling lets each bucket's making hide behind its predecessor's
    load; two more buckets cost two more calls (docs/performance.md measures both).
    """
    return bucket_bytes // _RAMP[index] if index < len(_RAMP) else bucket_bytes
