"""Token-id prompts are checked before they reach vLLM (refit/tokens.py)."""

import numpy as np
import pytest
import torch

from refit.errors import InvalidTensorError
from refit.tokens import token_prompts


def test_integer_tensors_and_arrays_are_token_ids():
    assert token_prompts(torch.tensor([[1, 2], [3, 4]])) == ((1, 2), (3, 4))
    assert token_prompts([np.array([5, 6], dtype=np.int64)], vocab_size=7) == ((5, 6),)


@pytest.mark.parametrize("prompts", [torch.tensor([[1.7, 2.2]]), [np.array([1.7, 2.2])], [[1.7, 2.2]], [[True, 2]]],
                         ids=["float-tensor", "float-array", "floats", "bool"])
def test_values_that_are_not_ints_are_refused_not_truncated(prompts):
    """Regression: every torch.Tensor has __index__, so a float tensor's ids were truncated (1.7 sent as 1)."""
    with pytest.raises(InvalidTensorError, match=r"^prompts\[0\] holds token ids .* outside non-negative ints"):
        token_prompts(prompts)


@pytest.mark.parametrize("prompts, message", [
    ([torch.tensor(5)], r"^prompts\[0\]=tensor\(5\): expected a sequence of token ids, not text or a scalar"),
    ([np.array(5)], r"^prompts\[0\]=array\(5\): expected a sequence of token ids"),
    (torch.tensor(5), r"^prompts=tensor\(5\): expected a list of token-id sequences"),
], ids=["0-d-tensor-prompt", "0-d-array-prompt", "0-d-tensor-prompts"])
def test_a_0d_tensor_is_refused_naming_it(prompts, message):
    """Regression: a 0-d tensor has __len__ and __iter__ that raise, so it escaped as a raw TypeError."""
    with pytest.raises(InvalidTensorError, match=message):
        token_prompts(prompts)


def test_a_prompt_that_leaves_the_engine_no_room_for_a_token_is_refused_naming_it():
    """vLLM refuses a prompt of max_model_len tokens or more (it must generate one); a calibration prompt was found
    too long only after every weight had loaded."""
    assert token_prompts([[1] * 127], max_model_len=128) == ((1,) * 127,)
    with pytest.raises(InvalidTensorError, match=r"^calibration_prompts\[1\] holds 128 token ids; the engine's max_model_len 128"):
        token_prompts([[1], [1] * 128], setting="calibration_prompts", max_model_len=128)
