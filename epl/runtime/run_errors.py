"""Run-time errors of a parallelized graph, said in the user's terms.

TensorFlow names the op an error happened in, and under EPL that is often
EPL's copy of the user's op (`EPL_REPLICA_1/out/MatMul/ReadVariableOp`, a
variable's mirror, `EPL_FEED/IteratorGetNext`). The session integration
(epl.hooks.session) hands every `tf.errors.OpError` of a run to `rewrite`,
which raises in its place:

- the same TensorFlow error class (so that MonitoredTrainingSession still
  ends on the end of the data, and `except tf.errors.OutOfRangeError` still
  works), its message headed by the worker, the step, and for the common
  cases what is wrong and what to do (a variable not initialized; the input
  ran out of data, with how many batches a step draws), and every copy named
  as the user's op with its unit: ``out/kernel (replica 1's copy)``
  (`user_names`, from ParallelGraph.origins), and every other op EPL added by
  the pass that added it: ``EPL's own op (from its gradient_comm pass)``
  (ParallelGraph.pass_spans); the error's op is the user's;
- for a run that restores a checkpoint whose files are missing or damaged, a
  `CheckpointError` naming the file and what is wrong (epl.checkpoint.damage),
  and an older intact checkpoint if there is one;
- for a run that saves a checkpoint and cannot write it (a full disk, a
  file-size limit, a removed directory), a `CheckpointError` with the path and
  the reason, and which checkpoint is still intact. (TensorFlow reports a
  file-size limit as OutOfRangeError, which MonitoredTrainingSession would
  take for the end of the data and end the job as if it had finished.)
"""
from __future__ import annotations

import logging
import os
import re

import tensorflow as tf

from epl.checkpoint import damage
from epl.errors import CheckpointError

# The message of the check a further unit's draw makes when the input ended within a
# step (epl.passes.replication.inputs): `rewrite` says it is the end of the input, with
# the rows the step drops.
SHORT_INPUT_MARKER = "EPL_SHORT_INPUT"
_NAME = re.compile(r"[A-Za-z0-9_.\-/]+(?::\d+)?")
_RECV_SUFFIX = re.compile(r"/_\d+$")
_VARIABLE = re.compile(r"(?:Could not find variable|uninitialized value) "
                       r"([A-Za-z0-9_.\-/]*[A-Za-z0-9_])")


def _lookup(token: str, origins: dict, own: dict) -> tuple[str, str] | None:
    """(the part of `token` that names an op of EPL's, the user's words for it), or None.
    origins: EPL's copies (name -> (the user's op, its unit)); own: the other ops EPL's
    passes added (name -> the pass that added it)."""
    candidates = [token]
    bare = token.split(":", 1)[0]
    candidates += [bare, _RECV_SUFFIX.sub("", bare)]
    for candidate in list(candidates):  # a resource "container/name"
        parts = candidate.split("/")
        candidates += ["/".join(parts[i:]) for i in range(1, len(parts))]
    for candidate in candidates:
        if candidate in origins:
            original, unit = origins[candidate]
            return candidate, "%s (%s's copy)" % (original, unit)
    for candidate in candidates:
        if candidate in own:
            return candidate, "EPL's own op (from its %s pass)" % own[candidate]
    return None


def own_ops(result) -> dict:
    """The ops EPL's passes added to `result`'s graph that are not copies of the user's
    ops (a gradient all-reduce, an accumulator, a unit's call): name -> the pass that
    added it (ParallelGraph.pass_spans)."""
    ops = result.graph.get_operations()
    own = {}
    for name, first, end in result.pass_spans:
        for op in ops[first:end]:
            if op.name not in result.origins:
                own[op.name] = name
    return own


def user_names(text: str, origins: dict, own: dict | None = None) -> str:
    """`text` with every EPL copy it names replaced by the user's op and the copy's unit
    (``EPL_REPLICA_1/out/kernel`` -> ``out/kernel (replica 1's copy)``), and every other
    op of EPL's in `own` (name -> the pass that added it) by what it is
    (``EPL_FUSION_1/concat`` -> ``EPL's own op (from its gradient_comm pass)``)."""
    own = own or {}
    if not origins and not own:
        return text

    def replace(match):
        token = match.group(0).rstrip(".")
        tail = match.group(0)[len(token):]  # a sentence's full stop
        found = _lookup(token, origins, own)
        if found is None:
            return token + tail
        part, named = found
        if token != part and _RECV_SUFFIX.sub("", token) == part:  # TensorFlow's transfer node
            return named + tail
        return token.replace(part, named, 1) + tail

    return _NAME.sub(replace, text)


_FRAME = re.compile(r"^(Graph execution error:|Detected at node|Node:|\d+ root error|"
                    r"\d+ successful operations|\d+ derived errors|Original stack trace)")
_ROOT = re.compile(r"^\s*\(\d+\) [A-Z_]+: ")


def root_line(err: tf.errors.OpError) -> str:
    """The first line of what went wrong in `err`'s message, without TensorFlow's frame
    ("Graph execution error:", "Detected at node ...", "2 root error(s) found.")."""
    for line in err.message.splitlines():
        text = line.strip()
        if not text or _FRAME.match(text) or text.startswith(("File ", "[[")):
            continue
        if line[:1].isspace() and not _ROOT.match(line):
            continue
        return _ROOT.sub("", line).strip()
    return type(err).__name__


def _head(result, step: int | None, restoring: bool = False) -> str:
    cluster = result.cluster
    where = ["worker %d of %d" % (cluster.worker_rank, cluster.num_workers)] \
        if cluster.num_workers > 1 else []
    if not restoring:  # a restore runs before the step is known
        where.append("at global step %d" % step if step is not None
                     else "at an unknown global step (it cannot be read)")
    return ", ".join(where) + ": " if where else ""


def _units(result) -> int:
    from epl.env import get_config
    return result.plan.num_replicas * int(get_config().get("pipeline.num_micro_batch"))


def _hint(err: tf.errors.OpError, message: str, result) -> str:
    """What is wrong and what to do, for the errors every user meets."""
    if isinstance(err, tf.errors.FailedPreconditionError):
        match = _VARIABLE.search(message)
        if match:
            return ("variable %s is not initialized: run "
                    "tf.compat.v1.global_variables_initializer() before the first step (or let "
                    "MonitoredTrainingSession initialize or restore it). " % match.group(1))
    if isinstance(err, tf.errors.OutOfRangeError) and "End of sequence" in message:
        units = _units(result)
        per_step = (" (each step draws %d batches from it: one per replica and micro-batch, "
                    "io.batch_mode 'replica')" % units) if units > 1 else ""
        return ("the input ran out of data: %s has no more batches%s; repeat the dataset "
                "(Dataset.repeat) or stop at tf.errors.OutOfRangeError. " % (
                    _op_name(err, result), per_step))
    return ""


def _op_name(err: tf.errors.OpError, result) -> str:
    op = _user_op(err, result)
    return op.name if op is not None else "the input"


def _user_op(err: tf.errors.OpError, result) -> tf.Operation | None:
    """The user's op the error happened in (the original of EPL's copy)."""
    op = err.op
    if op is None:
        return None
    original = result.origins.get(op.name)
    if original is None:
        return op
    try:
        return result.graph.get_operation_by_name(original[0])
    except (KeyError, ValueError):
        return op


def rewrite(err: tf.errors.OpError, result, step: int | None, saving: str | None = None,
            restoring: str | None = None) -> Exception:
    """The error to raise instead of `err`, a run's error on ParallelGraph `result` at
    global step `step` (None: unknown). saving / restoring: the checkpoint prefix
    the run writes or reads, if it does."""
    head = _head(result, step, restoring=bool(restoring))
    first = root_line(err)
    if restoring:
        problem = damage.diagnose(restoring)
        if problem is not None:
            return CheckpointError("%scannot restore the checkpoint %s: %s. %s" % (
                head, restoring, problem, older_checkpoint(restoring)))
    if saving:
        return CheckpointError("%ssaving the checkpoint %s failed: %s. %s" % (
            head, saving, _save_reason(err, saving, user_names(first, result.origins,
                                                               own_ops(result))),
            _kept(saving)))
    message = user_names(err.message, result.origins, own_ops(result))
    op = _user_op(err, result)
    node_def = op.node_def if op is not None else err.node_def
    short = _short_input(err)
    if short is not None:   # the end of the input, within a step: said as the end it is
        logging.getLogger("epl").warning("%s%s", head, short)
        return tf.errors.OutOfRangeError(node_def, op, "%s%sTensorFlow's error, with your "
                                         "names for EPL's copies: %s" % (head, short, message))
    return type(err)(node_def, op, "%s%sTensorFlow's error, with your names for EPL's copies: %s"
                     % (head, _hint(err, message, result), message))


_SHORT = re.compile(SHORT_INPUT_MARKER + r"\]\s*\[(\d+)\]\s*\[(\d+)\]\s*\[(\d+)\]")


def _short_input(err: tf.errors.OpError) -> str | None:
    """For the check of a unit's draw that found the input ended within a step
    (epl.passes.replication.inputs._draws): what was dropped, in words."""
    if not isinstance(err, tf.errors.InvalidArgumentError):
        return None
    match = _SHORT.search(err.message)
    if match is None:
        return None
    rows, unit, units = (int(g) for g in match.groups())
    return ("the input ran out of data within a step: unit %d of the %d units (replicas x "
            "micro-batches) of this step found no batch, so the %d row(s) the units before "
            "it drew are dropped and the step does not run (EPL runs whole steps: use "
            "Dataset.batch(..., drop_remainder=True) and a number of batches divisible by %d "
            "to drop nothing). " % (unit, units, rows, units))


def older_checkpoint(prefix: str) -> str:
    """A sentence on the newest intact checkpoint next to damaged checkpoint `prefix`."""
    directory = os.path.dirname(prefix) or "."
    good = damage.last_good(directory, skip=prefix)
    if good is None:
        return "No other checkpoint in %s is intact." % directory
    return ("An older checkpoint in %s is intact: %s; to resume from it, name it as "
            "model_checkpoint_path in %s." % (directory, good,
                                              os.path.join(directory, "checkpoint")))


def _save_reason(err: tf.errors.OpError, prefix: str, first: str) -> str:
    directory = os.path.dirname(prefix) or "."
    if not os.path.isdir(directory):
        return "its directory %s no longer exists (TensorFlow: %s)" % (directory, first)
    lowered = first.lower()
    if "no space left" in lowered:
        return "the disk is full (TensorFlow: %s)" % first
    if "file too large" in lowered:
        return "a file-size limit was reached (a quota; TensorFlow: %s)" % first
    if "quota" in lowered:
        return "a disk quota was reached (TensorFlow: %s)" % first
    if "permission denied" in lowered:
        return "it may not write there (TensorFlow: %s)" % first
    return "it could not be written (TensorFlow %s: %s)" % (type(err).__name__, first)


def _kept(prefix: str) -> str:
    directory = os.path.dirname(prefix) or "."
    good = damage.last_good(directory, skip=prefix) if os.path.isdir(directory) else None
    if good is None:
        return "No intact checkpoint is left in %s." % directory
    return ("The last good checkpoint, %s, is intact (%s names it): a restarted job "
            "resumes from it." % (good, os.path.join(directory, "checkpoint")))
