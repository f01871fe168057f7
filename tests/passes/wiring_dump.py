"""A canonical text dump of what a graph pass did: the wiring of the ops it added or changed.

`snapshot(graph)` records every op's NodeDef before a pass; `dump_changes(graph,
before)` then writes one block per op the pass added (`+`), then per op whose
NodeDef it changed (`~`), each section sorted by canonical name:

    + EPL_REPLICA_1/dense/MatMul: MatMul @/device:CPU:1 [phase=forward replica=1 ...] -> f...
        in: EPL_BATCH_SLICES/split#0:1, EPL_REPLICA_1/dense/MatMul/ReadVariableOp

- the header: canonical name, op type, device, every `_epl_*` tag
  (epl/ir/annotations.py: TaskGraph, phase, replica, micro-batch, shard, ...)
  and the outputs' dtypes and static shapes;
- `in`: the data inputs in order (`name` for output 0, `name:k` otherwise),
  `ctrl`: the control inputs, sorted; `coloc`: the ops it is colocated with;
- a constant's value when it is a scalar or an integer vector of at most
  SMALL_VECTOR entries (shapes, split sizes, offsets), else `<elided>` (its dtype
  and shape are in the header; a random op's seed is elided too: it differs
  between processes); collectives' group size, merge and final ops, and their
  group and instance keys renumbered in order of first appearance in the dump;
  a functional op's (If, While) functions as the sorted op types of their bodies;
- for a changed op, `was ...` lines: the fields as they were before the pass
  (device, tags, inputs, control inputs, colocation, the names of other
  attributes that changed). TensorFlow's `_has_manual_control_dependencies`
  marker is not a change (the edge shows on the op that waits).

Canonical names. TensorFlow makes a name unique by appending `_N`, so the numbers
EPL's names get (`EPL_ACCUMULATE_7/add`, `CollectiveReduce_1`) say in which order a
pass built its ops, not what it built. A component `X_N` whose bare sibling `X`
exists in the graph (TensorFlow leaves the first one bare) loses its suffix when it
is one of EPL's scopes (`EPL_...`), a name EPL gave inside one, or the first
component of an op EPL added; a copy (`EPL_REPLICA_<k>/[EPL_MICRO_BATCH_<m>/]...`)
keeps its unit's prefix, and the rest is normalized as the copied op's name. User
names (`dense_1`) and the names TensorFlow's autodiff gives (`MatMul_1`) stay. Ops
whose names then coincide are told apart by their structure (device, tags, type,
value, the names of their inputs and consumers, then the same refined over their
neighbours) and numbered `#0`, `#1`, ... in that order. So a dump does not change
when a pass builds the same ops in another order, and it holds no ids, addresses
or timings: it is the same across runs and machines.
"""
from __future__ import annotations

import collections
import difflib
import hashlib
import os
import re

import numpy as np
import tensorflow as tf

from epl.ir.graph_view import input_args

SMALL_VECTOR = 8
_TAG_PREFIX = "_epl_"
_SUFFIXED = re.compile(r"^(\w+?)_\d+$")
_COPY_SCOPE = re.compile(r"^EPL_(REPLICA|MICRO_BATCH)_\d+$")
# TensorFlow's bookkeeping of which ops were a control_dependencies() argument: the
# edge itself is shown on the op that waits
_IGNORED_ATTRS = ("_has_manual_control_dependencies",)
_COLLECTIVE_ATTRS = ("group_size", "merge_op", "final_op")
_REFINE_ROUNDS = 6


def snapshot(graph: tf.Graph) -> dict:
    """op -> a copy of its NodeDef (what `dump_changes` compares with)."""
    return {op: _stripped(op.node_def) for op in graph.get_operations()}


def _stripped(node):
    copy = type(node)()
    copy.CopyFrom(node)
    for key in _IGNORED_ATTRS:
        if key in copy.attr:
            del copy.attr[key]
    return copy


def changed_ops(graph: tf.Graph, before: dict) -> tuple[list, list]:
    """(ops added since `before`, ops of `before` whose NodeDef changed), creation order."""
    added = [op for op in graph.get_operations() if op not in before]
    changed = [op for op, node in before.items() if _stripped(op.node_def) != node]
    return added, changed


# --------------------------------------------------------------------------
# canonical names
# --------------------------------------------------------------------------


def normalize(name: str, paths: set, user_names: frozenset | None = None) -> str:
    """`name` without the unique suffixes of EPL's names (the module docstring's rules).

    paths: every op name of the graph and every scope above one; user_names: the
    names of the ops the script built (None: every op is the script's)."""
    parts = name.split("/")
    prefix = 0
    while prefix < len(parts) - 1 and _COPY_SCOPE.match(parts[prefix]):
        prefix += 1
    if prefix:
        return "/".join(parts[:prefix] + [normalize("/".join(parts[prefix:]), paths, user_names)])
    built_by_epl = user_names is not None and name not in user_names
    kept = []
    for i, part in enumerate(parts):
        parent = "/".join(parts[:i] + [""])
        above = parts[i - 1] if i else ""
        mine = part.startswith("EPL_") or (i == 0 and built_by_epl) or \
            (above.startswith("EPL_") and not _COPY_SCOPE.match(above))
        while mine:
            match = _SUFFIXED.match(part)
            if match is None or parent + match.group(1) not in paths:
                break
            part = match.group(1)
        kept.append(part)
    return "/".join(kept)


def _paths(graph: tf.Graph) -> set:
    paths = set()
    for op in graph.get_operations():
        parts = op.name.split("/")
        paths.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    return paths


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def canonical_names(graph: tf.Graph, user_ops=None) -> dict:
    """op -> its canonical name: normalized (`user_ops`: the ops the script built, the
    others are EPL's; None: all are the script's), numbered `#k` by structure where
    they coincide."""
    ops = graph.get_operations()
    paths = _paths(graph)
    user_names = None if user_ops is None else frozenset(op.name for op in user_ops)
    base = {op: normalize(op.name, paths, user_names) for op in ops}
    groups = collections.defaultdict(list)
    for op in ops:
        groups[base[op]].append(op)
    clashing = [members for members in groups.values() if len(members) > 1]
    if not clashing:
        return base
    label = {op: _digest("|".join([base[op], op.type, op.device, repr(_tags(op)),
                                   repr(_const_value(op))])) for op in ops}
    consumers = {op: [(c, i) for out in op.outputs for c in out.consumers()
                      for i, t in enumerate(c.inputs) if t is out] for op in ops}
    for _ in range(_REFINE_ROUNDS):
        if all(len({label[op] for op in members}) == len(members) for members in clashing):
            break
        label = {op: _digest("|".join(
            [label[op]] + [f"{label[t.op]}:{t.value_index}" for t in op.inputs]
            + sorted("^" + label[c] for c in op.control_inputs)
            + sorted(f">{label[c]}:{i}" for c, i in consumers[op])
            + sorted("<" + label[c] for c in op._control_outputs))) for op in ops}
    names = dict(base)
    for members in clashing:
        order = sorted(members, key=lambda o: (_local(o, base, consumers), label[o], o._id))
        for k, op in enumerate(order):
            names[op] = f"{base[op]}#{k}"
    return names


def _local(op: tf.Operation, base: dict, consumers: dict) -> str:
    """What tells ops of one normalized name apart, readably: device and tags first (so
    replica, micro-batch and shard order the numbers), then the names of their
    inputs and consumers."""
    return "|".join([op.device, repr(_tags(op)), op.type, repr(_const_value(op))]
                    + [f"{base[t.op]}:{t.value_index}" for t in op.inputs]
                    + sorted("^" + base[c] for c in op.control_inputs)
                    + sorted(f">{base[c]}:{i}" for c, i in consumers[op]))


# --------------------------------------------------------------------------
# one op
# --------------------------------------------------------------------------


def _tags(op_or_node) -> tuple:
    node = op_or_node.node_def if isinstance(op_or_node, tf.Operation) else op_or_node
    tags = []
    for key in sorted(node.attr):
        if key.startswith(_TAG_PREFIX):
            value = node.attr[key]
            field = value.WhichOneof("value")
            shown = value.s.decode() if field == "s" else getattr(value, field) if field else None
            tags.append((key[len(_TAG_PREFIX):], shown))
    return tuple(tags)


def _format_tags(tags: tuple) -> str:
    return "[" + " ".join(f"{k}={v}" for k, v in tags) + "]"


def _const_value(op: tf.Operation):
    """A constant's value as text when it is small (module docstring), else None."""
    if op.type != "Const" or _only_seeds(op):
        return None
    value = tf.make_ndarray(op.get_attr("value"))
    if value.ndim == 0:
        item = value[()]
        if isinstance(item, bytes):
            return repr(item.decode(errors="replace")[:40])
        return str(item)
    if value.ndim == 1 and value.size <= SMALL_VECTOR and np.issubdtype(value.dtype, np.integer):
        return str([int(v) for v in value])
    return None


def _only_seeds(op: tf.Operation) -> bool:
    """True for a constant read only as a random op's `seed` argument (an initializer's
    seed, drawn anew in every process without a graph-level seed)."""
    uses = [(c, i) for c in op.outputs[0].consumers() for i, t in enumerate(c.inputs)
            if t is op.outputs[0]]
    return bool(uses) and all(_argument(c, i) == "seed" for c, i in uses)


def _argument(op: tf.Operation, index: int) -> str:
    """The OpDef name of the argument behind input `index` of `op`."""
    position = 0
    for arg, width in input_args(op):
        if index < position + width:
            return arg.name
        position += width
    return ""


def _outputs(op: tf.Operation) -> str:
    parts = []
    for out in op.outputs:
        shape = out.shape
        dims = "?" if shape.rank is None else ",".join("?" if d is None else str(d)
                                                          for d in shape.as_list())
        parts.append(f"{out.dtype.name}[{dims}]")
    return ", ".join(parts)


def _tensor_name(tensor: tf.Tensor, names: dict) -> str:
    name = names[tensor.op]
    return name if tensor.value_index == 0 else f"{name}:{tensor.value_index}"


def _node_inputs(node, graph: tf.Graph, names: dict) -> tuple[list, list]:
    """(data inputs, sorted control inputs) of a NodeDef, by canonical name."""
    data, control = [], []
    for text in node.input:
        if text.startswith("^"):
            control.append(names[graph.get_operation_by_name(text[1:])])
            continue
        op_name, _, index = text.partition(":")
        name = names[graph.get_operation_by_name(op_name)]
        data.append(name if index in ("", "0") else f"{name}:{index}")
    return data, sorted(control)


def _colocation(node, graph: tf.Graph, names: dict) -> list:
    """The ops `node` is colocated with (its `_class` groups), itself left out."""
    if "_class" not in node.attr:
        return []
    groups = [g.decode() for g in node.attr["_class"].list.s if g != f"loc:@{node.name}".encode()]
    return sorted(names[graph.get_operation_by_name(g[len("loc:@"):])] if g.startswith("loc:@")
                  else g for g in groups)


class _Keys:
    """Collective group and instance keys renumbered by first appearance."""

    def __init__(self):
        self.seen: dict = {}

    def __call__(self, kind: str, key: int) -> str:
        numbers = self.seen.setdefault(kind, {})
        return f"#{numbers.setdefault(key, len(numbers) + 1)}"


def _details(op: tf.Operation, names: dict, keys: _Keys, library: dict) -> list[str]:
    lines = []
    value = _const_value(op)
    if op.type == "Const":
        lines.append(f"value: {value if value is not None else '<elided>'}")
    if op.type.startswith("Collective"):
        attrs = {a: op.get_attr(a) for a in _COLLECTIVE_ATTRS if a in op.node_def.attr}
        shown = " ".join(f"{k}={v.decode() if isinstance(v, bytes) else v}"
                         for k, v in attrs.items())
        group = keys("group", op.get_attr("group_key")) if "group_key" in op.node_def.attr \
            else "(input)"
        instance = keys("instance", op.get_attr("instance_key")) \
            if "instance_key" in op.node_def.attr else "(input)"
        lines.append(f"collective: {shown} group={group} instance={instance}".replace("  ", " "))
    for key in sorted(op.node_def.attr):
        attr = op.node_def.attr[key]
        functions = [attr.func.name] if attr.HasField("func") else \
            [f.name for f in attr.list.func] if attr.HasField("list") else []
        for function in functions:
            body = library.get(function)
            types = sorted(n.op for n in body.node_def) if body is not None else ["<missing>"]
            lines.append(f"{key}: [{', '.join(types)}]")
    return lines


def _block(op: tf.Operation, mark: str, names: dict, keys: _Keys, library: dict,
           before=None) -> list[str]:
    node = op.node_def
    graph = op.graph
    outputs = _outputs(op)
    header = (f"{mark} {names[op]}: {op.type} @{op.device or '<none>'} "
              f"{_format_tags(_tags(node))}" + (f" -> {outputs}" if outputs else ""))
    lines = [header]
    data, control = _node_inputs(node, graph, names)
    if data:
        lines.append("    in: " + ", ".join(data))
    if control:
        lines.append("    ctrl: " + ", ".join(control))
    colocation = _colocation(node, graph, names)
    if colocation:
        lines.append("    coloc: " + ", ".join(colocation))
    lines += ["    " + line for line in _details(op, names, keys, library)]
    if before is not None:
        lines += ["    " + line for line in _was(node, before, graph, names)]
    return lines


def _was(node, before, graph: tf.Graph, names: dict) -> list[str]:
    """The fields of `before` (the NodeDef before the pass) that differ from `node`."""
    lines = []
    if node.device != before.device:
        lines.append(f"was device: {before.device or '<none>'}")
    if _tags(node) != _tags(before):
        lines.append(f"was tags: {_format_tags(_tags(before))}")
    data, control = _node_inputs(node, graph, names)
    old_data, old_control = _node_inputs(before, graph, names)
    if data != old_data:
        lines.append("was in: " + (", ".join(old_data) or "<none>"))
    if control != old_control:
        lines.append("was ctrl: " + (", ".join(old_control) or "<none>"))
    if _colocation(node, graph, names) != _colocation(before, graph, names):
        lines.append("was coloc: " + (", ".join(_colocation(before, graph, names)) or "<none>"))
    others = sorted(k for k in set(node.attr) | set(before.attr)
                    if not k.startswith(_TAG_PREFIX) and k not in ("_class",) + _IGNORED_ATTRS
                    and node.attr.get(k) != before.attr.get(k))
    if others:
        lines.append("was attrs: " + ", ".join(others) + " (changed)")
    return lines


def dump_changes(graph: tf.Graph, before: dict, title: str = "", user_ops=None) -> str:
    """The canonical text of what changed in `graph` since `before` (`snapshot`);
    user_ops: the ops the script built (see `canonical_names`)."""
    added, changed = changed_ops(graph, before)
    names = canonical_names(graph, user_ops)
    library = {f.signature.name: f for f in graph.as_graph_def().library.function}
    keys = _Keys()
    lines = [f"# {title}"] if title else []
    lines.append(f"# {len(added)} op(s) added, {len(changed)} changed")
    for mark, ops in (("+", added), ("~", changed)):
        for op in sorted(ops, key=lambda o: names[o]):
            lines += _block(op, mark, names, keys, library, before.get(op) if mark == "~" else None)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# goldens
# --------------------------------------------------------------------------

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "goldens")


def check_golden(name: str, text: str, update: bool, directory: str = GOLDEN_DIR) -> None:
    """Compare `text` with `directory`/<name>.txt (goldens/), or (update) write it there.

    A mismatch fails with the unified diff (golden -> now) and how to update."""
    path = os.path.join(directory, f"{name}.txt")
    if update:
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(text)
        return
    if not os.path.exists(path):
        raise AssertionError(f"no golden {path}: run pytest with --update-goldens "
                             "(or EPL_UPDATE_GOLDENS=1) and read the file it writes")
    with open(path) as handle:
        golden = handle.read()
    if golden != text:
        diff = list(difflib.unified_diff(golden.splitlines(), text.splitlines(),
                                         f"goldens/{name}.txt", "now", lineterm="", n=2))
        shown = "\n".join(diff[:200]) + (f"\n... {len(diff) - 200} more diff lines"
                                          if len(diff) > 200 else "")
        raise AssertionError(
            f"the wiring of pass {name!r} differs from its golden:\n{shown}\nIf the new "
            "wiring is the intended one, rerun with --update-goldens (or EPL_UPDATE_GOLDENS=1) "
            "and commit the golden with the change.")
