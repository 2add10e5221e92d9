"""Bitwise comparisons of tensors and optimizer state dicts, with messages that say where they differ."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["assert_bitwise_equal", "assert_state_dicts_equal", "assert_trained_alike"]


def assert_bitwise_equal(expected: torch.Tensor, actual: torch.Tensor, context: str) -> None:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included), wherever the tensors live.

    A tensor subclass other than DTensor (torchao's quantized states) compares by its inner tensors and
    its flattening context (``__tensor_flatten__``).
    """
    expected, actual = _local(expected), _local(actual)
    if _is_wrapper_subclass(expected):
        assert type(actual) is type(expected), (
            f"{context}: a {type(actual).__name__}, expected {type(expected).__name__}"
        )
        names, expected_context = expected.__tensor_flatten__()  # type: ignore[attr-defined]
        actual_names, actual_context = actual.__tensor_flatten__()  # type: ignore[attr-defined]
        assert (names, expected_context) == (actual_names, actual_context), f"{context}: subclass layout differs"
        for name in names:
            assert_bitwise_equal(getattr(expected, name), getattr(actual, name), f"{context}.{name}")
        return
    expected = expected.detach().cpu()
    actual = actual.detach().cpu()
    assert expected.dtype == actual.dtype, f"{context}: dtype {actual.dtype} != expected {expected.dtype}"
    assert expected.shape == actual.shape, f"{context}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    expected_bytes = expected.contiguous().reshape(-1).view(torch.uint8)
    actual_bytes = actual.contiguous().reshape(-1).view(torch.uint8)
    if not torch.equal(expected_bytes, actual_bytes):
        differing = (expected != actual).sum().item() if expected.is_floating_point() else "some"
        largest = (expected.double() - actual.double()).abs().max().item() if expected.numel() else 0.0
        raise AssertionError(f"{context}: {differing} elements differ (largest difference {largest})")


def assert_state_dicts_equal(expected: Mapping[str, Any], actual: Mapping[str, Any], context: str) -> None:
    """Same structure, same non-tensor values, bitwise-equal tensors."""
    assert list(expected["param_groups"]) == list(actual["param_groups"]), f"{context}: param_groups differ"
    _assert_values_equal(expected["state"], actual["state"], f"{context}: state")


def assert_trained_alike(
    expected_model: torch.nn.Module,
    model: torch.nn.Module,
    expected_optimizer: torch.optim.Optimizer,
    optimizer: torch.optim.Optimizer,
    context: str,
) -> None:
    """Two loops left the same parameters (named, in order) and the same optimizer state dict, bitwise."""
    for (name, expected), actual in zip(expected_model.named_parameters(), model.parameters(), strict=True):
        assert_bitwise_equal(expected, actual, f"{context}: {name}")
    assert_state_dicts_equal(expected_optimizer.state_dict(), optimizer.state_dict(), f"{context}: optimizer")


def _assert_values_equal(expected: Any, actual: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert_bitwise_equal(expected, actual, where)
    elif isinstance(expected, Mapping):
        assert isinstance(actual, Mapping), f"{where}: expected a mapping, got {type(actual).__name__}"
        assert list(expected) == list(actual), f"{where}: keys {list(actual)} != expected {list(expected)}"
        for key in expected:
            _assert_values_equal(expected[key], actual[key], f"{where}[{key!r}]")
    else:
        assert expected == actual, f"{where}: {actual!r} != expected {expected!r}"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _is_wrapper_subclass(tensor: torch.Tensor) -> bool:
    return type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__")
