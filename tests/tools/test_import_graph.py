"""EPL's modules import one way (scripts/import_graph.py): no cycle, counting imports
inside functions too, and every module imports on its own in a fresh process."""
import os
import subprocess
import sys

from paths import ROOT, SCRIPTS  # noqa: E402
sys.path.insert(0, SCRIPTS)

import import_graph  # noqa: E402


def test_no_import_cycle():
    graph = import_graph.import_graph(ROOT)
    assert "epl.parallel" in graph and "epl.passes.replication.replicate" in graph["epl.parallel"]
    assert import_graph.cycles(graph) == []


def test_a_cycle_is_found(tmp_path):
    for name, body in {"a.py": "from epl import b\n", "b.py": "def f():\n    import epl.a\n"}.items():
        (tmp_path / "epl").mkdir(exist_ok=True)
        (tmp_path / "epl" / name).write_text(body)
    (tmp_path / "epl" / "__init__.py").write_text("")
    assert import_graph.cycles(import_graph.import_graph(str(tmp_path))) == [["epl.a", "epl.b"]]


def test_every_layer_imports_first():
    """A pass, the driver or a hook imported before anything else (the package
    `epl` loads its API lazily, so no import reaches back into a module being
    imported)."""
    for module in ("epl.passes.replication.replicate", "epl.passes.zero", "epl.parallel",
                   "epl.hooks.session", "epl.planner.plan", "epl.runtime.cluster"):
        result = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (module, result.stderr[-2000:])
