"""CI's uv install (.ci/uv_pip_install.py) uses the sources pip would: pip's configuration, read through pip,
becomes uv's options, with pip's precedence (environment over the install section over the global one)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def helper():
    spec = importlib.util.spec_from_file_location("uv_pip_install", ROOT / ".ci" / "uv_pip_install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pip_configuration_becomes_uv_options(helper, tmp_path: Path, monkeypatch) -> None:
    conf = tmp_path / "pip.conf"
    conf.write_text(
        "[global]\nindex-url = https://index.example/simple\n"
        "extra-index-url = file:///one/simple file:///two/simple\nfind-links = /from/file\n"
        "constraint = /global/constraints.txt\ncert = /some/ca.pem\n"
        "[install]\nconstraint = /install/constraints.txt\n"
    )
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_CERT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    monkeypatch.setenv("PIP_FIND_LINKS", "/from/env")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "75")

    command, env = helper.uv_command(helper.pip_options(), ["-r", "reqs.txt"])

    assert command[:7] == [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable]
    pairs = list(zip(command[7:-2:2], command[8:-2:2]))
    assert ("--index-strategy", "unsafe-best-match") in pairs
    assert ("--index-url", "https://index.example/simple") in pairs
    extra = [value for flag, value in pairs if flag == "--extra-index-url"]
    assert extra == ["file:///one/simple", "file:///two/simple"]
    assert [value for flag, value in pairs if flag == "--find-links"] == ["/from/env"]
    assert [value for flag, value in pairs if flag == "--constraint"] == ["/install/constraints.txt"]
    assert command[-2:] == ["-r", "reqs.txt"]
    assert env["SSL_CERT_FILE"] == "/some/ca.pem"
    assert env["UV_HTTP_TIMEOUT"] == "75"
