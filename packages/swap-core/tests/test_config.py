import pytest

from swap_core import SwapConfig


@pytest.mark.parametrize(
    ("field", "value", "error", "message"),
    [
        ("swap_times", 0, ValueError, "Invalid SwapConfig.swap_times: 0"),
        ("swap_times", -3, ValueError, "Invalid SwapConfig.swap_times: -3"),
        ("swap_times", True, TypeError, "swap_times must be an int, got True"),
        ("swap_times", 2.0, TypeError, "swap_times must be an int, got 2.0"),
        ("min_numel", -1, ValueError, "Invalid SwapConfig.min_numel: -1"),
        ("staging_buffers", 1, ValueError, "Invalid SwapConfig.staging_buffers: 1"),
        ("staging_buffers", 3.0, TypeError, "staging_buffers must be an int, got 3.0"),
        ("max_batch_bytes", 0, ValueError, "Invalid SwapConfig.max_batch_bytes: 0"),
        ("max_batch_bytes", -5, ValueError, "Invalid SwapConfig.max_batch_bytes: -5"),
        ("offload_fraction", 1.5, ValueError, "Invalid SwapConfig.offload_fraction: 1.5"),
        ("offload_fraction", -0.1, ValueError, "Invalid SwapConfig.offload_fraction: -0.1"),
        ("offload_fraction", "half", TypeError, "offload_fraction must be a float, got 'half'"),
        ("backend", "tpu", ValueError, "Invalid SwapConfig.backend: 'tpu'"),
        ("backend", 3, TypeError, "SwapConfig.backend must be one of"),
        ("packed", "yes", TypeError, "SwapConfig.packed must be a bool, got 'yes'"),
        ("duplex", 1, TypeError, "SwapConfig.duplex must be a bool, got 1"),
        ("keep_staging", None, TypeError, "SwapConfig.keep_staging must be a bool, got None"),
        ("undo_failed_steps", "yes", TypeError, "SwapConfig.undo_failed_steps must be a bool, got 'yes'"),
        ("master_remainders", 0, TypeError, "SwapConfig.master_remainders must be a bool, got 0"),
        ("state_keys", "exp_avg", TypeError, "state_keys must be a sequence of state key names"),
        ("state_keys", ["a", "a"], ValueError, "has duplicates"),
        ("state_keys", [1], TypeError, "state_keys entries must be str, got 1"),
    ],
)
def test_bad_values_name_the_value(field: str, value: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message.replace("(", r"\(").replace(".", r"\.")):
        SwapConfig(**{field: value})  # type: ignore[arg-type]


def test_defaults_and_normalization() -> None:
    config = SwapConfig(state_keys=["square_avg"], offload_fraction=1)
    assert config.swap_times == 16 and config.packed and config.duplex and config.backend == "auto"
    assert config.staging_buffers == 2
    assert config.state_keys == ("square_avg",)


def test_config_is_frozen_and_keyword_only() -> None:
    config = SwapConfig()
    with pytest.raises(AttributeError):
        config.swap_times = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        SwapConfig(4)  # type: ignore[misc]


def test_replace_validates_and_rejects_unknown_fields() -> None:
    assert SwapConfig().replace(swap_times=4).swap_times == 4
    with pytest.raises(TypeError, match="Unknown SwapConfig field"):
        SwapConfig().replace(swaptimes=4)
    with pytest.raises(ValueError, match="swap_times: 0"):
        SwapConfig().replace(swap_times=0)
