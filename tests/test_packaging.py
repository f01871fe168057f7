"""setup.py: no top-level package named `tools` (PyPI has an unrelated one); the
tools/ directory is installed as `epl_tools`, and the console scripts point there."""
from __future__ import annotations

import os
import runpy

import setuptools

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_arguments(monkeypatch) -> dict:
    """The keyword arguments setup.py passes to setuptools.setup (nothing is built)."""
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    monkeypatch.chdir(ROOT)   # find_packages looks in the current directory
    runpy.run_path(os.path.join(ROOT, "setup.py"))
    return captured


def test_tools_directory_is_installed_as_epl_tools(monkeypatch):
    arguments = _setup_arguments(monkeypatch)
    packages = arguments["packages"]
    assert {"epl", "epl.ir", "graph_passes", "epl_tools"} <= set(packages)
    assert not [name for name in packages if name == "tools" or name.startswith("tools.")]
    assert arguments["package_dir"] == {"epl_tools": "tools"}
    scripts = dict(line.split("=", 1) for line in arguments["entry_points"]["console_scripts"])
    assert sorted(scripts) == ["epl-dump", "epl-launch", "epl-plan"]
    for target in scripts.values():
        module, function = target.split(":")
        package, name = module.split(".")
        assert package == "epl_tools" and function == "main"
        assert os.path.isfile(os.path.join(ROOT, "tools", f"{name}.py")), target
