"""The import graph of EPL's own modules, and its cycles.

    python scripts/import_graph.py            # exit 1 and list every cycle, if any
    python scripts/import_graph.py --edges    # print the graph (module -> modules it imports)

Every `import` and `from ... import` of a project module counts, at module level
or inside a function: an import moved into a function to dodge a cycle is still
an edge of it. The package (epl) is read from the repository
root; `from pkg import name` counts as importing `pkg.name` when that is a module,
else `pkg`. Modules are read with `ast`, never imported. The test suite runs
this check (tests/tools/test_import_graph.py), so CI fails on a new cycle.
"""
from __future__ import annotations

import argparse
import ast
import os
import sys

PACKAGES = ("epl",)


def project_modules(root: str) -> dict[str, str]:
    """{dotted module name: file path} of every module of the project's packages."""
    modules = {}
    for package in PACKAGES:
        for directory, _, files in os.walk(os.path.join(root, package)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, root)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = path
    return modules


def _resolve(module: str, level: int, current: str, is_package: bool) -> str:
    """The absolute name of a (possibly relative) import in module `current`."""
    if not level:
        return module
    base = current.split(".") if is_package else current.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: str, modules: dict) -> set[str]:
    """The project modules `name` imports, anywhere in its file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    found = set()
    is_package = path.endswith("__init__.py")
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(_closest(alias.name, modules))
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name, is_package)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in modules else _closest(base, modules))
    found.discard(None)
    found.discard(name)
    return found


def _closest(dotted: str, modules: dict) -> str | None:
    """The longest project module that `dotted` names or lies inside."""
    parts = dotted.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(root: str) -> dict[str, set[str]]:
    """{module: project modules it imports}."""
    modules = project_modules(root)
    return {name: imports_of(name, path, modules) for name, path in sorted(modules.items())}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each
    sorted; a module importing itself does not count."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph) + 100))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(result)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--edges", action="store_true", help="print the whole graph")
    args = parser.parse_args(argv)
    graph = import_graph(args.root)
    if args.edges:
        for module, imported in graph.items():
            print(f"{module} -> {', '.join(sorted(imported)) or '(none)'}")
    found = cycles(graph)
    for component in found:
        print(f"import cycle among {len(component)} modules: {', '.join(component)}")
    if not found:
        print(f"import graph: {len(graph)} modules, no cycle")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
