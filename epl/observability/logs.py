"""EPL's logging: one `logging.getLogger("epl")` hierarchy.

Every EPL module logs through a child of the logger named ``"epl"``: each
uses ``logging.getLogger(__name__)``, which is ``epl.<module>`` since every
module is inside the package. So one line controls all of EPL's messages::

    logging.getLogger("epl").setLevel(logging.INFO)

What EPL logs: at INFO, a summary of the parallel graph when it is built
(replicas, devices, stages and micro-batches, split groups, collectives per
step with their bytes, rewrite seconds; `epl.observability.summary`), dumps and traces
written; at WARNING, fallbacks (an op kept in float32, an op gathered
instead of split) and checks worth a look. Warnings that users filter with
Python's `warnings` machinery (`SplitFallbackWarning`) are also issued as
warnings.

TensorFlow's start-up lines: `quiet_tensorflow_startup()` (EPL's CLIs and the
examples import TensorFlow inside it) sets ``TF_CPP_MIN_LOG_LEVEL=1`` unless
the user set it, so TensorFlow's C++ INFO lines are not printed, and drops
the lines TensorFlow 2.21 prints while it loads, before that variable is read
(absl's "All log messages before absl::InitializeLog() is called ..." and
the oneDNN INFO line), as the variable would. Set ``TF_CPP_MIN_LOG_LEVEL=0``
to see them all.

EPL adds no handler unless asked: with Python's defaults WARNING and above
reach stderr, INFO does not. The config key ``debug.log_level`` (or
``EPL_DEBUG_LOG_LEVEL``) makes `epl.init` attach one stream handler to the
``"epl"`` logger at that level (`configure`); the empty default leaves the
logging configuration to the application.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile

from epl.errors import ConfigError

LOGGER_NAME = "epl"
LOG_FORMAT = "%(asctime)s EPL %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _EPLHandler(logging.StreamHandler):
    """The stream handler `configure` attaches (recognised so it is attached once).

    It prints only while the root logger has no handler: once the application
    configured logging (logging.basicConfig, pytest's capture), EPL's records
    propagate there and are printed once, by the application's handlers.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return
        self.stream = sys.stderr   # the current stderr (it may have been replaced)
        super().emit(record)


def configure(level: str) -> None:
    """Attach EPL's stream handler (sys.stderr) to the "epl" logger at `level`.

    level: one of DEBUG, INFO, WARNING, ERROR (any case); "" does nothing.
    Calling it again changes the level and keeps the one handler. Records
    still propagate to the root logger; the handler stays quiet while the root
    logger has handlers of its own, so no message is printed twice.
    """
    if not level:
        return
    name = level.upper()
    if name not in LEVELS:
        raise ConfigError(f"debug.log_level must be one of {', '.join(LEVELS)} or '', "
                          f"got {level!r}")
    logger = logging.getLogger(LOGGER_NAME)
    handler = next((h for h in logger.handlers if isinstance(h, _EPLHandler)), None)
    if handler is None:
        handler = _EPLHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
    logger.setLevel(getattr(logging, name))


#: TensorFlow's C++ log lines ("I0000 00:00:1796.. 123 port.cc:153] ...") and levels.
_TF_LOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] ")
_TF_LEVELS = {"I": 0, "W": 1, "E": 2, "F": 3}
_ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
DEFAULT_TF_LOG_LEVEL = "1"


def tensorflow_line_hidden(line: str, min_level: int) -> bool:
    """True for a line TensorFlow prints while loading that `TF_CPP_MIN_LOG_LEVEL`
    `min_level` hides (its C++ log lines below the level, absl's notice from 1)."""
    if min_level >= 1 and line.rstrip("\n") == _ABSL_NOTICE:
        return True
    match = _TF_LOG_LINE.match(line)
    return bool(match) and _TF_LEVELS[match.group(1)] < min_level


@contextlib.contextmanager
def quiet_tensorflow_startup():
    """Import TensorFlow inside this block to keep its start-up lines off stderr.

    Sets ``TF_CPP_MIN_LOG_LEVEL`` to 1 unless the environment sets it; while the
    block runs (the first import of TensorFlow), stderr (file descriptor 2) goes
    to a temporary file whose lines are written back afterwards, less those the
    level hides (`tensorflow_line_hidden`). Does nothing more once TensorFlow is
    loaded.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", DEFAULT_TF_LOG_LEVEL)
    try:
        min_level = int(os.environ["TF_CPP_MIN_LOG_LEVEL"])
    except ValueError:
        min_level = 0
    if "tensorflow" in sys.modules or min_level <= 0:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode("utf-8", "replace")
                    .splitlines(keepends=True) if not tensorflow_line_hidden(line, min_level)]
            if kept:
                os.write(2, "".join(kept).encode("utf-8"))
