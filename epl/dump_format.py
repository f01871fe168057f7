"""Writer and reader of the per-pass graph dump directory.

The pass manager's dump instrument calls `write_pass_dump` after every graph
pass (index 0, by convention pass name ``"input"``, is the graph before any
pass). A dump directory ``D`` then holds, for each pass:

- ``D/NNN_<pass>.pbtxt``: the GraphDef in protobuf text format (``NNN`` is
  the zero-padded 3-digit index; characters outside ``[A-Za-z0-9_.-]`` in
  the pass name are replaced by ``_`` in file names only);
- ``D/NNN_<pass>.json``: the pass summary given by the pass manager plus
  ``"index"``, ``"pass"``, ``"graph"`` (the pbtxt file name) and
  ``"num_ops"``;

and one ``D/manifest.json`` = ``{"passes": [{"index", "pass", "graph",
"summary"}, ...]}`` sorted by index, where ``"graph"`` and ``"summary"``
are file names relative to ``D``.

Summary keys the pass manager provides (all optional here): ``duration_s``
(float), ``added`` and ``removed`` (lists of op names), ``op_map`` ({old op
name: [new op names]}) and ``passes_before`` (list of pass names). Values
that JSON cannot hold (sets, tuples, numpy scalars) are converted; anything
else is written as its ``str``.

Decisions:

- Writing index 0 starts a new dump: the entries (and their files) of an
  earlier run listed in the manifest are dropped, so a directory reused
  across runs never mixes two runs' passes.
- Rewriting an index replaces its entry (and removes its old files when the
  pass name changed).
- Files are written to a temporary name and renamed, so a reader never sees
  a half-written manifest. One writer per directory is assumed (give each
  worker its own directory).

`read_dump` and `load_graph_def` read the directory back; `select_pass`
resolves a pass by name or index. All reading errors are `DumpError`, whose
message names the problem and what exists instead.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

from google.protobuf import text_format
from google.protobuf.message import DecodeError
from tensorflow.core.framework import graph_pb2

from epl.errors import EPLError

MANIFEST_NAME = "manifest.json"
INPUT_PASS_NAME = "input"


class DumpError(EPLError, ValueError):
    """A dump directory or graph file is missing, malformed or lacks a pass."""


@dataclasses.dataclass
class PassDump:
    """One pass of a dump: its index, pass name, graph and summary dict.

    `summary` is the content of the pass's JSON file (the pass manager's
    summary plus "index", "pass", "graph" and "num_ops").
    """

    index: int
    pass_name: str
    graph_def: graph_pb2.GraphDef
    summary: dict[str, Any]

    @property
    def label(self) -> str:
        """Return ``"NNN_<pass>"``, the name used for this pass in reports."""
        return f"{self.index:03d}_{self.pass_name}"


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def pass_file_stem(index: int, pass_name: str) -> str:
    """Return the file stem ``NNN_<pass>`` for a pass index and name."""
    if index < 0:
        raise DumpError(f"pass index must be >= 0, got {index}")
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", pass_name) or "pass"
    return f"{index:03d}_{safe_name}"


def write_pass_dump(dump_dir: str, index: int, pass_name: str,
                    graph_def: graph_pb2.GraphDef, summary: dict | None) -> str:
    """Write one pass's graph and summary into `dump_dir`; update the manifest.

    Consumes the dump directory (created if missing), the pass index and
    name, the GraphDef after the pass and the pass manager's summary dict
    (any of its keys may be missing; `None` means an empty summary).
    Produces ``NNN_<pass>.pbtxt``, ``NNN_<pass>.json`` and an updated
    ``manifest.json``; returns the path of the pbtxt file.
    """
    os.makedirs(dump_dir, exist_ok=True)
    stem = pass_file_stem(index, pass_name)
    graph_file, summary_file = stem + ".pbtxt", stem + ".json"
    _write_atomic(os.path.join(dump_dir, graph_file),
                  text_format.MessageToString(graph_def))
    record = _summary_record(summary, index, pass_name, graph_file, graph_def)
    _write_atomic(os.path.join(dump_dir, summary_file), _to_json(record))
    entry = {"index": index, "pass": pass_name, "graph": graph_file,
             "summary": summary_file}
    _update_manifest(dump_dir, entry)
    return os.path.join(dump_dir, graph_file)


def _summary_record(summary: dict | None, index: int, pass_name: str,
                    graph_file: str, graph_def: graph_pb2.GraphDef) -> dict:
    """Return the JSON record of a pass: the summary plus the fixed keys."""
    record = {str(key): value for key, value in (summary or {}).items()}
    record.update({"index": index, "pass": pass_name, "graph": graph_file,
                   "num_ops": len(graph_def.node)})
    return record


def _update_manifest(dump_dir: str, entry: dict) -> None:
    """Insert or replace `entry` in the manifest, dropping stale runs at 0."""
    entries = _read_manifest_entries_for_update(dump_dir)
    if entry["index"] == 0:
        stale, kept = entries, []
    else:
        stale = [e for e in entries if e.get("index") == entry["index"]]
        kept = [e for e in entries if e.get("index") != entry["index"]]
    _remove_entry_files(dump_dir, stale, keep={entry["graph"], entry["summary"]})
    kept.append(entry)
    kept.sort(key=lambda e: e["index"])
    _write_atomic(os.path.join(dump_dir, MANIFEST_NAME),
                  _to_json({"passes": kept}))


def _read_manifest_entries_for_update(dump_dir: str) -> list[dict]:
    """Return the current manifest entries, or [] if there is no usable one."""
    path = os.path.join(dump_dir, MANIFEST_NAME)
    if not os.path.exists(path):
        return []
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle).get("passes", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [e for e in entries if isinstance(e, dict) and "index" in e]


def _remove_entry_files(dump_dir: str, entries: list[dict], keep: set[str]) -> None:
    """Delete the files listed by `entries` (plain names only), except `keep`."""
    for entry in entries:
        for key in ("graph", "summary"):
            name = entry.get(key)
            if not isinstance(name, str) or name in keep or os.sep in name:
                continue
            path = os.path.join(dump_dir, name)
            if os.path.isfile(path):
                os.remove(path)


def _write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename."""
    tmp_path = f"{path}.tmp{os.getpid()}"
    with open(tmp_path, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp_path, path)


def _to_json(value: Any) -> str:
    """Serialize `value` as indented JSON, converting non-JSON values."""
    return json.dumps(value, indent=2, sort_keys=False, default=_json_default) + "\n"


def _json_default(value: Any) -> Any:
    """Convert values `json` cannot encode: sets, tuples, numpy scalars, bytes."""
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if hasattr(value, "item") and callable(value.item):
        try:
            return value.item()
        except (TypeError, ValueError):
            pass
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    return str(value)


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


def load_graph_def(path: str) -> graph_pb2.GraphDef:
    """Load a GraphDef from a text (``.pbtxt``/``.txt``) or binary (``.pb``) file.

    Files with another suffix are tried as binary, then as text. Raises
    `DumpError` naming the path when the file is missing or unparsable.
    """
    if not os.path.isfile(path):
        raise DumpError(f"graph file {path!r} does not exist")
    with open(path, "rb") as handle:
        data = handle.read()
    suffix = os.path.splitext(path)[1].lower()
    parsers = {".pbtxt": [_parse_text], ".txt": [_parse_text],
               ".pb": [_parse_binary]}.get(suffix, [_parse_binary, _parse_text])
    errors = []
    for parser in parsers:
        try:
            return parser(data)
        except (DecodeError, text_format.ParseError, UnicodeDecodeError) as err:
            errors.append(f"{parser.__doc__.split('.')[0]}: {err}")
    raise DumpError(f"cannot parse {path!r} as a GraphDef ({'; '.join(errors)})")


def _parse_text(data: bytes) -> graph_pb2.GraphDef:
    """Text format. Parse protobuf text bytes into a GraphDef."""
    graph_def = graph_pb2.GraphDef()
    text_format.Parse(data.decode("utf-8"), graph_def)
    return graph_def


def _parse_binary(data: bytes) -> graph_pb2.GraphDef:
    """Binary format. Parse serialized protobuf bytes into a GraphDef."""
    graph_def = graph_pb2.GraphDef()
    graph_def.ParseFromString(data)
    return graph_def


def read_manifest(dump_dir: str) -> list[dict]:
    """Return the manifest entries of `dump_dir`, sorted by index.

    Raises `DumpError` when the directory or its manifest is missing or
    malformed; the message lists what the directory holds instead.
    """
    if not os.path.isdir(dump_dir):
        parent = os.path.dirname(os.path.abspath(dump_dir))
        raise DumpError(f"dump directory {dump_dir!r} does not exist"
                        f" (parent {parent!r} {_describe_listing(parent)})")
    path = os.path.join(dump_dir, MANIFEST_NAME)
    if not os.path.isfile(path):
        raise DumpError(f"{dump_dir!r} has no {MANIFEST_NAME}, so it is not an"
                        f" EPL dump directory (it {_describe_listing(dump_dir)});"
                        " set debug.dump_dir or EPL_DEBUG_DUMP_DIR to write one")
    try:
        with open(path, encoding="utf-8") as handle:
            entries = json.load(handle)["passes"]
        return sorted(entries, key=lambda e: int(e["index"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DumpError(f"{path!r} is malformed ({err!r}); expected"
                        ' {"passes": [{"index", "pass", "graph", "summary"}]}') from err


def _describe_listing(directory: str, limit: int = 10) -> str:
    """Return a short phrase listing the first entries of `directory`."""
    if not os.path.isdir(directory):
        return "does not exist either"
    names = sorted(os.listdir(directory))
    if not names:
        return "is empty"
    shown = ", ".join(names[:limit])
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return f"contains: {shown}{more}"


def read_dump(dump_dir: str) -> list[PassDump]:
    """Read every pass of a dump directory, sorted by index.

    Consumes a directory written by `write_pass_dump`; produces one
    `PassDump` per manifest entry. Raises `DumpError` for a missing
    directory, manifest or referenced file.
    """
    return [_read_entry(dump_dir, entry) for entry in read_manifest(dump_dir)]


def _read_entry(dump_dir: str, entry: dict) -> PassDump:
    """Load the graph and summary files named by one manifest entry."""
    graph_def = load_graph_def(os.path.join(dump_dir, entry["graph"]))
    summary: dict[str, Any] = {}
    summary_name = entry.get("summary")
    if summary_name:
        summary_path = os.path.join(dump_dir, summary_name)
        if not os.path.isfile(summary_path):
            raise DumpError(f"summary file {summary_path!r} named by the"
                            " manifest does not exist")
        with open(summary_path, encoding="utf-8") as handle:
            summary = json.load(handle)
    return PassDump(index=int(entry["index"]), pass_name=str(entry["pass"]),
                    graph_def=graph_def, summary=summary)


def select_pass(dumps: list[PassDump], key: str | int) -> PassDump:
    """Return the pass whose index or name is `key` (an index wins if numeric).

    Raises `DumpError` listing the available passes when none matches.
    """
    text = str(key).strip()
    for dump in dumps:
        if text.isdigit() and dump.index == int(text):
            return dump
    for dump in dumps:
        if text in (dump.pass_name, dump.label):
            return dump
    available = ", ".join(f"{d.index} ({d.pass_name})" for d in dumps) or "none"
    raise DumpError(f"no pass {text!r} in the dump; available passes: {available}")
