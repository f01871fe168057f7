"""Install the EPL packages (`epl`, `graph_passes`, `tools`) and console scripts."""
from setuptools import find_packages, setup

setup(
    name="epl",
    version="0.1.0",
    description="Whale-style hybrid parallelism for TensorFlow graph-mode training",
    python_requires=">=3.11",
    packages=find_packages(include=["epl", "epl.*", "graph_passes", "graph_passes.*", "tools", "tools.*"]),
    entry_points={
        "console_scripts": [
            "epl-dump=tools.epl_dump:main",
            "epl-plan=tools.epl_plan:main",
            "epl-launch=tools.epl_launch:main",
        ]
    },
)
