"""setup.py: one installed top-level package, `epl` (PyPI has unrelated `tools` and
`graph_passes`-like names), its CLIs in `epl.tools`, and no build scripts installed."""
from __future__ import annotations

import os
import runpy

import setuptools

from paths import ROOT  # noqa: E402


def _setup_arguments(monkeypatch) -> dict:
    """The keyword arguments setup.py passes to setuptools.setup (nothing is built)."""
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(ROOT)   # find_packages looks in the current directory
    runpy.run_path(os.path.join(ROOT, "setup.py"))
    return captured


def test_epl_is_the_only_installed_top_level_package(monkeypatch):
    arguments = _setup_arguments(monkeypatch)
    packages = arguments["packages"]
    assert {"epl", "epl.ir", "epl.passes", "epl.passes.replication", "epl.tools"} <= set(packages)
    assert {name.split(".")[0] for name in packages} == {"epl"}
    assert "package_dir" not in arguments
    scripts = dict(line.split("=", 1) for line in arguments["entry_points"]["console_scripts"])
    assert sorted(scripts) == ["epl-dump", "epl-env", "epl-launch", "epl-plan"]
    for target in scripts.values():
        module, function = target.split(":")
        assert module.startswith("epl.tools.") and function == "main"
        assert os.path.isfile(os.path.join(ROOT, *module.split(".")) + ".py"), target


def test_every_package_folder_is_a_package():
    """A folder of modules under epl/ without __init__.py would not be installed."""
    for directory, _, files in os.walk(os.path.join(ROOT, "epl")):
        if "__pycache__" in directory:
            continue
        if any(name.endswith(".py") for name in files):
            assert "__init__.py" in files, directory
