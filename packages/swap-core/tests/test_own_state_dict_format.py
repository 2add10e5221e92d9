"""An optimizer class with a state-dict format of its own is saved and loaded in that format (bitsandbytes' way)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from swap_core.backends.cpu import CpuBackend
from swap_core.testing.conformance import through_torch_save
from swap_core.testing.pairs import ConformanceCase, make_groups, make_pair, swap_config, wrap_case


class NestingRMSprop(torch.optim.RMSprop):
    """Nests ``square_avg`` under ``"nested"`` in its checkpoints (as bitsandbytes nests its quantization state)."""

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state_dict = super().state_dict()
        state_dict["state"] = {
            index: {"step": entry["step"], "nested": {"square_avg": entry["square_avg"]}}
            for index, entry in state_dict["state"].items()
        }
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state_dict = copy.copy(state_dict)
        state_dict["state"] = {
            index: {"step": entry["step"], **entry["nested"]} for index, entry in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)


CASE = ConformanceCase("nesting_rmsprop", lambda groups: NestingRMSprop(groups, lr=1e-2), skip_grad_every=0)


def test_state_dict_is_the_wrapped_class_format_and_loads_both_ways(swap_backend_factory: Any) -> None:
    backend = swap_backend_factory(mode="random", seed=2)
    pair = make_pair(CASE, backend)
    pair.step_both(3)
    saved = pair.swapped.state_dict()
    assert set(saved["state"][0]) == {"step", "nested"}, "the wrapped class's own format"
    pair.assert_equal("after 3 steps")  # equal to the plain optimizer's state_dict(), format included
    # its own checkpoint -> a fresh swapped optimizer, through its own load_state_dict
    fresh = wrap_case(CASE, CASE.make_optimizer(make_groups(CASE, pair.swapped_params)), swap_config(CASE, backend))
    fresh.load_state_dict(through_torch_save(saved))
    pair.swapped = fresh
    pair.step_both(2)
    pair.assert_equal("after loading the class's own format")
    assert fresh.stats.h2d_bytes > 0, "the loaded states were taken into host memory and swapped"


def _hook_calls(optimizer: Any) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    optimizer.register_load_state_dict_pre_hook(lambda opt, state_dict: calls.append(("pre", opt)))
    optimizer.register_load_state_dict_post_hook(lambda opt: calls.append(("post", opt)))
    return calls


def test_load_hooks_run_once_given_the_wrapper_on_every_path(swap_backend_factory: Any) -> None:
    """Swapped, with a class's own load_state_dict, and unswapped (CPU parameters): once each, given the wrapper."""
    plain_case = ConformanceCase("rmsprop", lambda groups: torch.optim.RMSprop(groups, lr=1e-2), skip_grad_every=0)
    for case, backend in (
        (plain_case, swap_backend_factory(mode="lazy")),
        (CASE, swap_backend_factory(mode="lazy")),
        (CASE, None),  # CPU parameters, no backend: the wrapped optimizer's own load runs
    ):
        if backend is None:
            pair = make_pair(case, CpuBackend())  # CPU parameters, whichever --backend the suite runs with
            optimizer = wrap_case(case, case.make_optimizer(make_groups(case, pair.swapped_params)), _cpu_config())
            assert optimizer.backend is None
        else:
            pair = make_pair(case, backend)
            optimizer = pair.swapped
        pair.step_both(2)
        calls = _hook_calls(optimizer)
        optimizer.load_state_dict(through_torch_save(pair.reference.state_dict()))
        assert calls == [("pre", optimizer), ("post", optimizer)], f"{case.name} (backend {backend}): {calls}"


def _cpu_config() -> Any:
    from swap_core import SwapConfig

    return SwapConfig(backend="auto")
