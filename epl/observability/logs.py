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

EPL adds no handler unless asked: with Python's defaults WARNING and above
reach stderr, INFO does not. The config key ``debug.log_level`` (or
``EPL_DEBUG_LOG_LEVEL``) makes `epl.init` attach one stream handler to the
``"epl"`` logger at that level (`configure`); the empty default leaves the
logging configuration to the application.
"""
from __future__ import annotations

import logging
import sys

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
