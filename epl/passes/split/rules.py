"""The split pass's rule registry (epl/passes/split/split.py describes the pass).

`@rule(op types)` registers the function that maps the input layouts of one op
to per-slot ops and output layouts; `KEEP` is a rule's answer that leaves the op
as it is. The rules themselves are in one module per family (matmul.py,
einsum.py, elementwise.py, embedding.py, softmax.py); split.py imports them,
which registers them.
"""
from __future__ import annotations

KEEP = object()  # a rule's answer: leave the op as it is (all of its inputs stay full)

RULES: dict = {}


def rule(*op_types: str):
    """Register `fn(rewriter, op, layouts) -> [layout per output] | KEEP | None` for op types.

    layouts[i] is the layout of op.inputs[i] (None: full). None means the rule
    does not cover this combination (the op falls back to running unsplit).
    """
    def register(fn):
        for op_type in op_types:
            RULES[op_type] = fn
        return fn
    return register


def splittable_op_types() -> list[str]:
    """The op types the split pass has a rule for."""
    return sorted(RULES)
