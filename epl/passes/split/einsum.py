"""Split rule for Einsum (tf.einsum), by equation labels (epl/passes/split/split.py
describes the pass).

The operands with the split label are split along it (a variable sharded, a
full tensor sliced: the expert dispatch, chunked when split.moe_chunks > 1), the
others read whole on every device; the output is sharded along the label when
it keeps it and partial sums when the label is contracted.
"""
from __future__ import annotations

import logging

from epl.errors import ParallelizeError
from epl.passes.split.layouts import Partial, Pending, Sharded, is_full
from epl.passes.split.rewriter import Rewriter, as_sharded, clone_on_slots
from epl.passes.split.rules import KEEP, rule

_LOG = logging.getLogger(__name__)


def _einsum_chunk_label(labels: list, out: list, index: int, label):
    """The label along which the chunked dispatch cuts operand `index` (the
    tokens): its last label, other than the split one, that the output keeps and
    no other operand has (the capacity c of "egcm,emh->egch"); None if none."""
    others = {l for i, term in enumerate(labels) if i != index for l in term}
    for candidate in reversed(labels[index]):
        if candidate != label and candidate in out and candidate not in others:
            return candidate
    return None


def _einsum_labels(op):
    """(labels of each operand, labels of the output) of an Einsum op, one label
    per axis; an ellipsis becomes one label per axis it covers, right-aligned
    across operands as broadcasting aligns them. None when a rank is unknown or a
    label repeats within one term (a diagonal or trace)."""
    equation = op.get_attr("equation")
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    if "->" not in equation:
        return None
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    ranks = [t.shape.rank for t in op.inputs]
    if None in ranks or len(terms) != len(ranks):
        return None
    spans = [rank - (len(term) - 3) if "..." in term else 0 for term, rank in zip(terms, ranks)]
    width = max(spans + [0])
    spare = [chr(0x100 + i) for i in range(width)]   # labels no equation spells

    def expand(term: str, span: int) -> list:
        if "..." not in term:
            return list(term)
        head, tail = term.split("...")
        return list(head) + spare[width - span:] + list(tail)

    labels = [expand(term, span) for term, span in zip(terms, spans)]
    out_labels = expand(out, width)
    if any(len(l) != len(set(l)) for l in labels + [out_labels]) \
            or any(len(l) != rank for l, rank in zip(labels, ranks)):
        return None
    return labels, out_labels


def _einsum_weight_axis(labels: list, out: list, index: int):
    """(axis, expert) along which to shard operand `index` (a variable no rule has
    sharded yet), or None to keep it whole. First choice: a label it shares with
    another operand and the output (the expert axis of an [experts, d, h] weight
    in "egcm,emh->egch": whole experts per device, the tokens sliced to match);
    then the first label only it and the output have (a column split, as
    "bsd,dh->bsh" splits h: the output is sharded, no collective)."""
    others = set()
    for i, term in enumerate(labels):
        if i != index:
            others.update(term)
    own = labels[index]
    for axis, label in enumerate(own):
        if label in others and label in out:
            return axis, True
    for axis, label in enumerate(own):
        if label not in others and label in out:
            return axis, False
    return None


@rule("Einsum")
def _einsum(rw: Rewriter, op, layouts):
    """tf.einsum on split operands, by the label that is split.

    The split label comes from a sharded operand (all sharded operands must be
    split along the same label and extents), or, when none is sharded yet, from
    the first variable operand (`_einsum_weight_axis`). Every operand that has
    the label is split along it (a variable becomes shards; a full tensor is
    sliced: the dispatch of tokens to expert devices), the others are read
    whole on every device, and each device runs the einsum on its slices. The
    output is sharded along the label when the output keeps it ("egcm,emh->egch"
    keeps e; "bsd,dh->bsh" keeps h), and partial sums when the label is
    contracted ("gsec,egcm->gsm", the expert combine; "bsh,hd->bsd", a row
    split): one sum where the whole value is read. Partial sums go through an
    einsum whose other operands are whole (it is linear in each operand).
    """
    parsed = _einsum_labels(op)
    if parsed is None:
        return KEEP if all(is_full(l) for l in layouts) else None
    labels, out = parsed
    partial = [i for i, l in enumerate(layouts) if isinstance(l, Partial)]
    sharded = [i for i, l in enumerate(layouts) if isinstance(l, Sharded)]
    if partial:
        if len(partial) > 1 or sharded:
            return None
        values = [None if i in partial else rw.value(l, t)
                  for i, (l, t) in enumerate(zip(layouts, op.inputs))]
        parts = clone_on_slots(rw, op, lambda j: [layouts[i].parts[j] if i in partial
                                                  else values[i] for i in range(len(values))])
        return [Partial(parts)]
    expert, order = False, list(range(len(op.inputs)))
    if sharded:
        first = layouts[sharded[0]]
        label, sizes = labels[sharded[0]][first.axis], first.sizes
        full = op.inputs[sharded[0]].shape[first.axis]
        if any(labels[i][layouts[i].axis] != label or layouts[i].sizes != sizes
               for i in sharded):
            return None
    else:
        pending = [i for i, l in enumerate(layouts) if isinstance(l, Pending)]
        choice = _einsum_weight_axis(labels, out, pending[0]) if pending else None
        if choice is None:
            return KEEP
        axis, expert = choice
        label, sizes = labels[pending[0]][axis], None
        full = op.inputs[pending[0]].shape[axis]
        order = [pending[0]] + [i for i in order if i != pending[0]]   # its shards set the sizes
    if full is None:
        return None
    sliced = [i for i in order if not isinstance(layouts[i], (Sharded, Pending))
              and label in labels[i]]
    chunk_label = None
    if expert and rw.moe_chunks > 1 and len(sliced) == 1:
        chunk_label = _einsum_chunk_label(labels, out, sliced[0], label)
        if chunk_label is None:
            _LOG.info("split.moe_chunks: %s (%s) has no capacity axis to cut the "
                      "dispatch along; it is dispatched whole", op.name,
                      op.get_attr("equation"))
    parts_of, chunked = {}, None
    for i in order:
        tensor, layout = op.inputs[i], layouts[i]
        axis = labels[i].index(label) if label in labels[i] else None
        if axis is not None and tensor.shape[axis] == 1 and full != 1:
            axis = None                                  # broadcast along the split label
        if axis is None:
            if isinstance(layout, Sharded):
                return None
            value = rw.value(layout, tensor)
            parts_of[i] = [value] * rw.k
        elif isinstance(layout, Sharded):
            parts_of[i] = layout.parts
        elif isinstance(layout, Pending):
            what, divide = "", False
            if expert:
                what, divide = _check_whole_experts(rw, op, layout, tensor, axis, label)
            split = as_sharded(rw, layout, tensor, axis, sizes, what, must_divide=divide)
            if split is None:
                return None
            parts_of[i], sizes = split.parts, split.sizes
        elif chunk_label is not None and i == sliced[0]:
            chunked = (i, rw.slice_chunks(rw.value(layout, tensor), axis, sizes,
                                          labels[i].index(chunk_label),
                                          f"{op.name} ({op.type})", int(full)))
        else:
            parts_of[i] = rw.slice(rw.value(layout, tensor), axis, sizes, int(full),
                                   f"{op.name} ({op.type}, {op.get_attr('equation')!r})").parts
    if chunked is not None:       # the chunked dispatch: one einsum per chunk and slot
        index, chunks = chunked
        results = []
        for c, chunk in enumerate(chunks):
            parts_of[index] = chunk.parts
            results.append(clone_on_slots(
                rw, op, lambda j: [parts_of[i][j] for i in range(len(op.inputs))],
                suffix=f"/chunk_{c}"))
        parts = rw.concat_chunks(results, out.index(chunk_label))
    else:
        parts = clone_on_slots(rw, op, lambda j: [parts_of[i][j]
                                                  for i in range(len(op.inputs))])
    if label in out:
        return [Sharded(parts, out.index(label), sizes)]
    return [Partial(parts)]


def _check_whole_experts(rw: Rewriter, op, layout: Pending, tensor, axis: int, label: str):
    """(what, must_divide) for sharding an expert axis; refuses a count that the
    split degree does not divide (every device holds whole experts)."""
    variable = layout.variable
    experts = int(tensor.shape[axis])
    what = (f"expert count {experts} (axis {axis} of {variable.op.name}, shape "
            f"{tensor.shape.as_list()}, read by {op.name})")
    if experts % rw.k and variable.op not in rw.sharded:
        raise ParallelizeError(
            f"the {what} is not divisible by the split degree {rw.k}: every device must "
            f"hold whole experts. Use a number of experts divisible by {rw.k}, or "
            f"epl.split(device_count=d) with d dividing {experts}.")
    return what, True
