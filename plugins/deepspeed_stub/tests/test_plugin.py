"""Registration, listing without deepspeed, refusal before launch when it is missing, and the options."""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from stratagem import get_registry
from stratagem.errors import ConfigurationError
from stratagem_deepspeed._config import DeepSpeedConfig

NAMES = [
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
]


def test_every_name_is_registered_with_its_preset() -> None:
    registry = get_registry()
    presets = {name: dict(registry.get(name).preset_options) for name in NAMES}
    assert presets["deepspeed_stage_3_offload"] == {
        "stage": 3,
        "offload_optimizer": True,
        "offload_parameters": True,
    }
    assert presets["deepspeed_stage_2_offload"] == {"stage": 2, "offload_optimizer": True}
    assert presets["deepspeed"] == {}
    for name in NAMES:
        caps = registry.get(name).capabilities
        assert caps.requires == ("deepspeed>=0.14",)
        assert caps.checkpoint_formats == {"full", "sharded"}


def test_listing_imports_neither_torch_nor_deepspeed() -> None:
    code = (
        "import sys, json; from stratagem import get_registry; r = get_registry(); "
        "print(json.dumps([sorted(r.names()), 'torch' in sys.modules, 'deepspeed' in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    names, torch_loaded, deepspeed_loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(NAMES) <= set(names)
    assert not torch_loaded and not deepspeed_loaded


def _site_without_deepspeed(tmp_path: Path) -> Path:
    """A copy of this environment's site-packages (links) without the deepspeed distribution."""
    farm = tmp_path / "site"
    farm.mkdir()
    source = Path(
        next(
            p
            for p in site.getsitepackages()
            if Path(p, "stratagem_deepspeed").exists() or any(Path(p).glob("*stratagem_deepspeed*"))
        )
    )
    for entry in source.iterdir():
        if entry.name.lower().startswith("deepspeed"):
            continue
        (farm / entry.name).symlink_to(entry)
    return farm


def test_missing_deepspeed_lists_and_refuses_before_launch(tmp_path: Path) -> None:
    farm = _site_without_deepspeed(tmp_path)
    code = f"""
import json, site, sys
site.addsitedir({str(farm)!r})
from stratagem import get_registry
import stratagem as sg
info = get_registry().get("deepspeed_stage_2").to_json()
try:
    sg.Engine(strategy="deepspeed_stage_2", accelerator="cpu", devices=2)
except sg.MissingDependencyError as error:
    print(json.dumps({{"missing": info["missing"], "error": str(error), "deepspeed": "deepspeed" in sys.modules}}))
"""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["missing"] == ["deepspeed>=0.14"]
    assert "pip install" in result["error"] and "deepspeed" in result["error"]
    assert not result["deepspeed"]


# -------------------------------------------------------------------------------------------------
# options
# -------------------------------------------------------------------------------------------------


def test_named_options_become_the_zero_section() -> None:
    config = DeepSpeedConfig(stage=3, offload_optimizer=True, offload_parameters=True, reduce_bucket_size=5e7)
    ds = config.deepspeed_config("32-true", "cpu", model_numel=1000)
    zero = ds["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": False}
    assert zero["reduce_bucket_size"] == 1000  # capped at the model's size
    assert ds["gradient_accumulation_steps"] == 1 and "bf16" not in ds
    assert config.deepspeed_config("bf16-mixed")["bf16"] == {"enabled": True}
    # Capped at an odd model size: rounded up to the multiple of 2 elements that stages 1-2 require.
    odd = DeepSpeedConfig(stage=2).deepspeed_config("32-true", "cpu", model_numel=1001)["zero_optimization"]
    assert odd["reduce_bucket_size"] == odd["allgather_bucket_size"] == 1002


def test_a_user_config_is_taken_as_is(tmp_path: Path) -> None:
    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}))
    config = DeepSpeedConfig(config=str(file), stage=3)
    ds = config.deepspeed_config("32-true", model_numel=10)
    assert ds["zero_optimization"] == {"stage": 1} and ds["gradient_clipping"] == 1.0
    assert config.zero_stage == 1


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"stage": 4}, "stage=4"),
        ({"stage": 2, "offload_parameters": True}, "only ZeRO stage 3"),
        ({"reduce_bucket_size": -1}, "positive number"),
        ({"config": "/no/such/file.json"}, "no such file"),
        ({"config": {"gradient_accumulation_steps": 4}}, "accumulate_grad_batches"),
        ({"logging_level": "LOUD"}, "logging level"),
    ],
)
def test_bad_options_say_what_to_do(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigurationError, match=fragment):
        DeepSpeedConfig(**kwargs)


def test_a_config_that_enables_another_precision_is_refused() -> None:
    config = DeepSpeedConfig(config={"bf16": {"enabled": True}})
    with pytest.raises(ConfigurationError, match="precision"):
        config.deepspeed_config("32-true")


def test_environment_variable_names_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from stratagem_deepspeed import CONFIG_ENV
    from stratagem_deepspeed.strategy import DeepSpeedStrategy

    file = tmp_path / "ds.json"
    file.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    monkeypatch.setenv(CONFIG_ENV, str(file))
    assert DeepSpeedStrategy().zero_stage == 3
    assert DeepSpeedStrategy(config={"zero_optimization": {"stage": 1}}).zero_stage == 1


class _Payload:
    """Pickles as a call that writes a marker file: what a crafted checkpoint would run if unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "code ran"))


@pytest.mark.deepspeed
def test_a_crafted_deepspeed_directory_runs_no_code(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed is not installed")
    import torch

    from stratagem.errors import CheckpointError
    from stratagem_deepspeed._checkpoint import consolidate, weights_only_loads

    marker = tmp_path / "marker"
    source = tmp_path / "ckpt"
    tag = source / "model"
    tag.mkdir(parents=True)
    evil = {"module": {"w": torch.zeros(2)}, "x": _Payload(marker)}
    torch.save(evil, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": _Payload(marker)}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (source / "stratagem.json").write_text(
        json.dumps(
            {
                "format_version": 1,
                "format": "sharded",
                "layout": "deepspeed",
                "world_size": 1,
                "engines": {"model": {"tag": "model", "optimizer": "optimizer"}},
            }
        )
    )
    with pytest.raises(CheckpointError, match="could not consolidate module 'model'"):
        consolidate(source, tmp_path / "out.ckpt")
    with weights_only_loads(), pytest.raises(Exception, match=r"weights_only|Unsupported global"):
        torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    assert not marker.exists()
    assert torch.load.__module__ == "torch.serialization"  # restored after the block
