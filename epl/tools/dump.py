"""`epl-dump`: inspect the graph dumps EPL writes after every pass.

The pass manager writes a dump directory when ``debug.dump_dir`` (or
``EPL_DEBUG_DUMP_DIR``) is set; `epl.observability.dump_format` describes its layout.
This tool reads only those dumps (or plain GraphDef files)::

    epl-dump DIR [--json] [--pass P ...] [--limit N] [--rank R]
        For each pass in order: index, name, duration, op count; op counts
        by device, TaskGraph and phase (and replica / micro-batch when there
        is more than one); ops added and removed (first N names and a count
        of the rest); the pass's notes; every collective (kind, name,
        device, group, dtype, shape, bytes). A pass that left the graph as
        it was is one line ("unchanged") plus its notes. With --pass only
        those passes' graphs are loaded. ``epl-dump show DIR`` is the same.
    epl-dump diff A B [--dir DIR] [--json] [--limit N]
        A and B are GraphDef files (.pbtxt or .pb), or, with --dir, pass
        names or indices of the dump. Prints ops added, removed and changed
        (type, device, the inputs that changed, attrs, output shapes), the
        change in collectives, and counts by device/TaskGraph/phase
        before -> after.
    epl-dump dot GRAPH [--dir DIR] [-o OUT] [--max-ops N]
        A Graphviz DOT file: one cluster per device, nodes coloured by
        phase and labelled "name\\ntype", collectives drawn as red double
        octagons, control edges dashed. GRAPH is a file, a pass with --dir,
        or a dump directory (its last pass). Without -o, DOT goes to stdout.
    epl-dump tensorboard [GRAPH] [--dir DIR] --logdir L
        Writes a TensorBoard event file holding the graph. With a dump
        directory and no pass, every pass goes to its own run L/NNN_<pass>.

A multi-worker dump has one directory per worker (DIR/rank_<r>); every
command takes DIR and reads rank 0's unless --rank R is given.

Constants larger than 1 KiB are left out of dumped graphs (dtype and shape
kept, attr ``_epl_dump_elided`` = bytes left out), so a dumped graph shows
the structure but does not run.

EPL's node attributes are read from the NodeDefs, never inferred from op
names: ``_epl_taskgraph`` (ops without it count as "(none)"),
``_epl_phase`` (absent: "(none)"), ``_epl_replica`` and
``_epl_micro_batch`` (absent: 0).

A collective's shape and bytes describe its payload: the shape of input 0
(read from the producer's ``_output_shapes``), else the op's ``shape``
attr, else the op's own first output shape; bytes are the product of the
dims times the dtype size when the shape is fully static (summed over the
inputs for grouped Horovod ops and NcclReduce). Errors (a missing
directory, no manifest, a corrupt manifest or summary, an unknown pass)
print a message naming the problem and what exists, and exit with code 2.

This module holds the commands, their text and the command line; reading a
GraphDef (EPL's node attributes, op counts, collectives) is
`epl.tools.dump_graph`'s.
"""
from __future__ import annotations

import argparse
import collections
import glob
import itertools
import json
import os
import socket
import sys
import time
from typing import Any, Iterable, Sequence

from google.protobuf import text_format
from tensorboard.compat.proto import attr_value_pb2, event_pb2, graph_pb2, node_def_pb2

from epl.observability.dump_format import (DumpError, PassDump, load_graph_def, rank_dirs, read_dump,
                             resolve_dump_dir, select_pass)
from epl.ir.collectives import COLLECTIVE_OPS, is_reduction_node
from epl.tools.dump_graph import (Collective, Shape, device_of, find_collectives, natural_key,
                                  op_counts, ordered_counts, output_shape, phase_of, split_input,
                                  taskgraph_of)

DEFAULT_LIMIT = 20
DEFAULT_MAX_DOT_OPS = 1000
COMMANDS = ("show", "diff", "dot", "tensorboard")
_EVENT_FILES = itertools.count()   # event files this process wrote (unique names)
#: Attributes `diff` does not compare: shapes (compared apart) and TensorFlow's
#: bookkeeping of manual control dependencies (epl.observability.dump_writer).
IGNORED_ATTRS = frozenset({"_output_shapes", "_has_manual_control_dependencies"})


# --------------------------------------------------------------------------
# Formatting helpers
# --------------------------------------------------------------------------


def format_shape(shape: Shape | None) -> str:
    """Return "[4, ?]" for a shape, "?" for an unknown rank."""
    if shape is None:
        return "?"
    return "[" + ", ".join("?" if dim is None else str(dim) for dim in shape) + "]"


def format_bytes(num_bytes: int | None) -> str:
    """Return a byte count as "123 B" / "1.5 KiB" / ..., or "?" when unknown."""
    if num_bytes is None:
        return "?"
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value = float(num_bytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}"
    return f"{num_bytes} B"


def format_duration(seconds: Any) -> str:
    """Return a duration in seconds as "12.3 ms" / "1.20 s", or "-" if unknown."""
    if not isinstance(seconds, (int, float)):
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_counts(counts: dict[str, int]) -> str:
    """Return "a 3, b 1" for an ordered count dict."""
    return ", ".join(f"{key} {value}" for key, value in counts.items()) or "-"


def name_sample(names: Sequence[str], limit: int) -> dict[str, Any]:
    """Return {"count", "names" (first `limit`; all if limit <= 0), "more"}."""
    shown = list(names) if limit <= 0 else list(names[:limit])
    return {"count": len(names), "names": shown, "more": len(names) - len(shown)}


def format_name_sample(label: str, sample: dict[str, Any]) -> str:
    """Return "added 3: a, b, c (+N more)" for a `name_sample` dict."""
    line = f"{label} {sample['count']}"
    if sample["names"]:
        line += ": " + ", ".join(sample["names"])
    if sample["more"]:
        line += f" (+{sample['more']} more)"
    return line


def format_table(rows: list[list[str]], indent: str = "    ") -> list[str]:
    """Return rows as lines with columns padded to a common width."""
    if not rows:
        return []
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(cell.ljust(width) for cell, width in
                               zip(row, widths)).rstrip() for row in rows]


def collective_rows(collectives: Iterable[Collective]) -> list[list[str]]:
    """Return table rows (kind, name, device, group, dtype, shape, bytes)."""
    rows = []
    for coll in collectives:
        shape = format_shape(coll.shape)
        if coll.num_tensors > 1:
            shape += f" (+{coll.num_tensors - 1} tensors)"
        rows.append([coll.kind, coll.name, coll.device, coll.group,
                     coll.dtype or "?", shape, format_bytes(coll.bytes)])
    return rows


# --------------------------------------------------------------------------
# show: the per-pass report
# --------------------------------------------------------------------------


def _names_in_order(graph_def: graph_pb2.GraphDef, names: set[str]) -> list[str]:
    """Return those of `names` that are ops of `graph_def`, in graph order."""
    return [node.name for node in graph_def.node if node.name in names]


def added_removed(dump: PassDump, previous: PassDump | None) -> tuple[list, list, str]:
    """Return (added, removed, source) op names of a pass.

    Uses the summary's "added"/"removed" lists when present ("summary"),
    else compares op names with the previous pass ("computed").
    """
    added, removed = dump.summary.get("added"), dump.summary.get("removed")
    if isinstance(added, list) and isinstance(removed, list):
        return [str(n) for n in added], [str(n) for n in removed], "summary"
    if previous is None:
        return [], [], "computed"
    before = {node.name for node in previous.graph_def.node}
    after = {node.name for node in dump.graph_def.node}
    return (_names_in_order(dump.graph_def, after - before),
            _names_in_order(previous.graph_def, before - after), "computed")


def _notes(dump: PassDump) -> list[str]:
    """The pass's notes from its summary (each a string; [] when there are none)."""
    notes = dump.summary.get("notes")
    return [str(note) for note in notes] if isinstance(notes, list) else []


def pass_report(dump: PassDump, previous: PassDump | None,
                limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """Return the JSON-ready report of one pass (what `epl-dump DIR` prints).

    A pass that left the graph unchanged (`PassDump.unchanged`) gets a short
    report (no counts; its graph is not loaded): "unchanged" and "same_as",
    the label of the pass whose graph it shares.
    """
    base = {"index": dump.index, "pass": dump.pass_name,
            "duration_s": dump.summary.get("duration_s"),
            "passes_before": dump.summary.get("passes_before"),
            "notes": _notes(dump)}
    if dump.unchanged:
        return {**base, "unchanged": True, "num_ops": dump.num_ops,
                "same_as": previous.label if previous is not None else None}
    added, removed, source = added_removed(dump, previous)
    counts = op_counts(dump.graph_def)
    return {
        **base, "unchanged": False,
        "num_ops": len(dump.graph_def.node),
        "by_device": counts["device"], "by_taskgraph": counts["taskgraph"],
        "by_phase": counts["phase"], "by_replica": counts["replica"],
        "by_micro_batch": counts["micro_batch"],
        "added": name_sample(added, limit), "removed": name_sample(removed, limit),
        "added_removed_source": source,
        "collectives": [c.to_json() for c in find_collectives(dump.graph_def)],
    }


def _format_notes(notes: list[str]) -> list[str]:
    """Lines "  note: ..." (continuation lines of a multi-line note indented)."""
    lines = []
    for note in notes:
        first, *rest = note.splitlines() or [""]
        lines.append(f"  note: {first}")
        lines.extend(f"        {line}" for line in rest)
    return lines


def format_pass_report(report: dict[str, Any]) -> list[str]:
    """Return the text lines of one pass report."""
    head = (f"[{report['index']:03d}] {report['pass']}  duration "
            f"{format_duration(report['duration_s'])}  ops {report['num_ops']}")
    if report.get("unchanged"):
        same = f" (same graph as {report['same_as']})" if report.get("same_as") else ""
        return [f"{head}  unchanged{same}"] + _format_notes(report.get("notes", []))
    lines = [head,
             f"  by device:    {format_counts(report['by_device'])}",
             f"  by taskgraph: {format_counts(report['by_taskgraph'])}",
             f"  by phase:     {format_counts(report['by_phase'])}"]
    for key, label in (("by_replica", "by replica:  "), ("by_micro_batch", "by micro-batch:")):
        if len(report[key]) > 1:
            lines.append(f"  {label} {format_counts(report[key])}")
    lines.append("  " + format_name_sample("added", report["added"]))
    lines.append("  " + format_name_sample("removed", report["removed"]))
    lines.extend(_format_notes(report.get("notes", [])))
    collectives = [Collective(**c) for c in report["collectives"]]
    lines.append(f"  collectives {len(collectives)}" + (":" if collectives else ""))
    lines.extend(format_table(collective_rows(collectives)))
    return lines


def run_show(args: argparse.Namespace) -> int:
    """Print the report of every pass (or of the passes named by --pass).

    Only the graphs of the passes reported are loaded (and the previous
    pass's when a summary lacks its added/removed lists).
    """
    dump_dir = resolve_dump_dir(args.dump_dir, args.rank)
    dumps = read_dump(dump_dir)
    selected = {select_pass(dumps, key).index for key in args.passes or []}
    reports = [pass_report(dump, dumps[i - 1] if i else None, args.limit)
               for i, dump in enumerate(dumps)
               if not selected or dump.index in selected]
    if args.json:
        print(json.dumps({"dump_dir": dump_dir, "passes": reports}, indent=2))
        return 0
    ranks = rank_dirs(args.dump_dir)
    note = f"; ranks {', '.join(map(str, ranks))}, --rank R for another" \
        if ranks and args.rank is None else ""
    print(f"EPL dump {dump_dir} ({len(dumps)} passes{note})")
    for report in reports:
        print("\n".join(format_pass_report(report)))
    return 0


# --------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------


def _short_attr(value: attr_value_pb2.AttrValue | None, width: int = 60) -> str:
    """Return a one-line, truncated text form of an AttrValue ("absent" if None)."""
    if value is None:
        return "absent"
    text = text_format.MessageToString(value, as_one_line=True)
    return text if len(text) <= width else text[:width - 3] + "..."


def input_changes(before: list[str], after: list[str]) -> list[str]:
    """The inputs that differ: "input 1: a -> b" per data input, "control +^x -^y".

    Data inputs are compared by position ("(none)" where one side has fewer);
    control inputs as sets.
    """
    data_a = [name for name in before if not name.startswith("^")]
    data_b = [name for name in after if not name.startswith("^")]
    changes = [f"input {i}: {data_a[i] if i < len(data_a) else '(none)'} -> "
               f"{data_b[i] if i < len(data_b) else '(none)'}"
               for i in range(max(len(data_a), len(data_b)))
               if i >= len(data_a) or i >= len(data_b) or data_a[i] != data_b[i]]
    control_a = {name for name in before if name.startswith("^")}
    control_b = {name for name in after if name.startswith("^")}
    moved = [f"+{name}" for name in after if name in control_b - control_a] + \
        [f"-{name}" for name in before if name in control_a - control_b]
    if moved:
        changes.append("control " + " ".join(moved))
    return changes


def node_changes(before: node_def_pb2.NodeDef, after: node_def_pb2.NodeDef) -> list[str]:
    """Return human-readable differences between two versions of one op."""
    changes = []
    if before.op != after.op:
        changes.append(f"type {before.op} -> {after.op}")
    if before.device != after.device:
        changes.append(f"device {device_of(before)} -> {device_of(after)}")
    if list(before.input) != list(after.input):
        changes.extend(input_changes(list(before.input), list(after.input)))
    keys = sorted((set(before.attr) | set(after.attr)) - IGNORED_ATTRS)
    for key in keys:
        old = before.attr[key] if key in before.attr else None
        new = after.attr[key] if key in after.attr else None
        if old != new:
            changes.append(f"attr {key}: {_short_attr(old)} -> {_short_attr(new)}")
    if output_shape(before, 0) != output_shape(after, 0) and \
            "_output_shapes" in before.attr and "_output_shapes" in after.attr:
        changes.append(f"shape {format_shape(output_shape(before, 0))} -> "
                       f"{format_shape(output_shape(after, 0))}")
    return changes


def _count_changes(before: dict[str, int], after: dict[str, int]) -> dict[str, list[int]]:
    """Return {key: [before, after]} over the union of keys, in order."""
    keys = list(before) + [key for key in after if key not in before]
    return {key: [before.get(key, 0), after.get(key, 0)] for key in keys}


def graph_diff(before: graph_pb2.GraphDef, after: graph_pb2.GraphDef,
               limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
    """Return the JSON-ready difference between two graphs (see module doc)."""
    old = {node.name: node for node in before.node}
    new = {node.name: node for node in after.node}
    changed = {}
    for node in after.node:
        if node.name in old:
            changes = node_changes(old[node.name], node)
            if changes:
                changed[node.name] = changes
    shown = list(changed) if limit <= 0 else list(changed)[:limit]
    counts_before, counts_after = op_counts(before), op_counts(after)
    kinds_before = collections.Counter(c.kind for c in find_collectives(before))
    kinds_after = collections.Counter(c.kind for c in find_collectives(after))
    return {
        "num_ops": [len(before.node), len(after.node)],
        "added": name_sample([n.name for n in after.node if n.name not in old], limit),
        "removed": name_sample([n.name for n in before.node if n.name not in new], limit),
        "changed": {"count": len(changed), "ops": {k: changed[k] for k in shown},
                    "more": len(changed) - len(shown)},
        "collectives": [sum(kinds_before.values()), sum(kinds_after.values())],
        "collectives_by_kind": _count_changes(ordered_counts(kinds_before), ordered_counts(kinds_after)),
        **{f"by_{key}": _count_changes(counts_before[key], counts_after[key])
           for key in ("device", "taskgraph", "phase")},
    }


def _format_change_counts(label: str, changes: dict[str, list[int]]) -> list[str]:
    """Return the lines "label:" and "  key  before -> after (+d)"."""
    rows = []
    for key, (old, new) in changes.items():
        delta = f"({new - old:+d})" if new != old else ""
        rows.append([key, str(old), "->", str(new), delta])
    return [f"{label}:"] + format_table(rows, indent="  ")


def format_diff(diff: dict[str, Any], name_a: str, name_b: str) -> list[str]:
    """Return the text lines of a `graph_diff` result."""
    (ops_a, ops_b), (coll_a, coll_b) = diff["num_ops"], diff["collectives"]
    lines = [f"diff {name_a} -> {name_b}",
             f"ops: {ops_a} -> {ops_b} ({ops_b - ops_a:+d})",
             format_name_sample("added", diff["added"]),
             format_name_sample("removed", diff["removed"]),
             f"changed {diff['changed']['count']}" + (":" if diff["changed"]["ops"] else "")]
    for name, changes in diff["changed"]["ops"].items():
        lines.append(f"  {name}: " + "; ".join(changes))
    if diff["changed"]["more"]:
        lines.append(f"  (+{diff['changed']['more']} more)")
    lines.append(f"collectives: {coll_a} -> {coll_b} ({coll_b - coll_a:+d})")
    lines.extend(format_table([[kind, str(a), "->", str(b)] for kind, (a, b)
                               in diff["collectives_by_kind"].items()], indent="  "))
    for key, label in (("by_device", "by device"), ("by_taskgraph", "by taskgraph"),
                       ("by_phase", "by phase")):
        lines.extend(_format_change_counts(label, diff[key]))
    return lines


def run_diff(args: argparse.Namespace) -> int:
    """Print the difference between graphs A and B."""
    dumps = read_dump(resolve_dump_dir(args.dump_dir, args.rank)) if args.dump_dir else None
    name_a, graph_a = resolve_graph(args.a, args.dump_dir, dumps, args.rank)
    name_b, graph_b = resolve_graph(args.b, args.dump_dir, dumps, args.rank)
    diff = graph_diff(graph_a, graph_b, args.limit)
    if args.json:
        print(json.dumps({"a": name_a, "b": name_b, **diff}, indent=2))
    else:
        print("\n".join(format_diff(diff, name_a, name_b)))
    return 0


# --------------------------------------------------------------------------
# dot
# --------------------------------------------------------------------------

PHASE_COLOURS = {"forward": "#cfe2ff", "backward": "#f8d7da", "apply": "#d1e7dd",
                 "other": "#e2e3e5"}
NO_PHASE_COLOUR = "#ffffff"


def _dot_quote(text: str) -> str:
    """Return `text` as a quoted DOT string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_selection(graph_def: graph_pb2.GraphDef, max_ops: int) -> list[node_def_pb2.NodeDef]:
    """Return the ops to draw: all if within `max_ops`, else collectives first."""
    nodes = list(graph_def.node)
    if max_ops <= 0 or len(nodes) <= max_ops:
        return nodes
    collectives = [n for n in nodes
                   if n.op in COLLECTIVE_OPS or is_reduction_node(n)][:max_ops]
    chosen = {n.name for n in collectives}
    for node in nodes:
        if len(chosen) >= max_ops:
            break
        chosen.add(node.name)
    return [node for node in nodes if node.name in chosen]


def _dot_node(node: node_def_pb2.NodeDef, node_id: str) -> str:
    """Return the DOT statement of one op."""
    attrs = {"label": f"{node.name}\n{node.op}",
             "fillcolor": PHASE_COLOURS.get(phase_of(node), NO_PHASE_COLOUR),
             "tooltip": f"taskgraph={taskgraph_of(node)} phase={phase_of(node)}"}
    text = ", ".join(f"{key}={_dot_quote(value)}" for key, value in attrs.items())
    if node.op in COLLECTIVE_OPS or is_reduction_node(node):
        text += ', shape="doubleoctagon", color="red", penwidth="3"'
    return f"    {node_id} [{text}];"


def graph_to_dot(graph_def: graph_pb2.GraphDef, title: str = "graph",
                 max_ops: int = DEFAULT_MAX_DOT_OPS) -> str:
    """Return a Graphviz DOT text of `graph_def` (see module doc for the style)."""
    nodes = _dot_selection(graph_def, max_ops)
    ids = {node.name: f"n{i}" for i, node in enumerate(nodes)}
    label = f"{title}: {len(nodes)} of {len(graph_def.node)} ops; fill = phase " \
            "(forward blue, backward red, apply green, other grey, none white); " \
            "collectives = red double octagons; dashed = control edge"
    lines = [f"digraph {_dot_quote(title)} {{",
             f"  graph [rankdir=TB, fontname=\"Helvetica\", label={_dot_quote(label)}];",
             '  node [shape="box", style="filled", fontname="Helvetica", fontsize="10"];']
    by_device = collections.defaultdict(list)
    for node in nodes:
        by_device[device_of(node)].append(node)
    for number, device in enumerate(sorted(by_device, key=natural_key)):
        lines.append(f"  subgraph cluster_{number} {{")
        lines.append(f"    label={_dot_quote(device)}; style=\"rounded\"; color=\"gray40\";")
        lines.extend(_dot_node(node, ids[node.name]) for node in by_device[device])
        lines.append("  }")
    lines.extend(_dot_edges(nodes, ids))
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_edges(nodes: list[node_def_pb2.NodeDef], ids: dict[str, str]) -> list[str]:
    """Return the DOT edges between drawn ops (control edges dashed)."""
    edges = []
    for node in nodes:
        for reference in node.input:
            source, _, is_control = split_input(reference)
            if source in ids:
                style = ' [style="dashed"]' if is_control else ""
                edges.append(f"  {ids[source]} -> {ids[node.name]}{style};")
    return edges


def run_dot(args: argparse.Namespace) -> int:
    """Write the DOT file of one graph."""
    name, graph_def = resolve_graph(args.graph, args.dump_dir, rank=args.rank)
    text = graph_to_dot(graph_def, name, args.max_ops)
    if args.output in (None, "-"):
        sys.stdout.write(text)
        return 0
    directory = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(directory, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as handle:
        handle.write(text)
    print(f"wrote {args.output} ({len(graph_def.node)} ops in {name})")
    return 0


# --------------------------------------------------------------------------
# tensorboard
# --------------------------------------------------------------------------


def write_tensorboard(graph_def: graph_pb2.GraphDef, logdir: str) -> list[str]:
    """Write `graph_def` to a new TensorBoard event file in `logdir` (TensorBoard's
    record writer on a plain file: no TensorFlow needed). Returns [the file's path]."""
    from tensorboard.summary.writer.record_writer import RecordWriter
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    path = os.path.join(logdir, "events.out.tfevents.%010d.%s.%d.%d.epl-dump"
                        % (now, socket.gethostname(), os.getpid(), next(_EVENT_FILES)))
    with open(path, "wb") as handle:
        records = RecordWriter(handle)
        records.write(event_pb2.Event(wall_time=now, file_version="brain.Event:2")
                      .SerializeToString())
        records.write(event_pb2.Event(wall_time=now, graph_def=graph_def.SerializeToString())
                      .SerializeToString())
    return [path]


def run_tensorboard(args: argparse.Namespace) -> int:
    """Write one graph, or every pass of a dump, as TensorBoard event files."""
    dump_dir = args.dump_dir
    if dump_dir is None and args.graph and os.path.isdir(args.graph):
        dump_dir, args.graph = args.graph, None
    if dump_dir is not None and args.graph is None:
        targets = [(dump.label, dump.graph_def, os.path.join(args.logdir, dump.label))
                   for dump in read_dump(resolve_dump_dir(dump_dir, args.rank))]
    else:
        name, graph_def = resolve_graph(args.graph, dump_dir, rank=args.rank)
        targets = [(name, graph_def, args.logdir)]
    for name, graph_def, logdir in targets:
        files = write_tensorboard(graph_def, logdir)
        print(f"wrote {name}: {', '.join(files) or logdir}")
    print(f"view with: tensorboard --logdir {args.logdir}")
    return 0


# --------------------------------------------------------------------------
# Resolving graphs and the command line
# --------------------------------------------------------------------------


def resolve_graph(spec: str | None, dump_dir: str | None,
                  dumps: list[PassDump] | None = None,
                  rank: int | None = None) -> tuple[str, graph_pb2.GraphDef]:
    """Return (display name, GraphDef) for a graph argument.

    With `dump_dir`, `spec` is a pass name or index (None: the last pass).
    Without it, `spec` is a GraphDef file, or a dump directory (its last
    pass). Raises `DumpError` naming what is missing.
    """
    if dump_dir is None and spec is not None and os.path.isdir(spec):
        dump_dir, spec = spec, None
    if dump_dir is not None:
        dumps = dumps if dumps is not None else read_dump(resolve_dump_dir(dump_dir, rank))
        if not dumps:
            raise DumpError(f"dump directory {dump_dir!r} lists no passes")
        dump = select_pass(dumps, spec) if spec is not None else dumps[-1]
        return dump.label, dump.graph_def
    if spec is None:
        raise DumpError("no graph given: name a .pbtxt/.pb file, or --dir DIR and a pass")
    if not os.path.exists(spec):
        raise DumpError(f"graph file {spec!r} does not exist; to name a pass of a"
                        " dump, give the dump directory with --dir DIR")
    return os.path.basename(spec), load_graph_def(spec)


USAGE_EXAMPLES = """examples:
  epl-dump DIR                       every pass (same as: epl-dump show DIR)
  epl-dump DIR --json                the same as JSON
  epl-dump diff --dir DIR input replicate
  epl-dump diff a.pbtxt b.pb
  epl-dump dot --dir DIR 3 -o graph.dot --max-ops 300
  epl-dump tensorboard DIR --logdir tb   (one run per pass)
"""


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of `epl-dump` (sub-commands show/diff/dot/tensorboard)."""
    parser = argparse.ArgumentParser(
        prog="epl-dump", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Inspect EPL's per-pass graph dumps (written when debug.dump_dir"
        " or EPL_DEBUG_DUMP_DIR is set).", epilog=USAGE_EXAMPLES)
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="report every pass of a dump directory")
    show.add_argument("dump_dir", metavar="DIR", help="dump directory")
    show.add_argument("--pass", dest="passes", action="append", metavar="P",
                      help="only this pass (name or index); repeatable")
    diff = commands.add_parser("diff", help="compare two graphs")
    diff.add_argument("a", metavar="A", help="graph file, or pass name/index with --dir")
    diff.add_argument("b", metavar="B", help="graph file, or pass name/index with --dir")
    for sub in (show, diff):
        sub.add_argument("--json", action="store_true", help="print JSON")
        sub.add_argument("--limit", type=int, default=DEFAULT_LIMIT,
                         help="op names listed per category (0: all; default %(default)s)")
    dot = commands.add_parser("dot", help="write a Graphviz DOT file of a graph")
    dot.add_argument("graph", metavar="GRAPH", help="graph file, pass with --dir, or dump dir")
    dot.add_argument("-o", "--output", help="output .dot file (default: stdout)")
    dot.add_argument("--max-ops", type=int, default=DEFAULT_MAX_DOT_OPS,
                     help="draw at most N ops, collectives first (0: all; default %(default)s)")
    board = commands.add_parser("tensorboard", help="write a TensorBoard event file")
    board.add_argument("graph", metavar="GRAPH", nargs="?",
                       help="graph file, pass with --dir, or dump dir (all passes)")
    board.add_argument("--logdir", required=True, help="TensorBoard log directory")
    for sub in (diff, dot, board):
        sub.add_argument("--dir", dest="dump_dir", metavar="DIR",
                         help="dump directory holding the passes named")
    for sub in (show, diff, dot, board):
        sub.add_argument("--rank", type=int, metavar="R",
                         help="with a multi-worker dump (DIR/rank_<r>): this worker's passes"
                         " (default: rank 0)")
    return parser


def _with_default_command(argv: list[str]) -> list[str]:
    """Insert "show" unless the first argument is a sub-command or -h/--help."""
    if argv and argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        return ["show"] + argv
    return argv


HANDLERS = {"show": run_show, "diff": run_diff, "dot": run_dot,
            "tensorboard": run_tensorboard}


def main(argv: Sequence[str] | None = None) -> int:
    """Run `epl-dump` with `argv` (default: sys.argv[1:]); return the exit code.

    Exit codes: 0 success, 2 bad arguments or an unreadable dump (the
    message on stderr names the problem and what exists).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(_with_default_command(argv))
    except SystemExit as exit_:
        return int(exit_.code or 0)
    try:
        return HANDLERS[args.command](args)
    except DumpError as err:
        print(f"epl-dump: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
