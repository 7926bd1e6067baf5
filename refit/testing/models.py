"""Tiny Qwen3 models trained on the counting task, committed as test fixtures.

The checkpoints are made by ``make fixtures`` (``fixtures/make_models.py``,
then ``fixtures/quantize_with_llmcompressor.py``) and committed, so tests need
neither a model hub nor minutes of training. This module only knows their
shape and where they live; it imports ``transformers`` lazily so that
``import refit.testing`` stays light (the llmcompressor venv imports it too).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from refit.testing.counting_task import VOCAB_SIZE

if TYPE_CHECKING:
    import transformers

FIXTURES_DIR = Path(__file__).resolve().parents[2] / "fixtures" / "models"
"""``<repo>/fixtures/models``, found from this file so it works from any cwd."""

VARIANTS = ("bf16", "fp8_block", "fp8_block_kv")
"""Checkpoint variants per model.

``bf16``: the trained weights. ``fp8_block``: llmcompressor FP8_BLOCK (128x128
weight blocks, dynamic activations), lm_head left in bf16. ``fp8_block_kv``:
the same plus calibrated static FP8 KV-cache scales (``k_scale``/``v_scale``).
"""


def tiny_qwen3_config(tied: bool) -> transformers.Qwen3Config:
    """Return the fixtures' Qwen3 config, with or without tied embeddings.

    Every projection dimension (q: 4x64, k/v: 2x64, gate/up: 512, hidden: 256)
    is a multiple of 128 on purpose: vLLM's fused qkv/gate_up loaders need each
    shard to cover whole 128x128 FP8 blocks. Both tied and untied models are
    kept because a tied model's checkpoint has no ``lm_head.weight``, a case a
    refit must handle explicitly.
    """
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        dtype="bfloat16",
        architectures=["Qwen3ForCausalLM"],
    )


def model_dir(tied: bool, variant: str, *, must_exist: bool = True) -> Path:
    """Return the directory of one fixture checkpoint, e.g. ``qwen3-tiny-tied/bf16``.

    Raises ``ValueError`` for an unknown variant and, unless ``must_exist`` is
    False (for the scripts that write the fixtures), ``FileNotFoundError`` when
    the checkpoint has not been generated.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown fixture variant {variant!r}; expected one of {VARIANTS}")
    path = FIXTURES_DIR / f"qwen3-tiny-{'tied' if tied else 'untied'}" / variant
    if must_exist and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"fixture checkpoint {path} is missing; regenerate the fixtures with `make fixtures`"
        )
    return path


@torch.no_grad()
def greedy_continuations(
    model: transformers.PreTrainedModel, prompts: Sequence[Sequence[int]], n_tokens: int
) -> list[list[int]]:
    """Greedily generate ``n_tokens`` for each prompt with a transformers model.

    The reference against which vLLM's outputs are compared. Prompts must all
    have the same length (as ``counting_task.make_prompts`` gives), so no
    padding or attention mask is needed. ``min_new_tokens`` keeps generation
    from stopping early should the config ever name an EOS token.
    """
    input_ids = torch.tensor(prompts, dtype=torch.long, device=model.device)
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=n_tokens,
        min_new_tokens=n_tokens,
        do_sample=False,
    )
    return out[:, input_ids.shape[1] :].tolist()
