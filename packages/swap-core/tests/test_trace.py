"""SwapConfig(trace=True): per-batch pipeline intervals and their Chrome trace export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swap_core import SwapConfig, swap_optimizer
from swap_core.sim import SimBackend
from swap_core.trace import PHASES, StepTrace, TraceInterval


def test_trace_records_each_phase_of_each_batch_in_pipeline_order(tmp_path: Path) -> None:
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(6)]
    config = SwapConfig(backend=SimBackend(mode="sync"), swap_times=3, min_numel=16, trace=True)
    opt = swap_optimizer(torch.optim.RMSprop(params, lr=1e-3), config)
    for step in range(2):
        for param in params:
            param.grad = torch.full_like(param, 0.1 * (step + 1))
        opt.step()
    trace = opt.trace
    assert trace is not None
    spans = {(interval.batch, interval.phase): interval for interval in trace}
    assert sorted(spans) == [(batch, phase) for batch in range(3) for phase in sorted(PHASES)]
    for batch in range(3):
        h2d, update, d2h = (spans[batch, phase] for phase in PHASES)
        assert 0.0 <= h2d.start <= h2d.end <= update.start <= update.end <= d2h.start <= d2h.end
        assert h2d.nbytes == d2h.nbytes == 2 * 64 * 64 * 4 and update.nbytes == 0
        if batch:  # the next batch is prefetched before this one's update starts
            assert spans[batch, "h2d"].start <= spans[batch - 1, "update"].end
    assert sum(i.nbytes for i in trace if i.phase == "h2d") == opt.stats.h2d_bytes
    document = json.loads(trace.save(tmp_path / "step.json").read_text())
    complete = [event for event in document["traceEvents"] if event["ph"] == "X"]
    assert len(complete) == 9
    assert {event["name"] for event in complete} >= {"h2d b0", "update b1", "d2h b2"}
    assert all(event["dur"] >= 0 and event["ts"] >= 0 for event in complete)


@pytest.mark.parametrize("mode", ["lazy", "random"])
def test_trace_times_queued_copies_when_they_run(mode: str) -> None:
    """Lazy copy streams run a batch's prefetch only when its update waits for it: the trace shows that.

    An event completes when its stream has run up to it, so each interval is when the work ran, not when
    it was issued: batch ``b``'s prefetch ends after batch ``b - 1``'s update (it was forced by batch
    ``b``'s wait), which in sync mode would be the other way round.
    """
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(6)]
    backend = SimBackend(mode=mode, seed=3)  # type: ignore[arg-type]
    config = SwapConfig(backend=backend, swap_times=3, min_numel=16, trace=True)
    opt = swap_optimizer(torch.optim.RMSprop(params, lr=1e-3), config)
    for param in params:
        param.grad = torch.full_like(param, 0.1)
    opt.step()
    assert opt.trace is not None
    spans = {(interval.batch, interval.phase): interval for interval in opt.trace}
    for batch in range(3):
        h2d, update, d2h = (spans[batch, phase] for phase in PHASES)
        assert 0.0 <= h2d.start <= h2d.end <= update.start <= update.end <= d2h.start <= d2h.end
    if mode == "lazy":
        for batch in range(1, 3):
            assert spans[batch, "h2d"].end >= spans[batch - 1, "update"].end


def test_trace_is_off_by_default() -> None:
    params = [torch.nn.Parameter(torch.randn(64, 64))]
    opt = swap_optimizer(torch.optim.RMSprop(params), SwapConfig(backend="sim", min_numel=16))
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    assert opt.trace is None


def test_the_resident_update_is_labeled_resident_in_the_export() -> None:
    trace = StepTrace([TraceInterval(-1, "update", 0.0, 1e-4), TraceInterval(0, "h2d", 0.0, 2e-4, nbytes=64)])
    assert [interval.label for interval in trace] == ["resident", "b0"]
    names = [event["name"] for event in trace.to_chrome_trace()["traceEvents"] if event["ph"] == "X"]
    assert names == ["update resident", "h2d b0"]
