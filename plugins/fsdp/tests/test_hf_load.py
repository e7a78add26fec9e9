"""Hugging Face weights loaded under fsdp into what its sharding treats apart: a tied weight, a shard FSDP pads,
and a buffer the meta build made on the CPU (kept, not replaced by fresh memory). One 2-process launch."""

from __future__ import annotations

from typing import Any

import hf_workers as w
import pytest
import torch

import stratagem as sg

st = pytest.importorskip("safetensors.torch", reason="needs safetensors (requirements-test.txt)")
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    reference = w.Tied()
    folder = tmp_path_factory.mktemp("tied")
    # Both names of the tied weight stored, as a plain state dict holds them.
    st.save_file({k: v.clone() for k, v in reference.state_dict().items()}, str(folder / "model.safetensors"))
    with torch.no_grad():
        expected = reference(w.tokens())
        untrained = w.Tied()(w.tokens())
    result = sg.Engine(strategy="fsdp", accelerator="cpu", devices=2).launch(w.load, str(folder))
    return result, expected, untrained


def test_loaded_logits_equal_the_one_process_model(loaded: Any) -> None:
    result, expected, untrained = loaded
    assert (untrained - expected).abs().max() > 1e-2  # a model that was not loaded is far off
    assert (result["logits"] - expected).abs().max() <= 1e-6


def test_tied_weight_stays_tied_and_the_cpu_buffer_keeps_its_values(loaded: Any) -> None:
    result, _, _ = loaded
    assert result["built_on_cpu"]  # the case is real: the buffer was not on the meta device
    assert result["tied"]
    assert torch.equal(result["scale"], torch.arange(1.0, 9.0))
