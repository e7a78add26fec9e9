"""DDPStrategy's options: converters, validators and cross-field rules, each failing with the field and value."""

from __future__ import annotations

import datetime

import pytest
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as power_sgd

from stratagem.errors import ConfigurationError
from stratagem_ddp import DDPConfig, DDPStrategy


def _post_local_state() -> post_local.PostLocalSGDState:
    return post_local.PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=4)


def test_defaults_are_plain_ddp() -> None:
    config = DDPStrategy().config
    assert config.ddp_arguments() == {
        "static_graph": False,
        "gradient_as_bucket_view": False,
        "find_unused_parameters": False,
    }
    assert config.ddp_comm_hook is None
    assert not config.post_local_sgd


def test_hook_names_resolve_to_torch_functions() -> None:
    config = DDPConfig(
        ddp_comm_hook="powerSGD.powerSGD_hook",
        ddp_comm_state=power_sgd.PowerSGDState(process_group=None),
        ddp_comm_wrapper="default.fp16_compress_wrapper",
    )
    assert config.ddp_comm_hook is power_sgd.powerSGD_hook
    assert config.ddp_comm_wrapper is default.fp16_compress_wrapper
    full = DDPConfig(
        ddp_comm_hook="torch.distributed.algorithms.ddp_comm_hooks.default_hooks:fp16_compress_hook"
    )
    assert full.ddp_comm_hook is default.fp16_compress_hook


def test_timeout_seconds_become_a_timedelta_and_reach_the_base() -> None:
    strategy = DDPStrategy(timeout=30, process_group_backend="gloo")
    assert strategy.config.timeout == datetime.timedelta(seconds=30)
    assert strategy.timeout == datetime.timedelta(seconds=30)
    assert strategy.process_group_backend == "gloo"


def test_ddp_arguments_pass_through() -> None:
    config = DDPStrategy(bucket_cap_mb=50, static_graph=True).config
    assert config.ddp_arguments()["bucket_cap_mb"] == 50
    assert config.ddp_arguments()["static_graph"] is True


def test_post_local_sgd_config() -> None:
    config = DDPStrategy(
        ddp_comm_hook=post_local.post_localSGD_hook,
        ddp_comm_state=_post_local_state(),
        model_averaging_period=4,
    ).config
    assert config.post_local_sgd


@pytest.mark.parametrize(
    ("options", "field", "shown"),
    [
        ({"model_averaging_period": 0}, "model_averaging_period", "0"),
        ({"model_averaging_period": -2}, "model_averaging_period", "-2"),
        ({"model_averaging_period": "4"}, "model_averaging_period", "'4'"),
        ({"model_averaging_period": True}, "model_averaging_period", "True"),
        ({"static_graph": "yes"}, "static_graph", "'yes'"),
        ({"gradient_as_bucket_view": 1}, "gradient_as_bucket_view", "1"),
        ({"find_unused_parameters": None}, "find_unused_parameters", "None"),
        ({"ddp_comm_hook": 42}, "ddp_comm_hook", "42"),
        ({"ddp_comm_hook": "fp16_compress_hook"}, "ddp_comm_hook", "'fp16_compress_hook'"),
        ({"ddp_comm_hook": "default.no_such_hook"}, "ddp_comm_hook", "'default.no_such_hook'"),
        ({"process_group_backend": "tcp"}, "process_group_backend", "'tcp'"),
        ({"timeout": -1}, "timeout", "datetime.timedelta"),
        ({"timeout": "soon"}, "timeout", "'soon'"),
    ],
)
def test_bad_values_name_field_and_value(options: dict, field: str, shown: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        DDPStrategy(**options)
    message = str(info.value)
    assert f"{field}=" in message
    assert shown in message


def test_wrapper_without_hook() -> None:
    with pytest.raises(
        ConfigurationError, match=r"ddp_comm_wrapper=.*fp16_compress_wrapper.*also pass ddp_comm_hook"
    ):
        DDPStrategy(ddp_comm_wrapper=default.fp16_compress_wrapper)


def test_state_without_hook() -> None:
    with pytest.raises(ConfigurationError, match=r"ddp_comm_state=.*also pass ddp_comm_hook"):
        DDPStrategy(ddp_comm_state=power_sgd.PowerSGDState(process_group=None))


def test_post_local_state_needs_a_period() -> None:
    with pytest.raises(
        ConfigurationError, match=r"model_averaging_period=None.*needs model_averaging_period"
    ):
        DDPStrategy(ddp_comm_hook=post_local.post_localSGD_hook, ddp_comm_state=_post_local_state())


def test_period_needs_post_local_sgd() -> None:
    with pytest.raises(ConfigurationError, match=r"model_averaging_period=4.*post_localSGD_hook"):
        DDPStrategy(model_averaging_period=4)
    with pytest.raises(ConfigurationError, match=r"model_averaging_period=4"):
        DDPStrategy(ddp_comm_hook=default.allreduce_hook, model_averaging_period=4)


def test_post_local_hook_needs_its_state() -> None:
    with pytest.raises(ConfigurationError, match=r"ddp_comm_state=None.*PostLocalSGDState"):
        DDPStrategy(ddp_comm_hook=post_local.post_localSGD_hook, model_averaging_period=2)


def test_unknown_keyword_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError) as info:
        DDPStrategy(bucket_cap=25)
    message = str(info.value)
    assert "bucket_cap=25" in message
    # Both the strategy's own options and DistributedDataParallel's arguments are listed.
    for name in ("static_graph", "model_averaging_period", "bucket_cap_mb", "broadcast_buffers"):
        assert name in message
    assert "'device_ids'" not in message


@pytest.mark.parametrize("name", ["device_ids", "output_device", "process_group", "module"])
def test_arguments_the_strategy_sets_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match=rf"{name}=.*not accepted"):
        DDPStrategy(**{name: None})


def test_own_option_inside_ddp_kwargs_is_redirected() -> None:
    with pytest.raises(ConfigurationError, match=r"static_graph=True.*pass static_graph=\.\.\. directly"):
        DDPConfig(ddp_kwargs={"static_graph": True})


def test_config_is_frozen() -> None:
    config = DDPConfig()
    with pytest.raises(AttributeError):
        config.static_graph = True  # type: ignore[misc]


def test_wrap_model_without_process_group_says_what_to_do() -> None:
    import torch

    from stratagem.strategies.compiling import Compiler

    with pytest.raises(ConfigurationError, match="needs a process group"):
        DDPStrategy().wrap_model(torch.nn.Linear(2, 2), Compiler(None))
