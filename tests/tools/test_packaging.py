"""pyproject.toml: the distribution `epl-tf` installs one top-level package, `epl` (PyPI
has unrelated `epl`, `tools` and `graph_passes`-like names), its CLIs in `epl.tools`,
TensorFlow through the [cpu] / [gpu] extras, and reads its version from epl/__init__.py."""
from __future__ import annotations

import ast
import email
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

from setuptools import find_namespace_packages, find_packages

import epl
from paths import ROOT  # noqa: E402


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirement_names(requirements: list[str]) -> list[str]:
    """The requirement strings without spaces ('numpy >= 1' -> 'numpy>=1')."""
    return [requirement.replace(" ", "") for requirement in requirements]


def test_distribution_name_is_not_the_taken_ones():
    project = _pyproject()["project"]
    # `epl` (PyPI: an unrelated project) and `pyepl` (the original EPL) are taken.
    assert project["name"] == "epl-tf"
    assert project["requires-python"] == ">=3.11"


def test_one_version_source():
    """The version is dynamic, read from epl.__version__; no other file states it."""
    pyproject = _pyproject()
    assert "version" not in pyproject["project"]
    assert pyproject["project"]["dynamic"] == ["version"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "epl.__version__"}
    assert not os.path.exists(os.path.join(ROOT, "setup.py"))
    # setuptools reads the attribute statically (no import): it must be a literal.
    with open(os.path.join(ROOT, "epl", "__init__.py")) as f:
        tree = ast.parse(f.read())
    literals = [node.value.value for node in tree.body
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                and any(getattr(target, "id", None) == "__version__" for target in node.targets)]
    assert literals == [epl.__version__]
    assert epl.VERSION == epl.__version__


def test_dependencies_and_tensorflow_extras():
    project = _pyproject()["project"]
    dependencies = _requirement_names(project["dependencies"])
    # TensorFlow only through an extra: tensorflow-cpu and tensorflow both provide the module.
    assert not any(requirement.startswith(("tensorflow", "tf-keras")) for requirement in dependencies)
    assert {requirement.split("=")[0].split("<")[0].split(">")[0] for requirement in dependencies} \
        >= {"numpy", "protobuf", "tensorboard"}
    extras = {name: _requirement_names(values)
              for name, values in project["optional-dependencies"].items()}
    assert extras["cpu"] == ["tensorflow-cpu==2.21.0"]
    assert extras["gpu"] == ["tensorflow[and-cuda]==2.21.0"]
    # The extras pin what the Makefile installs (requirements-cpu.txt / -gpu.txt).
    for kind in ("cpu", "gpu"):
        with open(os.path.join(ROOT, f"requirements-{kind}.txt")) as f:
            pinned = [line.strip() for line in f if line.strip() and not line.startswith("#")]
        assert extras[kind] == pinned, kind


def test_license_metadata():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_console_scripts():
    scripts = _pyproject()["project"]["scripts"]
    assert sorted(scripts) == ["epl-dump", "epl-env", "epl-launch", "epl-plan"]
    for target in scripts.values():
        module, function = target.split(":")
        assert module.startswith("epl.tools.") and function == "main"
        assert os.path.isfile(os.path.join(ROOT, *module.split(".")) + ".py"), target


def test_epl_is_the_only_installed_top_level_package():
    """The package list setuptools builds from pyproject's `find` settings."""
    find = _pyproject()["tool"]["setuptools"]["packages"]["find"]
    assert set(find) == {"include"}   # not a namespace search, no other `where`
    packages = find_packages(where=ROOT, include=find["include"])
    assert {"epl", "epl.ir", "epl.passes", "epl.passes.replication", "epl.tools"} <= set(packages)
    assert {name.split(".")[0] for name in packages} == {"epl"}
    # Every package folder under epl/ is found (a namespace search finds no more).
    namespace = find_namespace_packages(where=ROOT, include=find["include"])
    assert set(packages) == {name for name in namespace if "__pycache__" not in name}


def test_every_package_folder_is_a_package():
    """A folder of modules under epl/ without __init__.py would not be installed."""
    for directory, _, files in os.walk(os.path.join(ROOT, "epl")):
        if "__pycache__" in directory:
            continue
        if any(name.endswith(".py") for name in files):
            assert "__init__.py" in files, directory


def test_built_wheel_metadata(tmp_path):
    """Build the wheel (about 1 s) from a copy of the sources, so that nothing is written
    into the checkout, and read what an installer sees."""
    source = tmp_path / "source"
    shutil.copytree(os.path.join(ROOT, "epl"), source / "epl",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(source)],
                   check=True, capture_output=True, timeout=120)
    [wheel] = list((tmp_path / "wheel").glob("*.whl"))
    assert wheel.name == f"epl_tf-{epl.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = f"epl_tf-{epl.__version__}.dist-info"
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert {name.split("/")[0] for name in names} == {"epl", info}
    assert "epl/tools/launch.py" in names and f"{info}/licenses/LICENSE" in names
    assert metadata["Name"] == "epl-tf" and metadata["Version"] == epl.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert sorted(metadata.get_all("Provides-Extra")) == ["cpu", "gpu", "test"]
    requires = metadata.get_all("Requires-Dist")
    assert 'tensorflow-cpu==2.21.0; extra == "cpu"' in requires
    assert 'tensorflow[and-cuda]==2.21.0; extra == "gpu"' in requires
    for script in ("epl-dump = epl.tools.dump:main", "epl-plan = epl.tools.plan:main",
                   "epl-launch = epl.tools.launch:main", "epl-env = epl.tools.env_report:main"):
        assert script in entry_points
