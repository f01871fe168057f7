"""A graph rewritten after a session on it has run: the session is moved onto a new
TensorFlow session that sees the rewritten graph, with the variables' values.

tf-keras (legacy Keras) in graph mode opens its session, and runs initializers and
assigns in it, before `fit` builds the training step (epl/hooks/legacy_keras.py). EPL
parallelizes once the step exists, and by then that session has run. A session that
has run has sent every op that existed then to TensorFlow's runtime, and later
changes to those ops (the passes set devices, inputs, attributes) have no effect
there (TensorFlow: "This mutation will have no effect ... create a new session").
So, for each such session (epl.hooks.session.early_sessions):

1. before the rewrite, the value of every variable it has initialized is read
   (`read_state`);
2. after it, the Python session object keeps its identity (Keras's cached session,
   the user's `sess`), but its TensorFlow session is replaced by a new one on the
   rewritten graph, under the config that creates EPL's devices
   (`move_session`); callables made on the old one are released, and run through
   `Session.run` from then on (epl.hooks.session routes a parallel graph's
   callables there);
3. in the new session every known variable's initializer runs, fed the value read
   in 1 where there is one (`Variable.load`'s way), in one `Session.run`: EPL's
   run hook then copies the written originals into their replicas' mirrors, and
   initializers EPL attached to the model's (AMP's loss scale) run with them;
4. the iterators and tables the old session initialized (`ResourceLog`, kept while
   it ran: tf-keras initializes a dataset's iterator before fit builds the step)
   are initialized again, in the order it did. An iterator the old session also
   read from after initializing it has a position the new session cannot take
   over: it is left uninitialized there, so that a later read fails with
   TensorFlow's "iterator has not been initialized" instead of restarting from
   the first batch (tf-keras's `evaluate` of a dataset before `fit` reads an
   iterator of its own, which it does not read again).
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.python.client import pywrap_tf_session as tf_session

from epl.ir.graph_view import ancestors
from epl.parallel import ParallelGraph, clean_construction_context
from epl.runtime.run_graph import attach_session


@dataclasses.dataclass
class SessionState:
    """What one session held before the rewrite: {variable: value} of the variables it
    had initialized, and every variable known (to initialize in the new session)."""

    values: dict
    variables: list


# Ops that initialize a resource other than a variable, and ops that read an
# iterator (advance its position).
RESOURCE_INIT_TYPES = frozenset({"MakeIterator", "InitializeTableV2", "InitializeTable",
                                 "InitializeTableFromTextFileV2", "LookupTableImportV2"})
ITERATOR_READ_TYPES = frozenset({"IteratorGetNext", "IteratorGetNextSync",
                                 "IteratorGetNextAsOptional"})


class ResourceLog:
    """What a session ran before the rewrite that a new session must run again: the
    resource initializers (in order; each once, at its last run), and the iterators
    read after their last initialization."""

    def __init__(self):
        self.inits: list = []
        self.read_after_init: dict = {}   # iterator handle op -> the read op
        self._cache: dict = {}

    def note(self, ops: list) -> None:
        """Note a run whose targets and fetches are `ops` (graph elements' ops)."""
        key = tuple(op._id for op in ops)
        found = self._cache.get(key)
        if found is None:
            above = ancestors(ops)
            found = self._cache[key] = (
                sorted((op for op in above if op.type in RESOURCE_INIT_TYPES),
                       key=lambda o: o._id),
                [op for op in above if op.type in ITERATOR_READ_TYPES])
        inits, reads = found
        for op in inits:
            if op in self.inits:
                self.inits.remove(op)
            self.inits.append(op)
            if op.type == "MakeIterator":
                self.read_after_init.pop(op.inputs[1].op, None)
        for op in reads:
            self.read_after_init[op.inputs[0].op] = op

    def replay(self, session) -> None:
        """Run the noted initializers in `session`, in order, but those of iterators
        read since (left uninitialized: their position is lost)."""
        inits = [op for op in self.inits
                 if op.type != "MakeIterator" or op.inputs[1].op not in self.read_after_init]
        if inits:
            session.run(inits)


def known_variables(graph: tf.Graph, extra=()) -> list:
    """The graph's variables EPL can initialize: its variable collections and `extra`
    (objects that keep variables outside them: a Keras model's metrics and optimizer),
    one per variable op, in creation order."""
    keys = (tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
            tf.compat.v1.GraphKeys.METRIC_VARIABLES, tf.compat.v1.GraphKeys.MODEL_VARIABLES)
    found = {}
    for variable in [v for key in keys for v in graph.get_collection(key)] + list(extra):
        if isinstance(variable, tf.Variable) and variable.graph is graph:
            found.setdefault(variable.op, variable)
    return [found[op] for op in sorted(found, key=lambda op: op._id)]


def read_state(session, variables: list) -> SessionState:
    """The values `session` holds for `variables` (those it initialized); call before
    the rewrite (the ops it adds are plain reads, outside every scope)."""
    graph = session.graph
    if not variables:
        return SessionState({}, [])
    with clean_construction_context(graph):
        checks = []
        for variable in variables:
            with tf.compat.v1.colocate_with(variable.op):
                checks.append(tf.compat.v1.is_variable_initialized(variable))
    initialized = session.run(checks)
    live = [v for v, ok in zip(variables, initialized) if ok]
    with clean_construction_context(graph):
        reads = []
        for variable in live:
            with tf.compat.v1.colocate_with(variable.op):
                reads.append(variable.value())
    values = session.run(reads) if reads else []
    return SessionState(dict(zip(live, values)), list(variables))


def move_session(session, result: ParallelGraph, state: SessionState, callables=(),
                 resources: ResourceLog | None = None) -> None:
    """Replace `session`'s TensorFlow session by a new one on the rewritten graph and
    load `state` into it, then initialize again the `resources` it had initialized
    (see the module docstring). `callables`: the `_Callable`s made on the old one
    (their handles are released; they run through Session.run)."""
    config = result.session_config(session._config)
    old = session._session
    for callable_ in callables:
        if callable_._handle is not None:
            tf_session.TF_SessionReleaseCallable(old, callable_._handle)
            callable_._handle = None
    if result.run_graph:   # a session on what its runs need (epl/runtime/run_graph.py)
        attach_session(session, config, close_old=False)
    else:
        options = tf_session.TF_NewSessionOptions(target=session._target, config=config)
        try:
            with session._graph._c_graph.get() as c_graph:
                session._session = tf_session.TF_NewSessionRef(c_graph, options)
        finally:
            tf_session.TF_DeleteSessionOptions(options)
    session._config = config
    for cache in ("_epl_run_plans", "_epl_step_reader"):
        session.__dict__.pop(cache, None)
    tf_session.TF_CloseSession(old)
    tf_session.TF_DeleteSession(old)
    load_state(session, state)
    if resources is not None:
        resources.replay(session)


def load_state(session, state: SessionState) -> None:
    """Run every known variable's initializer in `session`, the ones with a value in
    `state` fed that value."""
    if not state.variables:
        return
    feeds = {v.initializer.inputs[1]: value for v, value in state.values.items()}
    session.run([v.initializer for v in state.variables], feed_dict=feeds)
