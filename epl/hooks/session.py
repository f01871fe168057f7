"""Session integration: the hooks that make a plain training script parallel.

- `tf.compat.v1.Session(...)` (and every session built on BaseSession, which
  includes MonitoredTrainingSession's) parallelizes its graph on creation if
  EPL annotated it, and gets the config that creates the worker's devices; it
  runs the graph's run graph, the ops its runs need (epl.runtime.run_graph), unless
  `debug.whole_graph_sessions` is set.
- `Session.partial_run_setup` copies into the run graph what the partial runs need.
- `Scaffold.finalize` (MonitoredTrainingSession) parallelizes before the graph
  is finalized, so the scaffold's init op and saver see the parallel graph.
- `Session.make_callable` and the callables tf-keras's backend functions make
  (`_make_callable_from_options`) run through `Session.run` on a parallelized graph.
- `Session.run` returns merged values for merged tensors (the loss is the mean
  over the global batch), and after a run that wrote an original variable
  (initialization, restore, an assign) copies it into the replicas' mirrors;
  before a run that reads an original variable ZeRO shards (a save), gathers the shards into it.
  Reads (a hook's `cond` on the global step) are not writes
  (epl.runtime.variable_access).
- With several workers every run is compared with the other workers' first
  (the first time its collectives run), bounded by
  `communication.collective_timeout_s` and explained when a worker stalls or
  leaves (epl.runtime.guarded_run).
- After a restore, the checkpoint and its global step are logged (and told to
  epl-launch, which logs the step a restarted job resumed from).
- While `epl.capture` runs a script, the first session (or Scaffold.finalize) on
  a graph EPL would parallelize raises `epl.env.CaptureStop` instead.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import sys
import time
import weakref

import tensorflow as tf
from tensorflow.python.client import session as session_lib

from epl.env import CaptureStop, capturing
from epl.hooks import late_rewrite
from epl.hooks.record import record_of
from epl.ir.consistency import varying_tensor
from epl.ir.graph_view import ancestors, has_training_step
from epl.parallel import ParallelGraph, needs_parallelize, parallelize
from epl.passes.recompute.checkpoints import gradient_difference, gradient_pairs
from epl.runtime.collective_check import HOROVOD_COLLECTIVE_TYPES
from epl.runtime.guarded_run import guarded_run
from epl.checkpoint import damage
from epl.errors import CheckpointError, ParallelizeError
from epl.runtime import run_errors
from epl.runtime.run_graph import attach_session
from epl.runtime.horovod_comm import collective_label
from epl.runtime.variable_access import READ_ONLY_TYPES, writes_variable  # noqa: F401
from epl.runtime.worker_status import STATUS

# Op types that restore variables from a checkpoint (a Saver's restore), and that save one.
RESTORE_TYPES = frozenset({"RestoreV2", "Restore", "RestoreSlice"})
SAVE_TYPES = frozenset({"SaveV2", "Save", "SaveSlices", "MergeV2Checkpoints"})
_ORIGINAL = {}
_ABANDONED = []
_DEFERRING = False   # see deferring()
_EARLY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # graph -> sessions
_CALLABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # session -> callables  # sessions left open because a run of theirs is stuck (see _session_close)


def parallel_graph(graph: tf.Graph | None) -> ParallelGraph | None:
    """The ParallelGraph of `graph` (in its record), or None if it was not parallelized."""
    record = record_of(graph, create=False) if graph is not None else None
    return record.result if record is not None else None


def _parallelize_if_needed(graph: tf.Graph) -> bool:
    """Rewrite `graph` if EPL annotated it and has not rewritten it yet. A session
    opened while `deferring()` (tf-keras opens its own before fit builds the training
    step) on a graph without a training step yet leaves it as it is: returns False
    (the graph is rewritten when its step exists, epl/hooks/legacy_keras.py)."""
    record = record_of(graph, create=False)
    if needs_parallelize(record):
        if capturing():   # epl.capture: stop the script here, before the rewrite
            raise CaptureStop(graph)
        if _DEFERRING and not has_training_step(record):
            return False
        parallelize(graph, record)
    return True


def _session_init(self, target="", graph=None, config=None):
    graph_ = graph if graph is not None else tf.compat.v1.get_default_graph()
    try:
        ready = _parallelize_if_needed(graph_)
    except BaseException:   # also epl.capture's CaptureStop
        self._session = None  # so BaseSession.__del__ of this half-built session is quiet
        raise
    result = parallel_graph(graph_)
    if result is not None:
        config = result.session_config(config)
    _ORIGINAL["init"](self, target, graph, config)
    if not ready or result is None:   # the graph may be rewritten later (legacy_keras)
        _EARLY.setdefault(graph_, weakref.WeakSet()).add(self)
    elif result.run_graph:   # what its runs need (epl/runtime/run_graph.py)
        attach_session(self, self._config)


def _partial_run_setup(self, fetches, feeds=None):
    """Session.partial_run_setup: on a run graph (`attach_session`) after copying in
    what the partial runs' fetches and feeds need (TensorFlow sets them up by name)."""
    runs = self.__dict__.get("_epl_run_graph")
    if runs is not None:
        ops = [_as_op(self.graph, e) for e in _leaves(fetches) + list(feeds or ())]
        runs.need([op.name for op in ops if op is not None])
    return _ORIGINAL["partial_run_setup"](self, fetches, feeds)


@contextlib.contextmanager
def deferring():
    """Sessions opened inside do not fail on an annotated graph that has no training
    step yet: they are kept (`early_sessions`) and moved onto the rewritten graph
    when the step exists (epl/hooks/late_rewrite.py). tf-keras's backend opens its
    session inside (epl/hooks/legacy_keras.py)."""
    global _DEFERRING
    saved, _DEFERRING = _DEFERRING, True
    try:
        yield
    finally:
        _DEFERRING = saved


def early_sessions(graph: tf.Graph) -> list:
    """The open sessions on `graph` created before it was rewritten (opened inside
    `deferring`, or before EPL annotated the graph)."""
    return [s for s in _EARLY.pop(graph, ()) if not s._closed and s._session is not None]


def session_resources(session) -> late_rewrite.ResourceLog | None:
    """What `session` (opened before its graph was rewritten) initialized: see
    epl.hooks.late_rewrite.ResourceLog; None if it ran nothing of that kind."""
    return session.__dict__.get("_epl_resources")


def _note_early_run(session, elements) -> None:
    """Note a run of a session on a graph EPL has not rewritten (yet), for a later move."""
    graph = session.graph
    if graph not in _EARLY or session not in _EARLY[graph]:
        return
    ops = [_as_op(graph, element) for element in elements]
    session.__dict__.setdefault("_epl_resources", late_rewrite.ResourceLog()).note(
        [op for op in ops if op is not None])


def session_callables(session) -> list:
    """The TensorFlow callables made on `session` (Session._make_callable_from_options)
    that still hold a handle."""
    return [c for c in _CALLABLES.get(session, ()) if c._handle is not None]


def _make_callable_from_options(self, callable_options):
    """A callable (what tf-keras's backend functions run): on a parallelized graph it
    runs through Session.run (`_callable_call`), which remaps the fetches, redirects
    the feeds and syncs the mirrors; on any other graph TensorFlow's own, noted, so
    that a later rewrite can release it (epl/hooks/late_rewrite.py)."""
    if parallel_graph(self.graph) is None:
        callable_ = _ORIGINAL["make_callable"](self, callable_options)
        _CALLABLES.setdefault(self, weakref.WeakSet()).add(callable_)
    else:
        callable_ = object.__new__(session_lib.BaseSession._Callable)
        callable_._session, callable_._handle = self, None
    callable_._epl_options = callable_options
    return callable_


def _make_callable(self, fetches, feed_list=None, accept_options=False):
    """Session.make_callable: on a parallelized graph a function that runs through
    Session.run (TensorFlow's own would skip the merges, the feed redirects and the
    mirrors' sync); on any other graph TensorFlow's own."""
    if parallel_graph(self.graph) is None:
        return _ORIGINAL["public_make_callable"](self, fetches, feed_list, accept_options)
    feeds = list(feed_list or [])

    def run(*args, **kwargs):
        if len(args) != len(feeds):
            raise TypeError(f"expected {len(feeds)} argument(s) (the feed_list's), got {len(args)}")
        if kwargs and not accept_options:
            raise TypeError("this callable was made without accept_options=True")
        return self.run(fetches, feed_dict=dict(zip(feeds, args)),
                        options=kwargs.get("options"), run_metadata=kwargs.get("run_metadata"))
    return run


def _callable_call(self, *args, **kwargs):
    options = self.__dict__.get("_epl_options")
    if options is None or self._handle is not None:
        if options is not None:
            _note_early_run(self._session, list(options.fetch) + list(options.target) + [
                c.from_tensor for c in options.tensor_connection])
        return _ORIGINAL["callable_call"](self, *args, **kwargs)
    fetches = list(options.fetch)
    feeds = dict(zip(options.feed, args))
    if options.tensor_connection:
        # a tensor fed from another tensor's value in the same run (tf-keras feeds its
        # inputs from a tf.data iterator's next element so): that value is fetched
        # first, then fed like an array (on a parallel graph the fed batch is then cut
        # among the units, as an array's is)
        connections = list(options.tensor_connection)
        drawn = self._session.run([c.from_tensor for c in connections])
        feeds.update({c.to_tensor: value for c, value in zip(connections, drawn)})
    values = self._session.run(fetches + list(options.target), feed_dict=feeds,
                               run_metadata=kwargs.get("run_metadata"))
    return values[:len(fetches)]


def _scaffold_finalize(self):
    _parallelize_if_needed(tf.compat.v1.get_default_graph())
    return _ORIGINAL["finalize"](self)


class _RunPlan:
    """Per fetch set: the remapped fetches and the sync ops to run afterwards."""

    def __init__(self, result: ParallelGraph, fetches):
        self.fetches = _remap(result, fetches)
        targets = [_as_op(result.graph, f) for f in _leaves(self.fetches)]
        written = _written_variables(result, [t for t in targets if t is not None])
        self.trains = any(t in result.view.train_ops for t in targets if t is not None)
        self.sync = [result.sync_ops[v] for v in written if v in result.sync_ops]
        self.gather = [result.gather_ops[v] for v in _read_variables(result, targets)]
        self.guards = _guards(result, fetches, targets, self) \
            if result.cluster.num_workers > 1 else {}
        above = ancestors([t for t in targets if t is not None])
        self.restores = [op for op in above if op.type in RESTORE_TYPES]
        self.saves = any(op.type in SAVE_TYPES for op in above)


class _Guard:
    """What bounding one run of a multi-worker graph needs (epl.runtime.guarded_run)."""

    def __init__(self, collectives: list, training: bool, fetch_names: list[str]):
        self.collectives, self.training, self.fetch_names = collectives, training, fetch_names


def _guards(result: ParallelGraph, fetches, targets, plan: "_RunPlan") -> dict:
    """{"gather"/"fetch"/"sync": _Guard} of a plan's runs: their cross-worker
    collectives [(op name, what it carries)], in creation order."""

    def collectives(ops):
        found = [op for op in ancestors([op for op in ops if op is not None])
                 if op.type in HOROVOD_COLLECTIVE_TYPES]
        return [(op.name, collective_label(op)) for op in sorted(found, key=lambda o: o._id)]

    names = [getattr(f, "name", None) or str(f) for f in _leaves(fetches)]
    return {"gather": _Guard(collectives(plan.gather), False, ["(gathers before a save)"]),
            "fetch": _Guard(collectives(targets), plan.trains, names),
            "sync": _Guard(collectives(plan.sync), False, ["(variable sync after a write)"])}


def _as_op(graph, fetch):
    try:
        element = graph.as_graph_element(fetch)
    except (TypeError, ValueError, KeyError):
        return None
    return element if isinstance(element, tf.Operation) else element.op


def _remap(result: ParallelGraph, fetches):
    def one(fetch):
        element = fetch
        if isinstance(fetch, str):
            try:
                element = result.graph.as_graph_element(fetch)
            except (TypeError, ValueError, KeyError):
                return fetch
        if not isinstance(element, tf.Tensor):
            return fetch
        if element in result.fetch_map:
            return result.fetch_map[element]
        copy = _per_replica_fetch(result, element)
        return fetch if copy is None else copy
    return _map_fetches(one, fetches)


def _per_replica_fetch(result: ParallelGraph, tensor: tf.Tensor) -> tf.Tensor | None:
    """A fetch of a tensor that has one value per replica and is in no merge collection
    (docs/consistency.md): the first unit's copy
    (replica 0, micro-batch 0), with a warning once per tensor naming the collections;
    a tensor built after the rewrite on such tensors (it runs the model as replica 0
    sees it) gets the warning too. Returns the copy, or None to fetch `tensor` itself."""
    replication = result.replication
    if replication is None or not replication.forward_copies:
        return None
    first = replication.units()[0]
    copy = replication.copy_in(tensor, first)
    warned = result.__dict__.setdefault("_epl_warned_fetches", set())
    if copy is None:
        templates = result.__dict__.get("_epl_templates")
        if templates is None:
            templates = result.__dict__["_epl_templates"] = set(
                replication.forward_copies[first])
        if tensor.name in warned or tensor.op._id <= result.ops_after_rewrite \
                or not varying_tensor(tensor, templates):
            return None
    if tensor.name not in warned:
        warned.add(tensor.name)
        what = ("has one value per replica and micro-batch" if copy is not None else
                "was built after EPL rewrote the graph, on tensors that have one value per "
                "replica")
        logging.getLogger("epl").warning(
            "fetching %s, which %s and is in no EPL merge collection: it returns replica 0's "
            "value (its first micro-batch's). For the value over the global batch, add it to "
            "epl.GraphKeys.GLOBAL_MEAN_OBJECTS (a mean over examples), GLOBAL_SUM_OBJECTS (a "
            "sum or count) or GLOBAL_CONCAT_OBJECTS (one row per example) with "
            "epl.add_to_collection before the first session.", tensor.name, what)
    # a copy a unit function returns: its call's output (the copy itself is left unread)
    return result.unit_outputs.get(copy, copy)


def _map_fetches(fn, fetches):
    """Apply `fn` to every leaf of a Session.run fetch structure (lists, tuples,
    namedtuples, dicts with any keys), keeping the structure."""
    if isinstance(fetches, dict):
        return type(fetches)((k, _map_fetches(fn, v)) for k, v in fetches.items())
    if isinstance(fetches, tuple) and hasattr(fetches, "_fields"):
        return type(fetches)(*[_map_fetches(fn, v) for v in fetches])
    if isinstance(fetches, (list, tuple)):
        return type(fetches)(_map_fetches(fn, v) for v in fetches)
    return fn(fetches)


def _leaves(fetches) -> list:
    leaves = []
    _map_fetches(leaves.append, fetches)
    return leaves


def _written_variables(result: ParallelGraph, targets) -> list:
    """Original mirrored variables that ops outside the training step write
    (reads, such as a hook's `cond` on the global step, are not writes)."""
    originals = {var.outputs[0]: var for var in result.sync_ops}
    if not originals:
        return []
    written = []
    for op in ancestors(targets):
        if op in result.view.step_ops:
            continue
        for index, tensor in enumerate(op.inputs):
            var = originals.get(tensor)
            if var is not None and var not in written and writes_variable(op, index):
                written.append(var)
    return sorted(written, key=lambda v: v._id)


def _read_variables(result: ParallelGraph, targets) -> list:
    """Variables with a `gather_ops` entry (ZeRO's sharded slots) that ops outside
    the training step read (a Saver's save): their shards are gathered first."""
    if not result.gather_ops or not targets:
        return []
    handles = {var.outputs[0]: var for var in result.gather_ops}
    read = []
    for op in ancestors(targets):
        if op.type != "ReadVariableOp" or op in result.view.step_ops:
            continue
        var = handles.get(op.inputs[0])
        if var is not None and var not in read:
            read.append(var)
    return sorted(read, key=lambda v: v._id)


def _fetch_key(fetches):
    """A cache key for a fetch structure: its shape and the identity of its leaves."""
    leaves = _leaves(fetches)
    shape = _map_fetches(lambda _: 0, fetches)
    return tuple(f if isinstance(f, str) else id(f) for f in leaves), repr(shape)


def _session_run(self, fetches, feed_dict=None, options=None, run_metadata=None):
    result = parallel_graph(self.graph)
    if result is None:
        if _EARLY:
            _note_early_run(self, _leaves(fetches))
        return _ORIGINAL["run"](self, fetches, feed_dict, options, run_metadata)
    cache = self.__dict__.setdefault("_epl_run_plans", {})
    key = (_fetch_key(fetches), len(result.graph.get_operations()))
    plan = cache.get(key) if key[0] is not None else None
    if plan is None:
        plan = _RunPlan(result, fetches)
        if key[0] is not None:
            cache[key] = plan
    if feed_dict:
        feed_dict = _redirect_feeds(result, feed_dict)
    check = result.gradient_check is not None and result.gradient_check_max_diff is None \
        and plan.trains   # compared in the first training run itself (_check_gradients)
    fetches = [plan.fetches, gradient_pairs(*result.gradient_check)] if check else plan.fetches
    started = time.time()
    with _user_terms(self, result, plan, feed_dict):
        if plan.gather:
            _bounded(result, lambda: _ORIGINAL["run"](self, plan.gather), self, plan, "gather")
        if result.tracer is not None:  # debug.trace_dir: FULL_TRACE for the chosen steps
            options, run_metadata = result.tracer.before_run(plan.trains, options, run_metadata)
        values = _bounded(result, lambda: _ORIGINAL["run"](self, fetches, feed_dict, options,
                                                          run_metadata), self, plan, "fetch")
        if check:
            values = _check_gradients(result, values)
        if result.tracer is not None:
            result.tracer.after_run(run_metadata)
        if plan.sync:
            _bounded(result, lambda: _ORIGINAL["run"](self, plan.sync), self, plan, "sync")
    if plan.restores:
        _note_restore(self, plan, feed_dict, time.time() - started)
    return values


@contextlib.contextmanager
def _user_terms(session, result: ParallelGraph, plan: _RunPlan, feed_dict):
    """A TensorFlow error of the run is raised in the user's terms (the user's ops for
    EPL's copies, the worker and the step; a damaged or unwritable checkpoint named
    with its file and what is wrong): epl.runtime.run_errors."""
    try:
        yield
    except tf.errors.OpError as err:
        path = _fed_path(feed_dict) if plan.saves or plan.restores else None
        err = _cause_in_copies(session, result, err, feed_dict)
        raise run_errors.rewrite(err, result, _read_step(session),
                                 saving=path if plan.saves else None,
                                 restoring=path if plan.restores else None) from None


# what a step's copies may hold and still run again with no effect on training: reading
# variables and fed values (a draw from an iterator or a random op would move its stream);
# a reference variable's op only looks its variable up (the unit functions' calls wait for
# one: epl.passes.unit_functions.ref_scan_marks)
_RERUNNABLE_STATEFUL = frozenset({"VarHandleOp", "ReadVariableOp", "VarIsInitializedOp",
                                  "VariableV2", "Placeholder", "PlaceholderV2",
                                  "PlaceholderWithDefault"})

_RERUN_TRIES = 3

_UNEXPLAINED = (
    "This step ran EPL's unit functions (pipeline.unit_functions): when an op inside one "
    "of them fails, TensorFlow may report the cancellation of the others instead of the "
    "failure. If nothing else cancelled the step, TensorFlow's log above names the op that "
    "failed (\"Local rendezvous is aborting with status: ...\"); with "
    "pipeline.unit_functions set to False, this error is that op's.")


def _cause_in_copies(session, result: ParallelGraph, err: tf.errors.OpError,
                     feed_dict) -> tf.errors.OpError:
    """The error of a failed step named by the op that failed, where it failed inside a
    unit function's call (epl/passes/unit_functions.py).

    TensorFlow names a failure inside a call by the call and the body's node ("n2"),
    and it may not report the failure at all: it cancels the step's other calls and
    transfers and may report one of those cancellations ("RecvAsync is cancelled")
    instead, the failure only logged. So, for a cancelled step or an error raised by a
    call:
    - a cancelled step: a variable a call reads that is not initialized
      (`_uninitialized_instead`);
    - where the copies the calls replaced (unread in the graph) need only variables
      and the run's feeds, the session runs them again with the same feeds, which
      changes nothing, and returns the first error they raise: the failing op's own,
      named as without unit functions;
    - else a cancellation says what it may hide and where to look; a call's own
      error stays as it is."""
    calls = _unit_calls(result)
    cancelled = isinstance(err, tf.errors.CancelledError)
    if not calls or not (cancelled or err.op in calls):
        return err
    if cancelled:
        cause = _uninitialized_instead(session, result, err)
        if cause is not err:
            return cause
    copies = _rerunnable_copies(result, calls)
    # the copies may read ops the pass kept outside, which read calls: the rerun runs
    # those calls too, and which failure TensorFlow reports is a race again; a few tries
    # (each changes nothing) find the failing op's own error
    for _ in range(_RERUN_TRIES if copies else 0):
        try:
            _ORIGINAL["run"](session, copies, feed_dict)
            break
        except tf.errors.CancelledError:
            continue
        except tf.errors.OpError as found:
            return found
    if not cancelled:
        return err
    return tf.errors.CancelledError(err.node_def, err.op, "%s\n%s" % (err.message, _UNEXPLAINED))


def _unit_calls(result: ParallelGraph) -> frozenset:
    """The unit functions' call ops of `result`'s step (cached per graph)."""
    calls = result.__dict__.get("_epl_unit_calls")
    if calls is None:
        calls = result.__dict__["_epl_unit_calls"] = frozenset(
            t.op for t in result.unit_outputs.values())
    return calls


def _rerunnable_copies(result: ParallelGraph, calls: frozenset) -> list:
    """The copies' tensors the unit functions' calls return (`ParallelGraph.unit_outputs`),
    if everything they need is side-effect free to run again (_RERUNNABLE_STATEFUL, and
    the `calls`, whose bodies only compute and read variables: a copy may read an op
    the pass kept outside, which reads the calls); else []. Cached per graph."""
    cached = result.__dict__.get("_epl_rerunnable_copies")
    if cached is None:
        copies = sorted(result.unit_outputs, key=lambda t: (t.op._id, t.value_index))
        needed = ancestors([t.op for t in copies])
        safe = all(not op.op_def.is_stateful or op.type in _RERUNNABLE_STATEFUL
                   or op in calls for op in needed)
        cached = result.__dict__["_epl_rerunnable_copies"] = copies if safe else []
    return cached


def _uninitialized_instead(session, result: ParallelGraph, err: tf.errors.CancelledError):
    """A FailedPreconditionError naming the first variable that a unit function reads
    and that is not initialized, if there is one (the real cause of a step that
    another partition cancelled: epl.passes.unit_functions.initialized_check);
    else `err`."""
    if not result.initialized:
        return err
    try:
        values = _ORIGINAL["run"](session, [check for _, check in result.initialized])
    except (tf.errors.OpError, RuntimeError):
        return err
    missing = [variable for (variable, _), ok in zip(result.initialized, values) if not ok]
    if not missing:
        return err
    variable = missing[0]
    return tf.errors.FailedPreconditionError(
        variable.node_def, variable, "%s\nCould not find variable %s (not initialized; %d of "
        "the step's variables are not)" % (err.message, variable.name, len(missing)))


def _read_step(session) -> int | None:
    """The global step, or None when it cannot be read (not initialized, no global step)."""
    reader = _step_reader(session)
    try:
        return int(reader()) if reader is not None else None
    except (tf.errors.OpError, TypeError, ValueError):
        return None


def _fed_path(feed_dict) -> str | None:
    """The checkpoint path a Saver feeds (the one string it feeds), or None."""
    for value in (feed_dict or {}).values():
        value = value.decode() if isinstance(value, bytes) else value
        if isinstance(value, str):
            return value
    return None


def _note_restore(session, plan: _RunPlan, feed_dict, seconds: float) -> None:
    """After a restore (that took `seconds`): log the checkpoint and the global step it
    holds; under epl-launch (EPL_LAUNCH_EVENTS set) also tell the launcher, which logs
    the step a restarted job resumed from."""
    path = _fed_value(feed_dict, plan.restores[0].inputs[0])
    step = _read_step(session)
    logging.getLogger("epl").info("restored the variables from %s (global step %s) in %.2f s",
                                  path or "a checkpoint", step, seconds)
    if os.environ.get("EPL_LAUNCH_EVENTS"):
        event = {"event": "restored", "global_step": step, "checkpoint": path,
                 "seconds": round(seconds, 3)}
        print("epl-launch-event: " + json.dumps(event), file=sys.stderr, flush=True)


def _fed_value(feed_dict, tensor: tf.Tensor) -> str | None:
    """The string fed for `tensor` (a Saver feeds the checkpoint path), or None."""
    for key, value in (feed_dict or {}).items():
        if key is tensor or key == tensor.name or getattr(key, "name", None) == tensor.name:
            value = value.decode() if isinstance(value, bytes) else value
            return value if isinstance(value, str) else None
    return None


def _redirect_feeds(result: ParallelGraph, feed_dict: dict) -> dict:
    """The feed with every fed static-batch placeholder moved onto EPL's placeholder
    of every unit's rows (io.batch_mode "replica"; inputs.FeedRedirect), and every
    other fed tensor the model copied per unit or replica fed to each copy too (a fed
    tensor means the same in every copy)."""
    redirected = {}
    fed = set(feed_dict)
    for key, value in feed_dict.items():
        tensor = key
        if isinstance(key, str):
            try:
                tensor = result.graph.as_graph_element(key)
            except (TypeError, ValueError, KeyError):
                tensor = None
        redirect = result.feeds.get(tensor) if isinstance(tensor, tf.Tensor) else None
        if redirect is None or redirect.widened in fed:   # already redirected
            redirected[key] = value
            for copy in _copies_of(result, tensor):
                if copy.op in result.outlined:
                    raise ParallelizeError(
                        f"the feed of {tensor.name} cannot reach the training step: EPL "
                        "computes it inside a unit function (epl/passes/unit_functions.py: "
                        "each micro-batch's and replica's work as one function call), which "
                        "a feed does not enter. Feed a placeholder (tf.compat.v1.placeholder "
                        "or placeholder_with_default) instead of a computed tensor, or set "
                        "pipeline.unit_functions to False (the copies run, and a feed "
                        "reaches them).")
                redirected.setdefault(copy, value)
        else:
            redirected.update(redirect.feeds(value))
    return redirected


def _copies_of(result: ParallelGraph, tensor) -> list:
    """The copies of a fed tensor (cached per tensor)."""
    if not isinstance(tensor, tf.Tensor) or result.replication is None:
        return []
    cache = result.__dict__.setdefault("_epl_feed_copies", {})
    if tensor not in cache:
        cache[tensor] = result.replication.copies_of(tensor)
    return cache[tensor]


def _check_gradients(result: ParallelGraph, values: list):
    """gradient_checkpoint.check_gradients: the first training run also fetched both
    gradient lists (without checkpointing, on the same forward copies: no extra draw
    from the input or the random ops, so training is exactly as without the check);
    log their largest difference and return the run's own values."""
    reference, checkpointed = result.gradient_check
    values, pairs = values
    result.gradient_check_max_diff = gradient_difference(pairs, reference, checkpointed)
    logging.getLogger(__name__).warning(
        "gradient_checkpoint.check_gradients: largest absolute difference between the "
        "gradients with and without checkpointing on the first step: %.3g",
        result.gradient_check_max_diff)
    return values


def _bounded(result: ParallelGraph, run, session, plan: _RunPlan, part: str):
    """Run `run()`, one of `plan`'s runs (`part`: "gather", "fetch" or "sync"); with
    several workers, compared with the other workers' first, bounded by
    communication.collective_timeout_s and explained when it fails
    (epl.runtime.guarded_run)."""
    if result.cluster.num_workers == 1:
        return run()
    guard = plan.guards[part]
    return guarded_run(run, timeout_s=result.timeout_s, collectives=guard.collectives,
                       training=guard.training, step_reader=_step_reader(session),
                       fetch_names=guard.fetch_names,
                       agreed=result.__dict__.setdefault("_epl_agreed_runs", set()),
                       graph=result.graph)


def _step_reader(session):
    """A function reading the global step of `session`'s graph (None: it has none)."""
    cached = session.__dict__.get("_epl_step_reader", False)
    if cached is not False:
        return cached
    step = tf.compat.v1.train.get_global_step(session.graph)
    reader = None if step is None else (lambda: _ORIGINAL["run"](session, step))
    session.__dict__["_epl_step_reader"] = reader
    return reader


def _session_close(self):
    """Before a multi-worker session closes, note its global step: a peer that
    outlives this worker says after which step it left (epl.runtime.worker_status).
    After a run of it was abandoned in a collective that never completes (the job
    failed on a timeout, epl.runtime.guarded_run), TensorFlow's close would wait for
    that run: the session is only marked closed (and kept, so that deleting it
    does not wait either); the process is about to exit."""
    graph = getattr(self, "_graph", None)
    result = parallel_graph(graph) if graph is not None and not getattr(self, "_closed", True) \
        else None
    if result is not None and result.cluster.num_workers > 1:
        if STATUS.abandoned:
            self._closed = True
            _ABANDONED.append(self)
            return None
        STATUS.read_step()
    return _ORIGINAL["close"](self)


def _saver_restore(self, sess, save_path):
    """Saver.restore of a parallelized graph: a checkpoint whose index file is gone
    (TensorFlow: "not a valid checkpoint") is named with what is wrong."""
    try:
        return _ORIGINAL["restore"](self, sess, save_path)
    except ValueError as err:
        graph = getattr(sess, "graph", None)
        problem = damage.diagnose(str(save_path)) if save_path and graph is not None \
            and parallel_graph(graph) is not None else None
        if problem is None:
            raise
        raise CheckpointError("cannot restore the checkpoint %s: %s. %s" % (
            save_path, problem, run_errors.older_checkpoint(str(save_path)))) from None


def install() -> None:
    """Wrap BaseSession.__init__/run/partial_run_setup/close/make_callable/
    _make_callable_from_options,
    its callables' __call__, Scaffold.finalize and Saver.restore (idempotent)."""
    if _ORIGINAL:
        return
    base = session_lib.BaseSession
    scaffold = tf.compat.v1.train.Scaffold
    saver = tf.compat.v1.train.Saver
    _ORIGINAL.update(init=base.__init__, run=base.run, finalize=scaffold.finalize,
                     close=base.close, restore=saver.restore,
                     make_callable=base._make_callable_from_options,
                     partial_run_setup=base.partial_run_setup,
                     public_make_callable=base.make_callable,
                     callable_call=base._Callable.__call__)
    base._make_callable_from_options = functools.wraps(_ORIGINAL["make_callable"])(
        _make_callable_from_options)
    base._Callable.__call__ = functools.wraps(_ORIGINAL["callable_call"])(_callable_call)
    base.make_callable = functools.wraps(_ORIGINAL["public_make_callable"])(_make_callable)
    base.__init__ = functools.wraps(_ORIGINAL["init"])(_session_init)
    base.run = functools.wraps(_ORIGINAL["run"])(_session_run)
    base.partial_run_setup = functools.wraps(_ORIGINAL["partial_run_setup"])(
        _partial_run_setup)
    base.close = functools.wraps(_ORIGINAL["close"])(_session_close)
    scaffold.finalize = functools.wraps(_ORIGINAL["finalize"])(_scaffold_finalize)
    saver.restore = functools.wraps(_ORIGINAL["restore"])(_saver_restore)
