"""docs/: the generated references match the code (scripts/gen_docs.py), every public
name, CLI option and EPLError has an entry, links resolve, and the code samples use
the current API (names that exist, config keys of the schema)."""
from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import re
import sys

import pytest

import epl
from epl import config as epl_config
from epl.errors import EPLError
from paths import ROOT, SCRIPTS  # noqa: E402

sys.path.insert(0, SCRIPTS)
import gen_docs  # noqa: E402

DOCS = os.path.join(ROOT, "docs")


def _read(*parts: str) -> str:
    with open(os.path.join(ROOT, *parts)) as f:
        return f.read()


@pytest.mark.parametrize("page", sorted(gen_docs.PAGES))
def test_generated_page_is_current(page):
    assert _read("docs", page) == gen_docs.PAGES[page](), (
        f"docs/{page} is stale: run python scripts/gen_docs.py")


def test_config_reference_lists_every_key():
    text = _read("docs", "config.md")
    for spec in epl_config.schema():
        assert f"| `{spec.key}` |" in text, spec.key


def test_api_reference_has_every_public_name():
    text = _read("docs", "api.md")
    for name in epl.__all__:
        assert f"### `epl.{name}`" in text, name
    for name, value in vars(epl.layers).items():
        if not name.startswith("_") and callable(value) \
                and getattr(value, "__module__", None) == "epl.layers":
            assert f"`epl.layers.{name}(" in text, name


def _options(parser) -> set[str]:
    options = {option for action in parser._actions for option in action.option_strings}
    for sub in gen_docs._subparsers(parser).values():
        options |= _options(sub)
    return options


def test_cli_reference_has_every_option():
    text = _read("docs", "cli.md")
    for name, parser in gen_docs.cli_parsers().items():
        assert f"## {name}" in text
        for option in _options(parser):
            assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text), (name, option)


def _error_classes() -> set[type]:
    """Every EPLError subclass of a module of the package (all modules imported)."""
    for module in pkgutil.walk_packages(epl.__path__, "epl."):
        importlib.import_module(module.name)
    found, todo = set(), [EPLError]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("epl") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found


def test_troubleshooting_lists_every_error_class():
    """Every public EPLError subclass has a section; a private one (config's
    `_UnknownAttributeError`) is covered by its public base's."""
    headings = set(re.findall(r"^## (\w+)$", _read("docs", "troubleshooting.md"), re.M))
    classes = _error_classes() | {EPLError}
    assert {"ConfigError", "DumpError", "PlanInputError"} <= {c.__name__ for c in classes}
    for cls in classes:
        if cls.__name__.startswith("_"):
            assert any(base.__name__ in headings for base in cls.__mro__[1:]), cls
        else:
            assert cls.__name__ in headings, f"docs/troubleshooting.md lacks {cls.__name__}"


def _markdown_files() -> list[str]:
    files = [os.path.join(ROOT, "README.md")]
    for directory, _, names in os.walk(DOCS):
        files += [os.path.join(directory, name) for name in names if name.endswith(".md")]
    return files


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but `-` and `_` dropped,
    spaces made `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    """The anchors of a page's headings (outside code blocks), with GitHub's `-1`, `-2`
    suffixes for repeated headings."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    anchors: set[str] = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        anchor, n = _anchor(heading), 0
        while (anchor if n == 0 else f"{anchor}-{n}") in anchors:
            n += 1
        anchors.add(anchor if n == 0 else f"{anchor}-{n}")
    return anchors


def _links(text: str) -> list[tuple[str, str]]:
    """(target, anchor) of every markdown link of a page, outside code blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text)


def test_anchor_matches_github():
    assert _anchor("TensorFlow 2 steps") == "tensorflow-2-steps"
    assert _anchor("`io.batch_mode: \"global\"`") == "iobatch_mode-global"
    assert _anchor("Tensor and expert parallelism: `epl.split` (reference)") == \
        "tensor-and-expert-parallelism-eplsplit-reference"
    assert _anchors("# A\n## B\n## B\n```\n# not a heading\n```\n") == {"a", "b", "b-1"}


def test_relative_links_resolve():
    """Every relative link of README.md and docs/ names an existing file and, with a
    #anchor into a markdown page, one of that page's headings."""
    for path in _markdown_files():
        with open(path) as f:
            text = f.read()
        for target, anchor in _links(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(path), target)) \
                if target else path
            assert os.path.exists(resolved), f"{path}: broken link {target}"
            if anchor and resolved.endswith(".md"):
                with open(resolved) as f:
                    assert anchor in _anchors(f.read()), \
                        f"{path}: link {target}#{anchor}: no such heading in {resolved}"


def test_every_page_is_linked_from_the_index():
    index = _read("docs", "README.md")
    for name in os.listdir(os.path.join(DOCS, "tutorials")):
        assert f"(tutorials/{name})" in index, name
    for name in os.listdir(DOCS):
        if name.endswith(".md") and name != "README.md":
            assert f"({name})" in index, f"docs/README.md does not link {name}"
    readme = _read("README.md")
    for page in ("docs/README.md", "docs/quickstart.md", "docs/config.md", "docs/api.md",
                 "docs/architecture.md", "docs/batch-contract.md", "docs/troubleshooting.md"):
        assert f"({page})" in readme, page


def test_readme_is_the_front_page():
    """The README is short: the setup commands first (.ci/run runs `make test`), a
    scoped script, the TensorFlow 2 section, and links into docs/."""
    readme = _read("README.md")
    assert len(readme.splitlines()) <= 120
    commands = re.findall(r"^(make \w+)", readme, re.M)
    assert commands[:1] == ["make run"] and "make test" in commands[:3], commands
    assert "make test" in _read(".ci", "run")
    assert "epl.replicate(" in readme
    section = readme.split("## TensorFlow 2 programs\n", 1)[1].split("\n## ", 1)[0]
    assert "(docs/tf2.md#support-matrix)" in section
    assert "(docs/batch-contract.md#tensorflow-2-steps)" in section


def _python_samples() -> list[tuple[str, str]]:
    """The ```python blocks of the hand-written pages (api.md's blocks are signatures)."""
    samples = []
    generated = {os.path.join(DOCS, page) for page in gen_docs.PAGES}
    for path in sorted(set(_markdown_files()) - generated):
        with open(path) as f:
            text = f.read()
        samples += [(path, code) for code in re.findall(r"```python\n(.*?)```", text, re.S)]
    return samples


def _literal_config(node: ast.Call) -> dict | None:
    """The dict literal given to epl.Config(...), or None when it is not literal."""
    if not node.args or not isinstance(node.args[0], ast.Dict):
        return None
    try:
        return ast.literal_eval(node.args[0])
    except ValueError:
        return None


def test_code_samples_use_the_current_api():
    samples = _python_samples()
    assert len(samples) >= 10
    configs = 0
    for path, code in samples:
        tree = ast.parse(code, path)   # every sample is valid Python
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "epl":
                assert node.attr in epl.__all__, f"{path}: epl.{node.attr}"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                    and getattr(node.value.value, "id", None) == "epl" \
                    and node.value.attr in ("layers", "GraphKeys"):
                assert hasattr(getattr(epl, node.value.attr), node.attr), \
                    f"{path}: epl.{node.value.attr}.{node.attr}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "Config" \
                    and getattr(node.func.value, "id", None) == "epl":
                values = _literal_config(node)
                if values is not None:
                    epl.Config(values, environ={})   # raises ConfigError on a bad key
                    configs += 1
    assert configs >= 8
