"""A reference FP8 KV-cache attention for x86 CPUs without AVX-512 or AMX, as a vLLM plugin.

Why it exists: vLLM 0.32's CPU attention (`CPU_ATTN`) stores an FP8 KV cache
only in its AVX-512 and AMX builds. On an AVX2-only x86 CPU (vLLM loads
`_C_AVX2` there) every engine with `kv_cache_dtype="fp8*"` fails at start-up
("FP8 KV cache on CPU requires x86 with AVX-512 or AMX"), and with the check
bypassed the AVX2 kernel refuses the configuration ("Unsupported CPU attention
configuration ... kv_cache_idx=1"). The FP8 KV cache is what refit's
post-refit stage and provenance exist for, so without it neither could run
on such a machine.

On those CPUs only, and only for FP8 caches, this replaces two steps of
`CPU_ATTN` with plain torch:
- `do_kv_cache_update`: each new token's key and value are divided by the
  layer's `k_scale`/`v_scale`, saturated to the FP8 format's range, and
  stored as FP8 codes (uint8 bytes, the layout vLLM allocated) at their slot;
- `forward`: each request's cached codes are gathered through its block
  table, dequantized with the same scales, and attended (causal, grouped
  query heads, sliding window and soft cap as configured) in float32.

The scales are read from the layer at every call, as vLLM's kernel reads
them, so a stale or placeholder scale corrupts generations here exactly as it
does on other hardware: the seed bug reproduces, and the post-refit stage is
tested against it. Slow (requests are batched only with others of as many
queries: decode steps together, prompts of one length together), which does
not matter for the small models it serves in tests. Everywhere else
(AVX-512, AMX, other architectures, non-FP8 caches) vLLM's kernels run as
they are.
"""

from __future__ import annotations

import functools
import math

import torch
import vllm.platforms

from refit.engine.compat import incompatible_vllm

__all__ = ["attend_fp8", "needs_reference", "register", "store_fp8"]

_FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def _incompatible_vllm(problem: str):
    return incompatible_vllm("CPU FP8 KV-cache attention", problem)


def needs_reference() -> bool:
    """Whether vLLM's CPU attention lacks an FP8 KV cache here: an x86 CPU with neither AVX-512 nor AMX."""
    from vllm.platforms import CpuArchEnum

    if vllm.platforms.current_platform.get_cpu_architecture() is not CpuArchEnum.X86:
        return False
    return not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def fp8_format(kv_cache_dtype: str) -> torch.dtype:
    try:
        return _FP8_FORMATS[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: expected one of {sorted(_FP8_FORMATS)}") from None


def _check_scale(which: str, scale: float) -> None:
    # vLLM's FP8 kernels refuse such a scale with this message; a dummy-loaded scale must fail the same way here.
    if not scale > 0 or not math.isfinite(scale):
        raise RuntimeError(f"{which} must be positive for FP8 path (got {scale})")


def store_fp8(x: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale: float, fmt: torch.dtype,
              which: str = "k_scale") -> None:
    """Write `x` [tokens, kv_heads, head_size] into `cache` [blocks, kv_heads, block_size, head_size] as FP8 codes.

    Tokens whose slot is negative (padding) are skipped. Saturated, not
    overflowed: torch's cast turns out-of-range values into NaN.
    """
    _check_scale(which, scale)
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    slots, x = slots[keep], x[: slot_mapping.numel()][keep]
    block_size = cache.shape[2]
    limit = torch.finfo(fmt).max
    codes = (x.float() / scale).clamp(-limit, limit).to(fmt).view(torch.uint8)
    cache.view(torch.uint8)[slots // block_size, :, slots % block_size] = codes


def _gather(cache: torch.Tensor, blocks: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """The cached tokens of `blocks` [requests, n] dequantized: [requests, n * block_size, kv_heads, head_size] float32."""
    codes = cache.view(torch.uint8)[blocks]  # [requests, n, kv_heads, block_size, head_size]
    requests, n, kv_heads, block_size, head_size = codes.shape
    codes = codes.permute(0, 1, 3, 2, 4).reshape(requests, n * block_size, kv_heads, head_size)
    return codes.view(fmt).float() * scale


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float,
            softcap: float) -> torch.Tensor:
    """query [R, Q, heads, D], keys/values [R, L, kv_heads, D], allowed [R, Q, L] -> [R, Q, heads, D] float32."""
    requests, queries, heads, head_size = query.shape
    kv_heads = keys.shape[2]
    grouped = query.float().view(requests, queries, kv_heads, heads // kv_heads, head_size)
    scores = torch.einsum("rqkgd,rlkd->rkgql", grouped, keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    probs = scores.masked_fill(~allowed[:, None, None], float("-inf")).softmax(dim=-1)
    return torch.einsum("rkgql,rlkd->rqkgd", probs, values).reshape(requests, queries, heads, head_size)


def _allowed(query_pos: torch.Tensor, key_pos: torch.Tensor, lengths: torch.Tensor, causal: bool,
             sliding_window: int) -> torch.Tensor:
    """Which keys each query sees: [R, Q, 1] query positions, [1, 1, L] key positions, [R, 1, 1] sequence lengths."""
    allowed = key_pos < lengths
    if causal:
        allowed = allowed & (key_pos <= query_pos)
    if sliding_window > 0:
        allowed = allowed & (key_pos > query_pos - sliding_window)
    return allowed


def attend_fp8(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    fmt: torch.dtype,
    causal: bool = True,
    sliding_window: int = -1,
    softcap: float = 0.0,
) -> None:
    """Attention of each request's queries over its FP8-cached keys and values, written into `output`.

    `query` [tokens, heads, head_size]; a request's queries are the last
    tokens of its sequence (`seq_lens` counts the cached context and them).
    Requests with as many queries are attended together: decode steps (one
    query each), and prompts of one length (an RL batch samples each prompt
    several times), padded only to the longest cached context among them.
    Query runs are never padded, so a long prompt is not multiplied by a
    batch of short ones.
    """
    _check_scale("k_scale", k_scale)
    _check_scale("v_scale", v_scale)
    block_size = key_cache.shape[2]
    starts = query_start_loc.to(torch.long)
    lengths = seq_lens.to(torch.long)
    query_lens = starts[1:] - starts[:-1]

    def attend(requests: torch.Tensor, queries: int) -> None:
        longest = int(lengths[requests].max())
        blocks = block_table[requests, : math.ceil(longest / block_size)].to(torch.long)
        keys = _gather(key_cache, blocks, k_scale, fmt)
        values = _gather(value_cache, blocks, v_scale, fmt)
        tokens = starts[requests, None] + torch.arange(queries)  # [R, Q] rows of `query`
        query_pos = (lengths[requests, None] - queries + torch.arange(queries))[..., None]
        allowed = _allowed(query_pos, torch.arange(keys.shape[1])[None, None], lengths[requests, None, None], causal,
                           sliding_window)
        attended = _attend(query[tokens], keys, values, allowed, scale, softcap)
        output.view(output.shape[0], *query.shape[1:])[tokens] = attended.to(output.dtype)

    for queries in torch.unique(query_lens).tolist():
        if queries > 0:
            attend(torch.nonzero(query_lens == queries).flatten(), queries)


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of a `CPU_ATTN` cache [blocks, kv_heads, block_size, 2 * head_size], as vLLM splits it."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, kv_heads, block_size * 2, -1).chunk(2, dim=2)


def _refuse_unsupported(impl) -> None:
    from vllm.v1.attention.backend import AttentionType

    unsupported = {
        "attention sinks": impl.sinks is not None,
        "ALiBi": impl.alibi_slopes is not None,
        f"attention type {impl.attn_type!r}": impl.attn_type != AttentionType.DECODER,
    }
    named = [what for what, present in unsupported.items() if present]
    if named:
        raise NotImplementedError(
            f"refit's reference FP8 KV-cache attention (this CPU has neither AVX-512 nor AMX) does not "
            f"support {', '.join(named)}; use kv_cache_dtype='auto' on this machine"
        )


def _reference_update(original):
    @functools.wraps(original)
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if not self.is_fp8_kv_cache:
            return original(self, layer, key, value, kv_cache, slot_mapping)
        _refuse_unsupported(self)
        fmt = fp8_format(self.kv_cache_dtype)
        key_cache, value_cache = _split(kv_cache)
        store_fp8(key, key_cache, slot_mapping, layer._k_scale_float, fmt, "k_scale")
        store_fp8(value, value_cache, slot_mapping, layer._v_scale_float, fmt, "v_scale")

    do_kv_cache_update._refit = True
    return do_kv_cache_update


def _reference_forward(original):
    @functools.wraps(original)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if not self.is_fp8_kv_cache or attn_metadata is None:  # None: a warm-up pass
            return original(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                            output_block_scale)
        _refuse_unsupported(self)
        if output_scale is not None or output_block_scale is not None or attn_metadata.dynamic_causal is not None:
            raise NotImplementedError("refit's reference FP8 KV-cache attention: fused output quantization and "
                                      "dynamic causal masks are not supported")
        tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = _split(kv_cache)
        attend_fp8(
            query[:tokens], key_cache, value_cache, output[:tokens],
            query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens,
            block_table=attn_metadata.block_table, scale=self.scale, k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float, fmt=fp8_format(self.kv_cache_dtype), causal=attn_metadata.causal,
            sliding_window=self.sliding_window, softcap=float(self.logits_soft_cap or 0.0),
        )
        return output

    forward._refit = True
    return forward


def _isa_without_fp8(get_attn_isa):
    """vLLM's ISA choice as for a bf16 cache: what the metadata builder's non-attention steps run on."""

    @functools.wraps(get_attn_isa)
    def wrapped(dtype, block_size, head_size=None, kv_cache_dtype=None):
        return get_attn_isa(dtype, block_size, head_size, None)

    return wrapped


def _builder_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        # Read only to size the native kernel's scheduler metadata, which the reference never uses;
        # the AVX2 build refuses to make it for an FP8 cache.
        self.kv_cache_dtype = "auto"

    return __init__


def register() -> None:
    """On x86 CPUs without AVX-512 or AMX, route `CPU_ATTN`'s FP8 KV-cache steps to the reference above.

    A no-op elsewhere and when already registered (vLLM runs general plugins
    more than once per process). Raises `EngineError` naming the expected
    vLLM version if the backend's methods it wraps are missing.
    """
    if not vllm.platforms.current_platform.is_cpu() or not needs_reference():
        return
    try:
        from vllm.v1.attention.backends import cpu_attn
    except ImportError as exc:
        raise _incompatible_vllm(f"an import fails ({exc})") from exc
    impl, builder = cpu_attn.CPUAttentionBackendImpl, cpu_attn.CPUAttentionMetadataBuilder
    for owner, name in ((impl, "forward"), (impl, "do_kv_cache_update"), (builder, "__init__"), (cpu_attn, "_get_attn_isa")):
        if not callable(getattr(owner, name, None)):
            raise _incompatible_vllm(f"vllm.v1.attention.backends.cpu_attn: {getattr(owner, '__name__', owner)}.{name} is missing")
    if getattr(impl.forward, "_refit", False):
        return
    impl.forward = _reference_forward(impl.forward)
    impl.do_kv_cache_update = _reference_update(impl.do_kv_cache_update)
    builder.__init__ = _builder_init(builder.__init__)
    cpu_attn._get_attn_isa = _isa_without_fp8(cpu_attn._get_attn_isa)
