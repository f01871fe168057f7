"""EPL configuration: the `Config` class and the schema of every key.

A `Config` holds one typed value for every key of the schema below. Keys are
dotted strings, ``"<section>.<key>"``, as in EasyParallelLibrary (EPL)::

    config = epl.Config({"pipeline.num_micro_batch": 4, "amp.level": "O1"})
    config.pipeline.num_micro_batch        # 4
    config.get("amp.level")                # "O1"
    config.zero.level = "v1"               # EPL's attribute style, before epl.init

Where a value comes from, lowest priority first (EPL's order):

1. the schema default;
2. the environment variable ``EPL_<SECTION>_<KEY>`` (upper case, dots become
   underscores, e.g. ``EPL_PIPELINE_NUM_MICRO_BATCH=4``), read once, when the
   `Config` is built;
3. ``param_dict``, the dict given to `Config`: it wins over the environment,
   as in EPL. When it overrides a variable that is set to another value, a
   warning names both (a launcher's setting, such as ``epl-launch
   --virtual-devices``, is then not what the script runs with);
4. attribute assignment (``config.pipeline.num_micro_batch = 4``) after
   construction, until `epl.init` takes the Config.

Every value is checked against its key's type, allowed values and range, also
on assignment; a bad value or an unknown key raises `epl.errors.ConfigError`
naming the key, the bad value and what would be valid. Coercions:

- an int is accepted for a float key (stored as float); bools are never
  accepted as numbers, and numbers never as bools;
- allowed string values match without regard to case and are stored in
  their documented spelling (``"o1"`` becomes ``"O1"``), since EPL lowered
  the case of every string value;
- dict and list values are copied and frozen (read-only mappings, tuples);
  `Config.to_dict` gives plain dicts and lists back;
- only environment variables are parsed from strings: bools from
  ``true``/``false``/``1``/``0`` (any case), numbers as Python literals,
  dicts and lists as JSON.

Mutability: a `Config` can be changed by assigning its keys until `epl.init`
takes it; `epl.init` freezes it (`Config.freeze`), because the graphs built
afterwards are annotated, rewritten and run under those values. Assigning a
key of a frozen Config raises ConfigError saying how to change the config
(a new Config and another `epl.init`). Only a frozen Config is hashable.
`Config.updated` builds a new Config with some values changed. `schema` lists
every key with its type, default, allowed values and one-line doc;
`format_schema` renders that list as a table.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from epl.errors import ConfigError

__all__ = [
    "Config",
    "ConfigSection",
    "KeySpec",
    "schema",
    "format_schema",
    "env_var_name",
    "ENV_PREFIX",
]

_LOG = logging.getLogger(__name__)

ENV_PREFIX = "EPL_"
"""Prefix of the environment variables that override configuration keys."""

_TYPES = ("bool", "int", "float", "str", "dict", "list")
_ENV_TRUE = ("true", "1")
_ENV_FALSE = ("false", "0")


# Helpers for dict and list values, which are stored frozen.

def _freeze(value: Any) -> Any:
    """Copy a dict or list value into a read-only form (mappings, tuples)."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: _freeze(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(item) for item in value)
    return value


def _thaw(value: Any) -> Any:
    """Turn a frozen value back into plain dicts and lists."""
    if isinstance(value, Mapping):
        return {key: _thaw(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return [_thaw(item) for item in value]
    return value


def _hashable(value: Any) -> Any:
    """Return a hashable stand-in for a frozen value."""
    if isinstance(value, Mapping):
        return ("dict", frozenset((key, _hashable(item)) for key, item in value.items()))
    if isinstance(value, tuple):
        return ("list", tuple(_hashable(item) for item in value))
    return value


@dataclass(frozen=True)
class KeySpec:
    """The schema entry of one configuration key.

    Attributes:
        key: the dotted name, ``"<section>.<name>"``.
        type: one of ``"bool"``, ``"int"``, ``"float"`` (any real number),
            ``"str"``, ``"dict"``, ``"list"``.
        default: the value a `Config` holds when nothing sets the key.
        doc: one line saying what the key does.
        allowed: for ``str`` keys, the only accepted values (matched without
            regard to case); None accepts any string.
        minimum: for numeric keys, the smallest accepted value; None for none.
        exclusive: True when ``minimum`` itself is not accepted (``> minimum``).
        keywords: strings a numeric key accepts besides numbers
            (``amp.loss_scale`` accepts ``"dynamic"``).
        nullable: None is accepted and stored, meaning "unset" (EPL's
            ``pipeline.num_stages: None``); the environment variable takes
            ``none`` for it.
    """

    key: str
    type: str
    default: Any
    doc: str
    allowed: tuple[str, ...] | None = None
    minimum: float | None = None
    exclusive: bool = False
    keywords: tuple[str, ...] = ()
    nullable: bool = False

    def __post_init__(self) -> None:
        """Freeze a dict or list default so the schema cannot be changed by accident."""
        object.__setattr__(self, "default", _freeze(self.default))

    @property
    def section(self) -> str:
        """The section part of the key (``"pipeline"``)."""
        return self.key.split(".", 1)[0]

    @property
    def name(self) -> str:
        """The key's name within its section (``"num_micro_batch"``)."""
        return self.key.split(".", 1)[1]

    @property
    def env_var(self) -> str:
        """The environment variable that overrides this key."""
        return env_var_name(self.key)

    def describe_valid(self) -> str:
        """Return a phrase naming the valid values, e.g. ``"an int >= 1"``."""
        if self.allowed is not None:
            return "one of %s" % list(self.allowed)
        noun = {
            "bool": "a bool (True or False)",
            "int": "an int",
            "float": "a number",
            "str": "a str",
            "dict": "a dict",
            "list": "a list",
        }[self.type]
        if self.minimum is not None:
            noun += " %s %s" % (">" if self.exclusive else ">=", _plain(self.minimum))
        if self.keywords:
            noun = " or ".join([repr(word) for word in self.keywords] + [noun])
        if self.nullable:
            noun = "None (unset) or " + noun
        return noun


def env_var_name(key: str) -> str:
    """Return the environment variable for a dotted key.

    ``"pipeline.num_micro_batch"`` gives ``"EPL_PIPELINE_NUM_MICRO_BATCH"``.
    """
    return ENV_PREFIX + key.replace(".", "_").upper()


def _plain(number: float) -> str:
    """Write a bound without a useless ``.0`` (``1`` rather than ``1.0``)."""
    return str(int(number)) if float(number).is_integer() else str(number)


# --------------------------------------------------------------------------
# The schema: one entry per key, grouped by section in EPL's documented order.
# Keys marked "successor" are not in EPL; they belong to this project.
# --------------------------------------------------------------------------

_PIPELINE_STRATEGIES = ("PreferBackward", "PreferForward")

_SCHEMA: tuple[KeySpec, ...] = (
    # pipeline
    KeySpec("pipeline.num_micro_batch", "int", 1,
            "Number of micro-batches per step in pipeline parallelism.",
            minimum=1),
    # EPL's documented default None means "unset": no automatic partition (its code
    # wrote -1 and partitioned only for a value > 1); 1 also means one stage.
    KeySpec("pipeline.num_stages", "int", None,
            "Number of pipeline stages when auto.auto_parallel partitions the model "
            "(None: unset, no automatic stages).",
            minimum=1, nullable=True),
    KeySpec("pipeline.strategy", "str", "PreferBackward",
            "Pipeline schedule: PreferBackward (PipeDream-like, 1F1B) or "
            "PreferForward (GPipe-like).",
            allowed=_PIPELINE_STRATEGIES),
    # gradient_checkpoint
    KeySpec("gradient_checkpoint.type", "str", "",
            "How checkpoint tensors are chosen: '' (off), 'collection' "
            "(user's collection), 'auto' (searched).",
            allowed=("", "collection", "auto")),
    KeySpec("gradient_checkpoint.end_taskgraph", "int", -1,
            "Index of the last TaskGraph that auto gradient checkpointing "
            "applies to (-1 = the last one)."),
    KeySpec("gradient_checkpoint.check_gradients", "bool", False,
            "Check the recomputed gradients against the gradients without "
            "checkpointing."),
    # zero
    # EPL's v0 partitions the optimizer states only (gradients all-reduced); here
    # 'v0' runs the same sharding as 'v1' (same updates, less memory and traffic).
    KeySpec("zero.level", "str", "",
            "ZeRO level: '' (off) or 'v1' (partition optimizer states and the "
            "update across data-parallel replicas; gradients are reduce-scattered); "
            "'v0' (EPL: optimizer states only) runs as 'v1'.",
            allowed=("", "v0", "v1")),
    # offload
    KeySpec("offload.level", "str", "",
            "Weight offload level: '' (off) or 'v0' (keep all weights in CPU memory).",
            allowed=("", "v0")),
    # amp
    KeySpec("amp.level", "str", "",
            "Automatic mixed precision level: '' (off) or 'O1'.",
            allowed=("", "O1")),
    KeySpec("amp.debug_log", "bool", False,
            "Log which ops automatic mixed precision casts."),
    KeySpec("amp.loss_scale", "float", "dynamic",
            "Loss scale for mixed precision: 'dynamic' or a fixed positive number.",
            minimum=0, exclusive=True, keywords=("dynamic",)),
    KeySpec("amp.dtype", "str", "float16",  # successor
            "Low-precision dtype for automatic mixed precision.",
            allowed=("float16", "bfloat16")),
    # optimizer
    KeySpec("optimizer.num_apply_group", "int", 1,
            "Number of groups the gradient apply is split into, to cap the "
            "peak memory of temporaries.",
            minimum=1),
    # cluster
    KeySpec("cluster.device_place_prefer_intra_node", "bool", True,
            "Prefer placing one model replica within one node."),
    KeySpec("cluster.run_visible_devices", "str", "",
            "Visible devices for the session; usually set by the scheduler."),
    KeySpec("cluster.colocate_split_and_replicate", "bool", False,
            "Place split and replicate TaskGraphs on the same devices."),
    KeySpec("cluster.virtual_devices", "int", 4,  # successor
            "Number of virtual CPU devices per worker on a machine without "
            "accelerators.",
            minimum=1),
    KeySpec("cluster.device_profiles", "dict", {},  # successor
            "Overrides of device profiles (by device or profile name) for "
            "the planner."),
    # split (successor)
    KeySpec("split.moe_chunks", "int", 1,
            "Chunks each expert dispatch of epl.split is cut into along the tokens' "
            "capacity axis, so that the all-to-all of chunk i+1 overlaps the expert "
            "compute of chunk i (Tutel's and FasterMoE's pipelining); must divide the "
            "capacity. 1 = one exchange; epl-plan prints the count its cost model "
            "predicts fastest.",
            minimum=1),
    # communication
    KeySpec("communication.num_communicators", "int", 2,
            "Number of communicators in the communication pool.",
            minimum=1),
    KeySpec("communication.sparse_as_dense", "bool", False,
            "Convert sparse gradients to dense tensors before communication."),
    KeySpec("communication.max_splits", "int", 5,
            "Most buckets the gradients of one device and dtype are fused into "
            "(raises communication.fusion_threshold_mb where needed; 0 = no limit).",
            minimum=0),
    KeySpec("communication.fusion_threshold_mb", "float", 128.0,  # successor
            "Size in MiB at which a gradient fusion buffer is closed.",
            minimum=0, exclusive=True),
    KeySpec("communication.fp16", "bool", False,
            "Compress gradients to float16 for all-reduce."),
    # EPL documents an integer; any positive number is accepted here.
    KeySpec("communication.fp16_scale", "float", 128.0,
            "Scale applied to gradients around float16 all-reduce.",
            minimum=0, exclusive=True),
    # EPL's False clipped each replica's gradients before the all-reduce; here the
    # reduced gradients are always clipped (docs/differences-from-epl.md).
    KeySpec("communication.clip_after_allreduce", "bool", False,
            "Accepted for EPL's scripts; no effect: gradients are always clipped after "
            "they are reduced (the same update as single-device training)."),
    KeySpec("communication.gradients_reduce_method", "str", "mean",
            "How replicas' gradients are combined: 'mean' or 'sum'.",
            allowed=("mean", "sum")),
    KeySpec("communication.collective_timeout_s", "float", 300.0,  # successor
            "Seconds a collective may wait for its peers before failing.",
            minimum=0, exclusive=True),
    # io
    KeySpec("io.slicing", "bool", False,
            "Slice the input files among data-parallel workers automatically."),
    KeySpec("io.unbalanced_io_slicing", "bool", False,
            "Allow workers to get unequal numbers of input files."),
    KeySpec("io.drop_last_files", "bool", False,
            "Drop the input files left over after an even split among workers."),
    KeySpec("io.batch_mode", "str", "replica",  # successor
            "What the script's batch is: 'replica' (EPL's contract: one replica's "
            "micro-batch; each replica and micro-batch draws its own) or 'global' (the "
            "worker's whole batch, sliced among its replicas and micro-batches).",
            allowed=("replica", "global")),
    # batch_norm (successor)
    KeySpec("batch_norm.moving_statistics", "str", "replica0",
            "What moves batch norm's moving mean and variance (the writes in "
            "tf.GraphKeys.UPDATE_OPS), once per step on every replica: 'replica0' (the "
            "first replica's first micro-batch, Horovod's rank 0) or 'mean' (the mean over "
            "every replica and micro-batch, MirroredStrategy's).",
            allowed=("replica0", "mean")),
    # auto
    KeySpec("auto.auto_parallel", "bool", False,
            "Let the planner choose the parallel strategy (experimental)."),
    # debug (successor)
    KeySpec("debug.dump_dir", "str", "",
            "Directory for graph dumps after every pass ('' = no dumps)."),
    KeySpec("debug.check_invariants", "bool", False,
            "Check graph invariants between passes, and each pass's modified flag against "
            "a graph fingerprint."),
    KeySpec("debug.disabled_passes", "list", [],
            "Names of passes to leave off (as TVM's disabled_pass), for debugging a rewrite; "
            "a pass another enabled pass needs cannot be disabled."),
    KeySpec("debug.log_level", "str", "",
            "Level of the stream handler epl.init attaches to the 'epl' logger ('' = leave "
            "logging to the application).",
            allowed=("", "DEBUG", "INFO", "WARNING", "ERROR")),
    KeySpec("debug.log_all_ranks", "bool", False,
            "Print the parallel-graph summary and ProgressHook's lines on every worker "
            "(default: worker 0 only, as Horovod scripts print)."),
    KeySpec("debug.trace_dir", "str", "",
            "Directory for Chrome traces (chrome://tracing, Perfetto) of the training "
            "steps in debug.trace_steps ('' = no traces)."),
    KeySpec("debug.trace_steps", "list", [2],
            "Training runs to trace with debug.trace_dir, counted from 1 per graph "
            "(the first run includes TensorFlow's warm-up)."),
)

_SPECS: dict[str, KeySpec] = {spec.key: spec for spec in _SCHEMA}
_SECTIONS: dict[str, tuple[KeySpec, ...]] = {}
for _spec in _SCHEMA:
    _SECTIONS[_spec.section] = _SECTIONS.get(_spec.section, ()) + (_spec,)
del _spec
_ENV_VARS: dict[str, KeySpec] = {spec.env_var: spec for spec in _SCHEMA}


def schema() -> tuple[KeySpec, ...]:
    """Return the schema: one `KeySpec` per key, grouped by section."""
    return _SCHEMA


def format_schema() -> str:
    """Return the schema as a plain-text table: key, type, default, valid values, doc."""
    rows = [("key", "type", "default", "valid", "doc")]
    for spec in _SCHEMA:
        rows.append((spec.key, spec.type, repr(_thaw(spec.default)), spec.describe_valid(),
                     spec.doc))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        lines.append("  ".join(cells + [row[4]]).rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

def _invalid(spec: KeySpec, value: Any, source: str, note: str = "",
             show_type: bool = True) -> ConfigError:
    """Build the error for a bad value: where it came from, the value, what is valid.

    The value's type is shown unless ``show_type`` is False or the value is a
    string given to a key that takes strings.
    """
    shown = repr(_thaw(value))
    takes_str = spec.type == "str" or bool(spec.keywords)
    if show_type and not (isinstance(value, str) and takes_str):
        shown += " (%s)" % type(value).__name__
    return ConfigError("Invalid value %s for %s: expected %s.%s"
                       % (shown, source, spec.describe_valid(), note))


def _check_number(spec: KeySpec, value: Any, source: str) -> int | float:
    """Validate an int or float value against the key's type and minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _invalid(spec, value, source)
    if spec.type == "int":
        if not isinstance(value, numbers.Integral):
            raise _invalid(spec, value, source)
        number: int | float = int(value)
    else:
        number = float(value)
        if math.isnan(number):
            raise _invalid(spec, value, source)
    if spec.minimum is not None:
        too_small = number <= spec.minimum if spec.exclusive else number < spec.minimum
        if too_small:
            raise _invalid(spec, value, source)
    return number


def _check_str(spec: KeySpec, value: Any, source: str) -> str:
    """Validate a str value; allowed values match without regard to case."""
    if not isinstance(value, str):
        raise _invalid(spec, value, source)
    if spec.allowed is None:
        return value
    for allowed in spec.allowed:
        if value.lower() == allowed.lower():
            return allowed
    raise _invalid(spec, value, source)


def _check_value(spec: KeySpec, value: Any, source: str) -> Any:
    """Validate and coerce a Python value for ``spec``; return the stored value.

    ``source`` names where the value came from, for the error message.
    """
    if value is None and spec.nullable:
        return None
    if spec.keywords and isinstance(value, str):
        for word in spec.keywords:
            if value.lower() == word.lower():
                return word
        raise _invalid(spec, value, source)
    if spec.type == "bool":
        if not isinstance(value, bool):
            raise _invalid(spec, value, source)
        return value
    if spec.type in ("int", "float"):
        return _check_number(spec, value, source)
    if spec.type == "str":
        return _check_str(spec, value, source)
    if spec.type == "dict":
        if not isinstance(value, Mapping):
            raise _invalid(spec, value, source)
        return _freeze(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _invalid(spec, value, source)
    return _freeze(value)


def _parse_env(spec: KeySpec, text: str, source: str) -> Any:
    """Parse an environment variable's string for ``spec``; return the stored value."""
    stripped = text.strip()
    if spec.nullable and stripped.lower() == "none":
        return None
    if spec.type == "str":
        return _check_value(spec, text if spec.allowed is None else stripped, source)
    if spec.keywords and stripped.lower() in (word.lower() for word in spec.keywords):
        return _check_value(spec, stripped, source)
    if spec.type == "bool":
        if stripped.lower() in _ENV_TRUE:
            return True
        if stripped.lower() in _ENV_FALSE:
            return False
        raise _invalid(spec, text, source, " Use one of 'true', 'false', '1', '0'.",
                       show_type=False)
    try:
        if spec.type == "int":
            parsed: Any = int(stripped)
        elif spec.type == "float":
            parsed = float(stripped)
        else:
            parsed = json.loads(stripped)
    except ValueError:
        note = " Write it as JSON." if spec.type in ("dict", "list") else ""
        raise _invalid(spec, text, source, note, show_type=False) from None
    return _check_value(spec, parsed, source)


# --------------------------------------------------------------------------
# Key lookup with suggestions
# --------------------------------------------------------------------------

def _closest(word: str, candidates: Sequence[str]) -> str | None:
    """Return the candidate closest to ``word`` (difflib), or None if none is close."""
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def _did_you_mean(suggestion: str | None) -> str:
    """Return `` Did you mean 'x'?`` for a suggestion, or "" for None."""
    return " Did you mean %r?" % suggestion if suggestion else ""


def _lookup(key: Any) -> KeySpec:
    """Return the spec of a dotted key, or raise ConfigError naming the valid keys."""
    if not isinstance(key, str):
        raise ConfigError("Config keys are dotted strings such as 'pipeline.num_micro_batch'; "
                          "got %r (%s)." % (key, type(key).__name__))
    if key in _SPECS:
        return _SPECS[key]
    section, dot, name = key.partition(".")
    sections = list(_SECTIONS)
    if section not in _SECTIONS:
        if dot:
            suggestion = _closest(key, list(_SPECS)) or _closest(section, sections)
        else:
            # A bare key name ("num_micro_batch"): look for it in every section.
            by_name = {spec.name: spec.key for spec in _SCHEMA}
            close_name = _closest(key, list(by_name))
            suggestion = by_name[close_name] if close_name else _closest(key, sections)
        problem = ("Unknown config section %r in key %r." % (section, key) if dot else
                   "Config key %r is not of the form 'section.key'." % key)
        raise ConfigError("%s%s Valid sections: %s."
                          % (problem, _did_you_mean(suggestion), ", ".join(sections)))
    names = _names(section)
    if not name:
        raise ConfigError("Config key %r names a section, not a key; use '%s.<key>'. "
                          "Valid keys of section %r: %s."
                          % (key, section, section, ", ".join(names)))
    close_name = _closest(name, names)
    suggestion = "%s.%s" % (section, close_name) if close_name else None
    raise ConfigError("Unknown config key %r.%s Valid keys of section %r: %s."
                      % (key, _did_you_mean(suggestion), section, ", ".join(names)))


def _names(section: str) -> list[str]:
    """Return the key names (without the section) of a known section."""
    return [spec.name for spec in _SECTIONS[section]]


def _warn_unknown_env(environ: Mapping[str, str]) -> None:
    """Log a warning for EPL_<SECTION>_* variables that match no key (likely typos)."""
    for var in environ:
        if var in _ENV_VARS or not var.startswith(ENV_PREFIX):
            continue
        for section in _SECTIONS:
            if var.startswith(env_var_name(section) + "_"):
                hint = _did_you_mean(_closest(var, list(_ENV_VARS)))
                _LOG.warning("Environment variable %s matches no EPL config key and is "
                             "ignored.%s", var, hint)
                break


# --------------------------------------------------------------------------
# Config objects
# --------------------------------------------------------------------------

class _UnknownAttributeError(ConfigError, AttributeError):
    """An unknown attribute of a Config or section (also an AttributeError for hasattr)."""


def _frozen_error(key: str, value: Any) -> ConfigError:
    """The error for assigning a key of a Config that epl.init has taken."""
    return ConfigError(
        "Cannot set %s = %r: this Config is in use by epl.init, which froze it (the graphs "
        "built since are annotated and rewritten under its values). Set keys before calling "
        "epl.init, or build a new Config and call epl.init with it: graphs built after that "
        "use the new values." % (key, _thaw(value)))


class ConfigSection:
    """The values of one section, e.g. ``config.pipeline``: a view of its Config.

    Keys are attributes (``config.pipeline.num_micro_batch``); assigning one
    (``config.zero.level = "v1"``) validates the value and changes the Config,
    until `epl.init` freezes it. `to_dict` gives ``{name: value}`` for the
    section.
    """

    __slots__ = ("_config", "_name")

    def __init__(self, config: "Config", name: str) -> None:
        """A view of section ``name`` of ``config``."""
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_name", name)

    @property
    def name(self) -> str:
        """The section's name (``"pipeline"``)."""
        return self._name

    def __getattr__(self, attr: str) -> Any:
        """Return the value of key ``attr`` of this section."""
        if attr.startswith("_"):
            raise AttributeError(attr)
        key = "%s.%s" % (self._name, attr)
        values = self._config._values
        if key in values:
            return values[key]
        try:
            _lookup(key)
        except ConfigError as error:
            raise _UnknownAttributeError(str(error)) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def __setattr__(self, attr: str, value: Any) -> None:
        """Set key ``attr`` of this section (validated); refused once the Config is frozen."""
        key = "%s.%s" % (self._name, attr)
        try:
            _lookup(key)
        except ConfigError as error:
            raise _UnknownAttributeError(str(error)) from None
        self._config._set(key, value)

    def __delattr__(self, attr: str) -> None:
        """Refuse: every key always has a value."""
        raise ConfigError("Cannot delete config key '%s.%s': every key has a value; assign "
                          "its default instead." % (self._name, attr))

    def __dir__(self) -> list[str]:
        """List the section's keys (for completion)."""
        return sorted(set(super().__dir__()) | set(_names(self._name)))

    def _items(self) -> dict[str, Any]:
        """{key name: stored value} of this section."""
        values = self._config._values
        return {spec.name: values[spec.key] for spec in _SECTIONS[self._name]}

    def to_dict(self) -> dict[str, Any]:
        """Return ``{key name: value}`` for this section, as plain dicts and lists."""
        return {name: _thaw(value) for name, value in self._items().items()}

    def __eq__(self, other: object) -> bool:
        """Sections are equal when their names and all values are equal."""
        if not isinstance(other, ConfigSection):
            return NotImplemented
        return self._name == other._name and self._items() == other._items()

    def __hash__(self) -> int:
        """Hash of the name and all values; only for a section of a frozen Config."""
        self._config._check_hashable()
        return hash((self._name, _hashable(MappingProxyType(self._items()))))

    def __reduce__(self) -> tuple[Any, tuple[str, dict[str, Any], bool]]:
        """Pickle by name and plain values (a section of a Config holding them)."""
        return _restore_section, (self._name, self.to_dict(), self._config.frozen)

    def __repr__(self) -> str:
        """Show the section's name and every value."""
        items = ", ".join("%s=%r" % (name, _thaw(value)) for name, value in self._items().items())
        return "ConfigSection(%r, %s)" % (self._name, items)


class Config:
    """EPL's configuration: one validated value per schema key.

    Args:
        param_dict: ``{"section.key": value}``; None or {} keeps the defaults.
        environ: the environment to read ``EPL_<SECTION>_<KEY>`` overrides
            from; None reads ``os.environ`` (once, here).

    Raises:
        ConfigError: an unknown key (naming the valid keys of its section, or
            the valid sections) or a bad value (naming the key or environment
            variable, the value and the valid values).

    Sections are attributes (``config.pipeline.num_micro_batch``), and so are
    their keys, which can be assigned until `epl.init` freezes the Config.
    See the module docstring for the precedence of defaults, the environment,
    ``param_dict`` and assignment.
    """

    __slots__ = ("_values", "_sections", "_frozen")

    def __init__(self, param_dict: Mapping[str, Any] | None = None, *,
                 environ: Mapping[str, str] | None = None) -> None:
        """Build the configuration from defaults, the environment and ``param_dict``."""
        if param_dict is None:
            param_dict = {}
        if not isinstance(param_dict, Mapping):
            raise ConfigError("Config takes a dict of {'section.key': value}, got %r (%s)."
                              % (param_dict, type(param_dict).__name__))
        environ = os.environ if environ is None else environ
        values = dict(_DEFAULTS)
        from_env = {}
        for spec in _SCHEMA:
            if spec.env_var in environ:
                source = "environment variable %s (config key %r)" % (spec.env_var, spec.key)
                from_env[spec.key] = _parse_env(spec, environ[spec.env_var], source)
        values.update(from_env)
        for key, value in param_dict.items():
            spec = _lookup(key)
            values[spec.key] = _check_value(spec, value, "config key %r" % spec.key)
            if spec.key in from_env and from_env[spec.key] != values[spec.key]:
                _LOG.warning("Config key %r is %r in the config dict, which wins over the "
                             "environment variable %s=%r (EPL's precedence).", spec.key,
                             _thaw(values[spec.key]), spec.env_var, environ[spec.env_var])
        _warn_unknown_env(environ)
        self._init_values(values)

    def _init_values(self, values: Mapping[str, Any], frozen: bool = False) -> None:
        """Store validated values and build the section views."""
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_sections",
                           {section: ConfigSection(self, section) for section in _SECTIONS})
        object.__setattr__(self, "_frozen", frozen)

    def _set(self, key: str, value: Any) -> None:
        """Validate and store ``value`` for dotted ``key`` (a known key)."""
        if self._frozen:
            raise _frozen_error(key, value)
        spec = _lookup(key)
        self._values[spec.key] = _check_value(spec, value, "config key %r" % spec.key)

    def freeze(self) -> Config:
        """Make this Config read-only (epl.init does it) and return it."""
        object.__setattr__(self, "_frozen", True)
        return self

    @property
    def frozen(self) -> bool:
        """True once `freeze` (epl.init) has made the Config read-only."""
        return self._frozen

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Return every dotted key of the schema, grouped by section."""
        return tuple(spec.key for spec in _SCHEMA)

    @classmethod
    def sections(cls) -> tuple[str, ...]:
        """Return the section names of the schema."""
        return tuple(_SECTIONS)

    @classmethod
    def schema(cls) -> tuple[KeySpec, ...]:
        """Return the schema: one `KeySpec` per key (same as `epl.config.schema`)."""
        return _SCHEMA

    def get(self, key: str) -> Any:
        """Return the value of dotted ``key``; an unknown key raises ConfigError."""
        return self._values[_lookup(key).key]

    def to_dict(self) -> dict[str, Any]:
        """Return ``{"section.key": value}`` for every key, as plain dicts and lists.

        ``Config(config.to_dict(), environ={}) == config`` holds.
        """
        return {spec.key: _thaw(self._values[spec.key]) for spec in _SCHEMA}

    def non_default(self) -> dict[str, Any]:
        """Return ``{"section.key": value}`` for the keys whose value is not the default."""
        return {spec.key: _thaw(self._values[spec.key]) for spec in _SCHEMA
                if self._values[spec.key] != _DEFAULTS[spec.key]}

    def updated(self, param_dict: Mapping[str, Any]) -> Config:
        """Return a new (unfrozen) Config with this one's values and ``param_dict`` on top.

        The environment is not read again: the new values are taken as given.
        """
        if not isinstance(param_dict, Mapping):
            raise ConfigError("Config.updated takes a dict of {'section.key': value}, "
                              "got %r (%s)." % (param_dict, type(param_dict).__name__))
        values = dict(self._values)
        for key, value in param_dict.items():
            spec = _lookup(key)
            values[spec.key] = _check_value(spec, value, "config key %r" % spec.key)
        return _restore(values)

    def __getattr__(self, attr: str) -> ConfigSection:
        """Return section ``attr`` (``config.pipeline``)."""
        if attr.startswith("_"):
            raise AttributeError(attr)
        try:
            return self._sections[attr]
        except KeyError:
            pass
        raise _unknown_section(attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        """Refuse: a section is not replaced; its keys are assigned."""
        if attr in _SECTIONS:
            raise ConfigError("Cannot replace config section %r; assign its keys instead, e.g. "
                              "config.%s.%s = ..." % (attr, attr, _names(attr)[0]))
        raise _unknown_section(attr)

    def __delattr__(self, attr: str) -> None:
        """Refuse: sections cannot be deleted."""
        raise ConfigError("Cannot delete config section %r." % attr)

    def __dir__(self) -> list[str]:
        """List methods and section names (for completion)."""
        return sorted(set(super().__dir__()) | set(_SECTIONS))

    def __eq__(self, other: object) -> bool:
        """Configs are equal when every key has an equal value."""
        if not isinstance(other, Config):
            return NotImplemented
        return self._values == other._values

    def _check_hashable(self) -> None:
        """Raise TypeError unless the Config is frozen (a mutable value has no stable hash)."""
        if not self._frozen:
            raise TypeError("unhashable Config: it can change until epl.init freezes it; "
                            "call config.freeze() first to use it as a dict key or set member")

    def __hash__(self) -> int:
        """Hash of all values, consistent with `__eq__`; only for a frozen Config."""
        self._check_hashable()
        return hash(_hashable(MappingProxyType(self._values)))

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any], bool]]:
        """Pickle by values, so unpickling does not read the environment again."""
        return _restore, (self.to_dict(), self._frozen)

    def __repr__(self) -> str:
        """Show the values that differ from the defaults, as a constructor call."""
        changed = self.non_default()
        return "Config(%r)" % changed if changed else "Config()"

    def __str__(self) -> str:
        """Show every value, one line per key, grouped by section."""
        lines = ["Config {"]
        for section, specs in _SECTIONS.items():
            lines.append("  %s:" % section)
            for spec in specs:
                lines.append("    %s = %r" % (spec.name, _thaw(self._values[spec.key])))
        lines.append("}")
        return "\n".join(lines)


def _unknown_section(attr: str) -> ConfigError:
    """The error for an attribute of a Config that names no section."""
    sections = list(_SECTIONS)
    return _UnknownAttributeError("Config has no section %r.%s Valid sections: %s."
                                  % (attr, _did_you_mean(_closest(attr, sections)),
                                     ", ".join(sections)))


def _restore(values: Mapping[str, Any], frozen: bool = False) -> Config:
    """Build a Config from already-validated values without reading the environment."""
    config = Config.__new__(Config)
    config._init_values({key: _freeze(value) for key, value in values.items()}, frozen)
    return config


def _restore_section(name: str, values: Mapping[str, Any], frozen: bool = False
                     ) -> ConfigSection:
    """A section holding validated plain ``values`` (for unpickling): a view of a Config
    with these values and the defaults elsewhere."""
    full = dict(_DEFAULTS)
    full.update({"%s.%s" % (name, key): value for key, value in values.items()})
    return getattr(_restore(full, frozen), name)


def _check_schema() -> dict[str, Any]:
    """Check the schema table at import time; return the stored defaults."""
    defaults = {}
    for spec in _SCHEMA:
        assert spec.type in _TYPES, spec
        assert spec.key.count(".") == 1, spec
        defaults[spec.key] = _check_value(spec, spec.default, "the default of %r" % spec.key)
    assert len(_ENV_VARS) == len(_SCHEMA), "two keys share an environment variable"
    return defaults


_DEFAULTS: dict[str, Any] = _check_schema()
