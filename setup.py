"""Install EPL: the one package `epl` (with its CLIs in `epl.tools`) and the console scripts.

The console scripts `epl-dump`, `epl-plan`, `epl-launch` and `epl-env` run
`epl.tools.<module>:main`. Build, patch and GPU-check scripts live in the
repository's `scripts/` directory and are not installed.
"""
from setuptools import find_packages, setup

setup(
    name="epl",
    version="0.1.0",
    description="Whale-style hybrid parallelism for TensorFlow graph-mode training",
    python_requires=">=3.11",
    packages=find_packages(include=["epl", "epl.*"]),
    entry_points={
        "console_scripts": [
            "epl-dump=epl.tools.dump:main",
            "epl-plan=epl.tools.plan:main",
            "epl-launch=epl.tools.launch:main",
            "epl-env=epl.tools.env_report:main",
        ]
    },
)
