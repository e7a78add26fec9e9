"""The listing's own scan of installed distributions (stratagem.registry._installed) finds what importlib_metadata
finds: the same entry points in the same order, from the same distributions, names and versions."""

from __future__ import annotations

import importlib
import sys
import zipfile
from pathlib import Path

import importlib_metadata
import pytest

from stratagem.registry import _installed


def _ours(group: str) -> list[tuple[str, str, str, str]]:
    return [(e.name, e.value, e.dist.name, e.dist.version) for e in _installed.entry_points(group)]


def _library(group: str) -> list[tuple[str, str, str, str]]:
    return [
        (e.name, e.value, e.dist.name, e.dist.version) for e in importlib_metadata.entry_points(group=group)
    ]


def _info(
    site: Path, folder: str, metadata: str, entry_points: str = "", metadata_file: str = "METADATA"
) -> None:
    info = site / folder
    info.mkdir(parents=True)
    (info / metadata_file).write_text(metadata)
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


@pytest.mark.parametrize("group", ["stratagem", "console_scripts", "pytest11"])
def test_this_environment_matches_importlib_metadata(group: str) -> None:
    assert _library(group), f"nothing installed in {group}: the comparison would prove nothing"
    assert _ours(group) == _library(group)


def test_search_rules_match_importlib_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    # The same distribution on two path entries: the first entry's wins, and its entry points only.
    _info(
        first,
        "Acme.Plugin-2.0.dist-info",
        "Name: Acme.Plugin\nVersion: 2.0\n",
        "[sg_test]\nacme = acme_new\n",
    )
    _info(
        second,
        "acme_plugin-1.0.dist-info",
        "Name: acme-plugin\nVersion: 1.0\n",
        "[sg_test]\nold = acme_old\n",
    )
    # Two folders of one name in one entry (an interrupted upgrade): the lexically greater first.
    _info(first, "twice-1.9.dist-info", "Name: twice\nVersion: 1.9\n", "[sg_test]\ntwice = twice:v19\n")
    _info(first, "twice-1.10.dist-info", "Name: twice\nVersion: 1.10\n", "[sg_test]\ntwice = twice:v110\n")
    # Legacy egg-info with PKG-INFO; comments, other groups, extras, spaces, a folded header and a body that
    # looks like headers.
    _info(
        second,
        "legacy.egg-info",
        "Metadata-Version: 1.0\nName: legacy\nVersion: 0.3\nSummary: a long\n  summary\n\nName: not-this\n",
        "[console_scripts]\nx = y:z\n\n[sg_test]\n# a comment\n  spaced   =  legacy.mod : Obj.attr [extra1]  \n",
        metadata_file="PKG-INFO",
    )
    _info(second, "no_points-1.0.dist-info", "Name: no-points\nVersion: 1.0\n")
    for site in (second, first):
        monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()

    assert _ours("sg_test") == _library("sg_test")
    assert [e.name for e in _installed.entry_points("sg_test")] == ["twice", "acme", "spaced"]
    assert _ours("sg_test")[0][3] == "1.9"  # "twice-1.9" sorts after "twice-1.10"
    for name in ["acme-plugin", "ACME_plugin", "acme.plugin", "legacy", "no-points", "No_Points", "absent"]:
        try:
            importlib_metadata.distribution(name)
            expected = True
        except importlib_metadata.PackageNotFoundError:
            expected = False
        assert _installed.installed(name) is expected, name

    # Installing into a directory already scanned is seen (the directory's modification time changed).
    _info(first, "later-1.0.dist-info", "Name: later\nVersion: 1.0\n", "[sg_test]\nlater = later_mod\n")
    importlib.invalidate_caches()
    assert "later" in [e.name for e in _installed.entry_points("sg_test")]
    assert _ours("sg_test") == _library("sg_test")


def test_load_imports_the_module_and_attribute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    _info(
        site,
        "loadme-1.0.dist-info",
        "Name: loadme\nVersion: 1.0\n",
        "[sg_test]\nm = loadme_mod\na = loadme_mod:Outer.inner\n",
    )
    (site / "loadme_mod.py").write_text("class Outer:\n    inner = 42\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "loadme_mod", raising=False)
    module, attribute = (e.load() for e in _installed.entry_points("sg_test"))
    assert module is sys.modules["loadme_mod"] and attribute == 42


def test_a_zip_on_the_path_goes_to_importlib_metadata(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "zipped.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zipped-1.0.dist-info/METADATA", "Name: zipped\nVersion: 1.0\n")
        z.writestr("zipped-1.0.dist-info/entry_points.txt", "[sg_test]\nzipped = zipped_mod\n")
    monkeypatch.syspath_prepend(str(archive))
    importlib.invalidate_caches()
    assert ("zipped", "zipped_mod", "zipped", "1.0") in _ours("sg_test")
    assert _ours("sg_test") == _library("sg_test")
    assert _installed.installed("zipped")
