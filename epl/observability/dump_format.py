"""Writer and reader of the per-pass graph dump directory.

The pass manager's dump instrument calls `write_pass_dump` after every graph
pass (index 0, by convention pass name ``"input"``, is the graph before any
pass). A dump directory ``D`` then holds, for each pass:

- ``D/NNN_<pass>.pb``: the GraphDef, binary (``NNN`` is the zero-padded
  3-digit index; characters outside ``[A-Za-z0-9_.-]`` in the pass name are
  replaced by ``_`` in file names only). Constant values larger than
  `MAX_CONSTANT_BYTES` are left out: the tensor keeps its dtype and shape,
  loses its content, and the node gets the attribute ``_epl_dump_elided``
  (the number of bytes left out). A pass that left the graph byte for byte
  as the previous pass had it writes no graph file: its manifest entry names
  the previous pass's file and says ``"unchanged": true``.
- ``D/NNN_<pass>.json``: the pass summary given by the pass manager plus
  ``"index"``, ``"pass"``, ``"graph"`` (the graph file name) and
  ``"num_ops"``;

and one ``D/manifest.json`` = ``{"format": 2, "passes": [{"index", "pass",
"graph", "summary", "num_ops", "sha256", "unchanged"}, ...]}`` sorted by
index, where ``"graph"`` and ``"summary"`` are file names relative to ``D``.
Readers also accept the format-1 dumps of earlier versions (text
``.pbtxt`` graphs, entries without the last three keys).

With several workers each writes its own directory, ``D/rank_<r>``
(`rank_dump_dir`); `resolve_dump_dir` finds a rank's directory from ``D``.

Summary keys the pass manager provides (all optional here): ``duration_s``
(float), ``added`` and ``removed`` (lists of op names), ``op_map`` ({old op
name: [new op names]}), ``notes`` (lines the pass wrote about what it did)
and ``passes_before`` (list of pass names). Values that JSON cannot hold
(sets, tuples, numpy scalars) are converted; anything else is written as its
``str``.

Decisions:

- Writing index 0 starts a new dump: the entries (and their files) of an
  earlier run listed in the manifest are dropped, so a directory reused
  across runs never mixes two runs' passes.
- Rewriting an index replaces its entry (its files are removed unless
  another entry still names them).
- Files are written to a temporary name and renamed, so a reader never sees
  a half-written manifest. One writer per directory is assumed (each worker
  has its own directory).

`read_dump` reads the directory back; graphs are loaded only when a
`PassDump`'s ``graph_def`` is first used, and a file several passes share is
parsed once. Reading needs no TensorFlow: graphs are parsed into
TensorFlow's GraphDef class when TensorFlow is loaded (so they work with its
APIs, `tf.import_graph_def`), else into TensorBoard's copy of the same proto
(`tensorboard.compat.proto`, which ships without TensorFlow), so `epl-dump`
answers without importing TensorFlow. Writing takes either class
(`write_pass_dump`), or the serialized bytes (`write_serialized_pass`, what
`epl.observability.dump_writer` gives). `select_pass` resolves a pass by name or index. All reading
errors are `DumpError`, whose message names the file, the problem and what
to do.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Any, Callable

from google.protobuf import text_format
from google.protobuf.message import DecodeError

from epl.errors import EPLError
from epl.ir.annotations import DUMP_ELIDED_ATTR

MANIFEST_NAME = "manifest.json"
INPUT_PASS_NAME = "input"
FORMAT_VERSION = 2
GRAPH_SUFFIX = ".pb"
MAX_CONSTANT_BYTES = 1024
ELIDED_ATTR = DUMP_ELIDED_ATTR  # its name in this module's API (tests, epl-dump)
RANK_DIR_PREFIX = "rank_"
FRESH_DUMP_HINT = "write a fresh dump (run the script again with debug.dump_dir set)"


class DumpError(EPLError, ValueError):
    """A dump directory or graph file is missing, malformed or lacks a pass."""


class PassDump:
    """One pass of a dump: its index, pass name, graph and summary dict.

    `summary` is the content of the pass's JSON file (the pass manager's
    summary plus "index", "pass", "graph" and "num_ops"). `graph_def` is
    loaded from `graph_path` when first read (or given directly).
    `unchanged` is True when the pass left the previous pass's graph as it
    was (the two share one graph file).
    """

    def __init__(self, index: int, pass_name: str, graph_def: Any = None,
                 summary: dict[str, Any] | None = None, graph_path: str | None = None,
                 unchanged: bool = False, num_ops: int | None = None,
                 loader: Callable[[str], Any] | None = None) -> None:
        self.index = index
        self.pass_name = pass_name
        self.summary = summary if summary is not None else {}
        self.graph_path = graph_path
        self.unchanged = unchanged
        self._graph_def = graph_def
        self._num_ops = num_ops
        self._loader = loader or load_graph_def

    @property
    def graph_def(self) -> Any:
        """The pass's GraphDef (loaded from `graph_path` on first use)."""
        if self._graph_def is None:
            if self.graph_path is None:
                raise DumpError(f"pass {self.label} has no graph")
            self._graph_def = self._loader(self.graph_path)
        return self._graph_def

    @property
    def num_ops(self) -> int:
        """The number of ops, from the manifest or summary when known (no loading)."""
        if self._num_ops is None:
            counted = self.summary.get("num_ops")
            self._num_ops = counted if isinstance(counted, int) else len(self.graph_def.node)
        return self._num_ops

    @property
    def label(self) -> str:
        """Return ``"NNN_<pass>"``, the name used for this pass in reports."""
        return f"{self.index:03d}_{self.pass_name}"


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------


def rank_dump_dir(dump_dir: str, worker_rank: int, num_workers: int) -> str:
    """The directory a worker writes: `dump_dir` alone, ``dump_dir/rank_<r>`` with several."""
    if num_workers <= 1:
        return dump_dir
    return os.path.join(dump_dir, f"{RANK_DIR_PREFIX}{worker_rank}")


def pass_file_stem(index: int, pass_name: str) -> str:
    """Return the file stem ``NNN_<pass>`` for a pass index and name."""
    if index < 0:
        raise DumpError(f"pass index must be >= 0, got {index}")
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", pass_name) or "pass"
    return f"{index:03d}_{safe_name}"


def graph_def_class() -> type:
    """The GraphDef class graphs are read into: TensorFlow's when it is loaded, else
    TensorBoard's copy of the same proto (no TensorFlow needed)."""
    if "tensorflow" in sys.modules:
        from tensorflow.core.framework import graph_pb2
    else:
        from tensorboard.compat.proto import graph_pb2
    return graph_pb2.GraphDef


def elide_node_constants(node: Any, max_bytes: int = MAX_CONSTANT_BYTES) -> int:
    """Drop the content of every constant tensor of NodeDef `node` larger than
    `max_bytes`, in place (dtype and shape kept; attr `ELIDED_ATTR` = bytes dropped).
    Returns the bytes dropped. Works on TensorFlow's and TensorBoard's NodeDef."""
    if node.ByteSize() <= max_bytes:
        return 0
    dropped = 0
    large = [value.tensor for value in node.attr.values()
             if value.WhichOneof("value") == "tensor" and value.tensor.ByteSize() > max_bytes]
    for tensor in large:
        size = tensor.ByteSize()
        dtype, shape = tensor.dtype, type(tensor.tensor_shape)()
        shape.CopyFrom(tensor.tensor_shape)
        tensor.Clear()
        tensor.dtype = dtype
        tensor.tensor_shape.CopyFrom(shape)
        node.attr[ELIDED_ATTR].i += size
        dropped += size
    return dropped


def elide_large_constants(graph_def: Any, max_bytes: int = MAX_CONSTANT_BYTES) -> int:
    """Drop the content of every constant tensor larger than `max_bytes`, in place.

    Looks at the tensor-valued attrs of the graph's nodes and of its function
    library (`elide_node_constants`). Returns the total bytes dropped.
    """
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return sum(elide_node_constants(node, max_bytes) for node in nodes)


def write_pass_dump(dump_dir: str, index: int, pass_name: str,
                    graph_def: Any, summary: dict | None) -> str:
    """Write one pass's graph and summary into `dump_dir`; update the manifest.

    Consumes the dump directory (created if missing), the pass index and
    name, the GraphDef after the pass (its large constants are elided in
    place) and the pass manager's summary dict (any key may be missing;
    `None` means an empty summary). Produces ``NNN_<pass>.pb`` (unless the
    graph equals the previous pass's), ``NNN_<pass>.json`` and an updated
    ``manifest.json``; returns the path of the graph file the pass uses.
    """
    elide_large_constants(graph_def)
    return write_serialized_pass(dump_dir, index, pass_name,
                                 graph_def.SerializeToString(deterministic=True),
                                 len(graph_def.node), summary)


def write_serialized_pass(dump_dir: str, index: int, pass_name: str, data: bytes | None,
                          num_ops: int, summary: dict | None) -> str:
    """`write_pass_dump` given the serialized GraphDef `data` (large constants already
    elided) and its op count; data None says the graph is the previous pass's."""
    os.makedirs(dump_dir, exist_ok=True)
    stem = pass_file_stem(index, pass_name)
    entries = _read_manifest_entries_for_update(dump_dir)
    previous = max((e for e in entries if e.get("index", -1) < index),
                   key=lambda e: e["index"], default=None) if index > 0 else None
    kept = previous is not None and \
        os.path.isfile(os.path.join(dump_dir, str(previous.get("graph"))))
    if data is None and not kept:
        raise DumpError(f"pass {index} ({pass_name}) left the graph unchanged, but the "
                        f"previous pass's graph is not in {dump_dir!r}")
    digest = previous.get("sha256") if data is None else hashlib.sha256(data).hexdigest()
    unchanged = kept and previous.get("sha256") == digest
    graph_file = previous["graph"] if unchanged else stem + GRAPH_SUFFIX
    if not unchanged:
        _write_atomic(os.path.join(dump_dir, graph_file), data)
    summary_file = stem + ".json"
    record = _summary_record(summary, index, pass_name, graph_file, num_ops)
    _write_atomic(os.path.join(dump_dir, summary_file), _to_json(record).encode("utf-8"))
    entry = {"index": index, "pass": pass_name, "graph": graph_file, "summary": summary_file,
             "num_ops": num_ops, "sha256": digest, "unchanged": unchanged}
    _update_manifest(dump_dir, entries, entry)
    return os.path.join(dump_dir, graph_file)


def next_dump_index(dump_dir: str) -> int:
    """The index after the last entry of `dump_dir`'s manifest (0 without one): where a
    dump that continues an earlier one (the same graph's gradient-time passes) goes on."""
    return max((e["index"] for e in _read_manifest_entries_for_update(dump_dir)), default=-1) + 1


def _summary_record(summary: dict | None, index: int, pass_name: str,
                    graph_file: str, num_ops: int) -> dict:
    """Return the JSON record of a pass: the summary plus the fixed keys."""
    record = {str(key): value for key, value in (summary or {}).items()}
    record.update({"index": index, "pass": pass_name, "graph": graph_file,
                   "num_ops": num_ops})
    return record


def _update_manifest(dump_dir: str, entries: list[dict], entry: dict) -> None:
    """Insert or replace `entry` among `entries`, dropping stale runs at index 0."""
    if entry["index"] == 0:
        stale, kept = entries, []
    else:
        stale = [e for e in entries if e.get("index") == entry["index"]]
        kept = [e for e in entries if e.get("index") != entry["index"]]
    kept.append(entry)
    kept.sort(key=lambda e: e["index"])
    in_use = {e.get(key) for e in kept for key in ("graph", "summary")}
    _remove_entry_files(dump_dir, stale, keep=in_use)
    _write_atomic(os.path.join(dump_dir, MANIFEST_NAME),
                  _to_json({"format": FORMAT_VERSION, "passes": kept}).encode("utf-8"))


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
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("index"), int)]


def _remove_entry_files(dump_dir: str, entries: list[dict], keep: set) -> None:
    """Delete the files listed by `entries` (plain names only), except `keep`."""
    for entry in entries:
        for key in ("graph", "summary"):
            name = entry.get(key)
            if not isinstance(name, str) or name in keep or os.sep in name:
                continue
            path = os.path.join(dump_dir, name)
            if os.path.isfile(path):
                os.remove(path)


def _write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` through a temporary file and a rename."""
    tmp_path = f"{path}.tmp{os.getpid()}"
    with open(tmp_path, "wb") as handle:
        handle.write(data)
    os.replace(tmp_path, path)


def _to_json(value: Any) -> str:
    """Serialize `value` as indented JSON, converting non-JSON values."""
    return json.dumps(value, indent=1, sort_keys=False, default=_json_default) + "\n"


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


def load_graph_def(path: str) -> Any:
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


def _parse_text(data: bytes) -> Any:
    """Text format. Parse protobuf text bytes into a GraphDef."""
    graph_def = graph_def_class()()
    text_format.Parse(data.decode("utf-8"), graph_def)
    return graph_def


def _parse_binary(data: bytes) -> Any:
    """Binary format. Parse serialized protobuf bytes into a GraphDef."""
    graph_def = graph_def_class()()
    graph_def.ParseFromString(data)
    return graph_def


def rank_dirs(dump_dir: str) -> dict[int, str]:
    """The per-rank dump directories ``dump_dir/rank_<r>`` that hold a manifest."""
    found = {}
    if os.path.isdir(dump_dir):
        for name in os.listdir(dump_dir):
            rank = name[len(RANK_DIR_PREFIX):]
            path = os.path.join(dump_dir, name)
            if name.startswith(RANK_DIR_PREFIX) and rank.isdigit() and \
                    os.path.isfile(os.path.join(path, MANIFEST_NAME)):
                found[int(rank)] = path
    return dict(sorted(found.items()))


def resolve_dump_dir(dump_dir: str, rank: int | None = None) -> str:
    """The directory holding the manifest: `dump_dir`, or its ``rank_<r>`` (default rank 0).

    A multi-worker dump has one ``rank_<r>`` directory per worker. Raises
    `DumpError` when `rank` is given and there is no such rank.
    """
    ranks = rank_dirs(dump_dir)
    if rank is None:
        if ranks and not os.path.isfile(os.path.join(dump_dir, MANIFEST_NAME)):
            return ranks[min(ranks)]
        return dump_dir
    if rank not in ranks:
        have = ", ".join(str(r) for r in ranks) or "none (a single-worker dump: omit --rank)"
        raise DumpError(f"{dump_dir!r} has no dump of rank {rank}; ranks: {have}")
    return ranks[rank]


def read_manifest(dump_dir: str) -> list[dict]:
    """Return the manifest entries of `dump_dir`, sorted by index.

    Raises `DumpError` when the directory or its manifest is missing or
    malformed; the message names the file, what is wrong, and lists what the
    directory holds instead when there is no manifest.
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
    content = _read_json(path, "manifest")
    passes = content.get("passes") if isinstance(content, dict) else None
    if not isinstance(passes, list):
        raise DumpError(f"manifest {path!r} is corrupt: expected a JSON object with a list"
                        f" \"passes\", got {_shape_of(content)}; {FRESH_DUMP_HINT}")
    for position, entry in enumerate(passes):
        problem = _entry_problem(entry)
        if problem:
            raise DumpError(f"manifest {path!r} is corrupt: entry {position} ({_clip(entry)})"
                            f" {problem}; {FRESH_DUMP_HINT}")
    return sorted(passes, key=lambda e: e["index"])


def _entry_problem(entry: Any) -> str:
    """What is wrong with one manifest entry ('' when nothing is)."""
    if not isinstance(entry, dict):
        return "is not a JSON object"
    if not isinstance(entry.get("index"), int) or entry["index"] < 0:
        return "has no integer \"index\" >= 0"
    for key in ("pass", "graph"):
        if not isinstance(entry.get(key), str) or not entry[key]:
            return f"has no string \"{key}\""
    if entry.get("summary") is not None and not isinstance(entry["summary"], str):
        return "has a \"summary\" that is not a file name"
    return ""


def _read_json(path: str, what: str) -> Any:
    """Parse the JSON file `path` (a dump's manifest or summary) or raise DumpError."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except UnicodeDecodeError as err:
        raise DumpError(f"{what} {path!r} is corrupt: not UTF-8 text ({err.reason} at byte"
                        f" {err.start}); {FRESH_DUMP_HINT}") from err
    except json.JSONDecodeError as err:
        raise DumpError(f"{what} {path!r} is corrupt: not valid JSON ({err.msg} at line"
                        f" {err.lineno} column {err.colno}); {FRESH_DUMP_HINT}") from err
    except OSError as err:
        raise DumpError(f"cannot read {what} {path!r}: {err.strerror}") from err


def _shape_of(value: Any) -> str:
    """A short description of a JSON value's type ("a list", "null", ...)."""
    names = {dict: "an object", list: "a list", str: "a string", int: "a number",
             float: "a number", bool: "true/false", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _clip(value: Any, width: int = 80) -> str:
    """The JSON text of `value`, cut to `width` characters."""
    text = json.dumps(value, default=str)
    return text if len(text) <= width else text[:width - 3] + "..."


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


def read_summary(dump_dir: str, entry: dict) -> dict[str, Any]:
    """The summary dict of one manifest entry ({} when the entry names none)."""
    name = entry.get("summary")
    if not name:
        return {}
    path = os.path.join(dump_dir, name)
    if not os.path.isfile(path):
        raise DumpError(f"summary file {path!r} named by the manifest does not exist;"
                        f" {FRESH_DUMP_HINT}")
    summary = _read_json(path, "summary")
    if not isinstance(summary, dict):
        raise DumpError(f"summary {path!r} is corrupt: expected a JSON object, got"
                        f" {_shape_of(summary)}; {FRESH_DUMP_HINT}")
    return summary


def read_dump(dump_dir: str) -> list[PassDump]:
    """Read every pass of a dump directory, sorted by index.

    Consumes a directory written by `write_pass_dump` (with a multi-worker
    dump, rank 0's; see `resolve_dump_dir`); produces one `PassDump` per
    manifest entry, with its summary read and its graph loaded on first use
    (one parse per graph file). Raises `DumpError` for a missing directory,
    a missing or corrupt manifest or summary.
    """
    dump_dir = resolve_dump_dir(dump_dir)
    cache: dict[str, Any] = {}

    def load(path: str) -> Any:
        if path not in cache:
            cache[path] = load_graph_def(path)
        return cache[path]

    dumps = []
    for entry in read_manifest(dump_dir):
        num_ops = entry.get("num_ops")
        dumps.append(PassDump(
            index=entry["index"], pass_name=entry["pass"], summary=read_summary(dump_dir, entry),
            graph_path=os.path.join(dump_dir, entry["graph"]),
            unchanged=bool(entry.get("unchanged")),
            num_ops=num_ops if isinstance(num_ops, int) else None, loader=load))
    return dumps


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
