"""Where things are in the repository, for tests in any folder under tests/."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
EXAMPLES = os.path.join(ROOT, "examples")
SCRIPTS = os.path.join(ROOT, "scripts")
WORKERS = os.path.join(ROOT, "tests", "workers")
