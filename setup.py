"""Install EPL: the packages `epl` and `graph_passes`, the tools, and the console scripts.

The command-line tools live in the repository's `tools/` directory but are
installed as the package `epl_tools` (PyPI has an unrelated top-level package
named `tools`, so EPL does not install one). `package_dir` maps `epl_tools`
onto `tools/`; the console scripts `epl-dump`, `epl-plan` and `epl-launch` run
`epl_tools.<module>:main`. From a checkout (tests, benchmarks) the same modules
are importable as `tools.<module>` because the repository root is on sys.path.
"""
from setuptools import find_packages, setup

setup(
    name="epl",
    version="0.1.0",
    description="Whale-style hybrid parallelism for TensorFlow graph-mode training",
    python_requires=">=3.11",
    packages=find_packages(include=["epl", "epl.*", "graph_passes", "graph_passes.*"])
    + ["epl_tools"],
    package_dir={"epl_tools": "tools"},
    entry_points={
        "console_scripts": [
            "epl-dump=epl_tools.epl_dump:main",
            "epl-plan=epl_tools.epl_plan:main",
            "epl-launch=epl_tools.epl_launch:main",
        ]
    },
)
