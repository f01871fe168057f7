"""Check, before the first training step, that every worker runs the same EPL and config.

Workers that run different EPL versions, or the same script with a different
configuration (one worker's environment sets ``EPL_PIPELINE_NUM_MICRO_BATCH``,
another's does not), build graphs that may still have the same collectives,
and then train silently on different batches, or fail later with an error
about something else. The collective check (epl.runtime.collective_check)
exchanges each worker's `worker_record` and calls `difference`, which names
the differing keys and values, before any step runs.

Keys that may differ between workers: what describes a worker's own hardware
or output (``cluster.virtual_devices``, ``cluster.run_visible_devices``,
``cluster.device_profiles``, every ``debug.*`` key) and
``communication.collective_timeout_s`` (each worker's own bound).
"""
from __future__ import annotations

import json
from typing import Any

from epl.config import Config

#: What the exchanged record looks like; a record without it (or with another
#: value) comes from another EPL version.
RECORD_FORMAT = 2
PER_WORKER_KEYS = ("cluster.virtual_devices", "cluster.run_visible_devices",
                   "cluster.device_profiles", "communication.collective_timeout_s")


def compared_config(config: Config) -> dict[str, Any]:
    """The keys of `config` every worker must agree on, with their values."""
    return {key: value for key, value in config.to_dict().items()
            if key not in PER_WORKER_KEYS and not key.startswith("debug.")}


def epl_version() -> str:
    """The running EPL's version."""
    import epl
    return str(epl.__version__)


def _value(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def difference(records: list[dict[str, Any]]) -> str | None:
    """The first disagreement on the EPL version or the config among the workers'
    records (index = rank; each with "epl_version" and "config"), in words, or None."""
    reference = records[0]
    for rank, record in enumerate(records[1:], start=1):
        if record["epl_version"] != reference["epl_version"]:
            return ("workers run different EPL versions: worker %d runs EPL %s, worker 0 runs "
                    "EPL %s; install the same EPL on every host" % (
                        rank, record["epl_version"], reference["epl_version"]))
    for rank, record in enumerate(records[1:], start=1):
        keys = sorted(set(reference["config"]) | set(record["config"]))
        differ = [key for key in keys
                  if _value(record["config"].get(key)) != _value(reference["config"].get(key))]
        if differ:
            return ("workers run with different configs: %s. Every worker must use the same "
                    "config (the same epl.Config dict and EPL_* environment variables); only "
                    "%s and debug.* may differ" % ("; ".join(
                        "worker %d has %s %s, worker 0 has %s" % (
                            rank, key, _value(record["config"].get(key)),
                            _value(reference["config"].get(key))) for key in differ),
                        ", ".join(PER_WORKER_KEYS)))
    return None
