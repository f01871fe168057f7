"""EPL configuration: the `Config` class, checked against the schema of every key.

A `Config` holds one typed value for every key of the schema (`epl.config_schema`).
Keys are dotted strings, ``"<section>.<key>"``, as in EasyParallelLibrary (EPL)::

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

The schema table itself (`KeySpec`, `schema`, `format_schema`, `env_var_name`)
is `epl.config_schema`'s, re-exported here; this module checks values against
it, looks keys up, and holds them (`Config`, `ConfigSection`).
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from epl.config_schema import (ENV_PREFIX, ENV_VARS, SCHEMA, SECTIONS, SPECS, KeySpec,  # noqa: F401
                               env_var_name, format_schema, freeze_value, hashable_value,
                               schema, thaw_value)
from epl.errors import ConfigError

# KeySpec, schema, format_schema, env_var_name and ENV_PREFIX live in
# epl.config_schema and are public here too (epl.config's documented API).
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

_TYPES = ("bool", "int", "float", "str", "dict", "list")
_ENV_TRUE = ("true", "1")
_ENV_FALSE = ("false", "0")


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------

def _invalid(spec: KeySpec, value: Any, source: str, note: str = "",
             show_type: bool = True) -> ConfigError:
    """Build the error for a bad value: where it came from, the value, what is valid.

    The value's type is shown unless ``show_type`` is False or the value is a
    string given to a key that takes strings.
    """
    shown = repr(thaw_value(value))
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
        return freeze_value(value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _invalid(spec, value, source)
    return freeze_value(value)


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
    if key in SPECS:
        return SPECS[key]
    section, dot, name = key.partition(".")
    sections = list(SECTIONS)
    if section not in SECTIONS:
        if dot:
            suggestion = _closest(key, list(SPECS)) or _closest(section, sections)
        else:
            # A bare key name ("num_micro_batch"): look for it in every section.
            by_name = {spec.name: spec.key for spec in SCHEMA}
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
    return [spec.name for spec in SECTIONS[section]]


def _warn_unknown_env(environ: Mapping[str, str]) -> None:
    """Log a warning for EPL_<SECTION>_* variables that match no key (likely typos)."""
    for var in environ:
        if var in ENV_VARS or not var.startswith(ENV_PREFIX):
            continue
        for section in SECTIONS:
            if var.startswith(env_var_name(section) + "_"):
                hint = _did_you_mean(_closest(var, list(ENV_VARS)))
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
        "use the new values." % (key, thaw_value(value)))


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
        return {spec.name: values[spec.key] for spec in SECTIONS[self._name]}

    def to_dict(self) -> dict[str, Any]:
        """Return ``{key name: value}`` for this section, as plain dicts and lists."""
        return {name: thaw_value(value) for name, value in self._items().items()}

    def __eq__(self, other: object) -> bool:
        """Sections are equal when their names and all values are equal."""
        if not isinstance(other, ConfigSection):
            return NotImplemented
        return self._name == other._name and self._items() == other._items()

    def __hash__(self) -> int:
        """Hash of the name and all values; only for a section of a frozen Config."""
        self._config._check_hashable()
        return hash((self._name, hashable_value(MappingProxyType(self._items()))))

    def __reduce__(self) -> tuple[Any, tuple[str, dict[str, Any], bool]]:
        """Pickle by name and plain values (a section of a Config holding them)."""
        return _restore_section, (self._name, self.to_dict(), self._config.frozen)

    def __repr__(self) -> str:
        """Show the section's name and every value."""
        items = ", ".join("%s=%r" % (name, thaw_value(value)) for name, value in self._items().items())
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
        for spec in SCHEMA:
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
                             thaw_value(values[spec.key]), spec.env_var, environ[spec.env_var])
        _warn_unknown_env(environ)
        self._init_values(values)

    def _init_values(self, values: Mapping[str, Any], frozen: bool = False) -> None:
        """Store validated values and build the section views."""
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_sections",
                           {section: ConfigSection(self, section) for section in SECTIONS})
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
        return tuple(spec.key for spec in SCHEMA)

    @classmethod
    def sections(cls) -> tuple[str, ...]:
        """Return the section names of the schema."""
        return tuple(SECTIONS)

    @classmethod
    def schema(cls) -> tuple[KeySpec, ...]:
        """Return the schema: one `KeySpec` per key (same as `epl.config.schema`)."""
        return SCHEMA

    def get(self, key: str) -> Any:
        """Return the value of dotted ``key``; an unknown key raises ConfigError."""
        return self._values[_lookup(key).key]

    def to_dict(self) -> dict[str, Any]:
        """Return ``{"section.key": value}`` for every key, as plain dicts and lists.

        ``Config(config.to_dict(), environ={}) == config`` holds.
        """
        return {spec.key: thaw_value(self._values[spec.key]) for spec in SCHEMA}

    def non_default(self) -> dict[str, Any]:
        """Return ``{"section.key": value}`` for the keys whose value is not the default."""
        return {spec.key: thaw_value(self._values[spec.key]) for spec in SCHEMA
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
        if attr in SECTIONS:
            raise ConfigError("Cannot replace config section %r; assign its keys instead, e.g. "
                              "config.%s.%s = ..." % (attr, attr, _names(attr)[0]))
        raise _unknown_section(attr)

    def __delattr__(self, attr: str) -> None:
        """Refuse: sections cannot be deleted."""
        raise ConfigError("Cannot delete config section %r." % attr)

    def __dir__(self) -> list[str]:
        """List methods and section names (for completion)."""
        return sorted(set(super().__dir__()) | set(SECTIONS))

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
        return hash(hashable_value(MappingProxyType(self._values)))

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
        for section, specs in SECTIONS.items():
            lines.append("  %s:" % section)
            for spec in specs:
                lines.append("    %s = %r" % (spec.name, thaw_value(self._values[spec.key])))
        lines.append("}")
        return "\n".join(lines)


def _unknown_section(attr: str) -> ConfigError:
    """The error for an attribute of a Config that names no section."""
    sections = list(SECTIONS)
    return _UnknownAttributeError("Config has no section %r.%s Valid sections: %s."
                                  % (attr, _did_you_mean(_closest(attr, sections)),
                                     ", ".join(sections)))


def _restore(values: Mapping[str, Any], frozen: bool = False) -> Config:
    """Build a Config from already-validated values without reading the environment."""
    config = Config.__new__(Config)
    config._init_values({key: freeze_value(value) for key, value in values.items()}, frozen)
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
    for spec in SCHEMA:
        assert spec.type in _TYPES, spec
        assert spec.key.count(".") == 1, spec
        defaults[spec.key] = _check_value(spec, spec.default, "the default of %r" % spec.key)
    assert len(ENV_VARS) == len(SCHEMA), "two keys share an environment variable"
    return defaults


_DEFAULTS: dict[str, Any] = _check_schema()
