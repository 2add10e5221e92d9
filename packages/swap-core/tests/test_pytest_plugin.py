"""The pytest plugin's rules, run in a nested pytest: schedules collapse off the simulator, tests that build a
SimBackend themselves are skipped there, and ``--per-test-timeout`` fails a slow test or ends a hung process."""

from __future__ import annotations

import time

import pytest

pytest_plugins = ("pytester",)

PLUGIN_CONFTEST = 'pytest_plugins = ("swap_core.testing.pytest_plugin",)\n'

SCHEDULED_TESTS = """
import pytest
from swap_core.testing.conformance import SIM_MODES

@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("options", [{"packed": True}, {"packed": False}], ids=["packed", "per_tensor"])
@pytest.mark.parametrize("mode,seed", SIM_MODES, ids=[f"{m}{s}" for m, s in SIM_MODES])
def test_parity(size, options, mode, seed):
    pass

@pytest.mark.parametrize("mode", ["exact", "caching"])
def test_host_memory_modes(mode):
    pass

@pytest.mark.parametrize("seed", range(3))
def test_data_seeds(seed):
    pass
"""


@pytest.fixture
def nested(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytest project that loads the swap plugin."""
    pytester.makeconftest(PLUGIN_CONFTEST)
    return pytester


def test_a_real_backend_runs_each_test_under_one_simulator_schedule(nested: pytest.Pytester) -> None:
    nested.makepyfile(test_scheduled=SCHEDULED_TESTS)
    result = nested.runpytest("--backend", "cuda", "-v")
    # 2 sizes x 2 layouts, each under the first schedule only; parameters named mode/seed that are not a simulator
    # schedule (host-memory modes, a data seed without a simulator mode) all run.
    result.assert_outcomes(passed=4 + 2 + 3, deselected=4 * 21)
    assert sorted(line.split("::")[1].split(" ")[0] for line in result.outlines if "::test_parity[" in line) == [
        f"test_parity[lazy0-{layout}-{size}]" for layout in ("packed", "per_tensor") for size in (1, 2)
    ]
    result.stdout.fnmatch_lines(
        [
            "swap backend: cuda, simulator schedules: one",
            "swap: 84 repeats under other simulator schedules deselected (--sim-schedules one)",
        ]
    )


def test_the_simulator_runs_every_schedule_unless_told_otherwise(nested: pytest.Pytester) -> None:
    nested.makepyfile(test_scheduled=SCHEDULED_TESTS)
    nested.runpytest().assert_outcomes(passed=4 * 22 + 2 + 3)
    nested.runpytest("--sim-schedules", "one").assert_outcomes(passed=4 + 2 + 3, deselected=4 * 21)
    nested.runpytest("--backend", "cuda", "--sim-schedules", "all").assert_outcomes(passed=4 * 22 + 2 + 3)


def test_a_schedule_chosen_with_k_is_the_one_kept(nested: pytest.Pytester) -> None:
    nested.makepyfile(test_scheduled=SCHEDULED_TESTS)
    result = nested.runpytest("--backend", "cuda", "-k", "random3 or random4", "-v")
    result.assert_outcomes(passed=4, deselected=4 * 22 + 2 + 3 - 4)
    assert all("random3" in line for line in result.outlines if "PASSED" in line)


def test_a_test_that_builds_a_simulator_itself_is_sim_only(nested: pytest.Pytester) -> None:
    nested.makepyfile(
        test_hard_coded="""
        import pytest
        from swap_core.backends.cpu import CpuBackend
        from swap_core.sim import SimBackend

        def test_builds_a_simulator():
            SimBackend(mode="lazy")
            raise AssertionError("not reached with a real backend")

        @pytest.fixture
        def simulator():
            return SimBackend()

        def test_gets_a_simulator_from_a_fixture(simulator):
            raise AssertionError("not reached with a real backend")

        @pytest.mark.sim_only
        def test_marked():
            SimBackend()

        def test_cpu_backend_is_not_the_simulated_accelerator():
            CpuBackend()
        """
    )
    result = nested.runpytest("--backend", "cuda", "-rs")
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines(
        [
            "swap: 2 test(s) build a SimBackend themselves without the sim_only marker *",
            "  test_hard_coded.py::test_builds_a_simulator",
            "  test_hard_coded.py::test_gets_a_simulator_from_a_fixture",
            "*test_hard_coded.py:*: builds a SimBackend itself (hard-codes the simulator), so it is sim_only; "
            "running with --backend cuda",
        ]
    )
    # With the simulator they all run (in a process of their own: this very test may run with a real backend).
    nested.runpytest_subprocess("--backend", "sim").assert_outcomes(passed=2, failed=2)


def test_per_test_timeout_fails_a_slow_test_and_the_session_goes_on(nested: pytest.Pytester) -> None:
    nested.makepyfile(
        test_slow="""
        import time

        def test_slow():
            time.sleep(60)

        def test_after():
            pass
        """
    )
    started = time.perf_counter()
    result = nested.runpytest_subprocess("--per-test-timeout", "1")
    assert time.perf_counter() - started < 40, "the slow test was not stopped"
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*per-test timeout: 1 s*",
            "*Failed: call of test_slow.py::test_slow took more than --per-test-timeout 1 s",
        ]
    )


def test_per_test_timeout_ends_a_process_that_never_returns_to_the_interpreter(nested: pytest.Pytester) -> None:
    # Blocking SIGALRM stands in for a hung device call: the failing handler never runs.
    nested.makepyfile(
        test_hung="""
        import signal
        import time

        def test_hung():
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
            time.sleep(60)

        def test_never_reached():
            pass
        """
    )
    started = time.perf_counter()
    result = nested.runpytest_subprocess("--per-test-timeout", "1")
    assert time.perf_counter() - started < 40, "the hung process was not ended"
    assert result.ret == 1
    # faulthandler's dump on the terminal's stderr: every thread, the hung test's frame included.
    result.stderr.fnmatch_lines(["Timeout (0:00:02)!*", "*test_hung.py*in test_hung*"])


def test_per_test_timeout_is_documented_and_checked(nested: pytest.Pytester) -> None:
    result = nested.runpytest("--help")
    result.stdout.fnmatch_lines(["*--sim-schedules=*", "*--per-test-timeout=SECONDS*", "*faulthandler*"])
    for bad in ("0", "-1", "soon"):
        result = nested.runpytest("--per-test-timeout", bad)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        result.stderr.fnmatch_lines(["*--per-test-timeout*expected a*number of seconds*"])
