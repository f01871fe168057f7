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
   initializers EPL attached to the model's (AMP's loss scale) run with them.
"""
from __future__ import annotations

import dataclasses

import tensorflow as tf
from tensorflow.python.client import pywrap_tf_session as tf_session

from epl.parallel import ParallelGraph, clean_construction_context


@dataclasses.dataclass
class SessionState:
    """What one session held before the rewrite: {variable: value} of the variables it
    had initialized, and every variable known (to initialize in the new session)."""

    values: dict
    variables: list


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


def move_session(session, result: ParallelGraph, state: SessionState, callables=()) -> None:
    """Replace `session`'s TensorFlow session by a new one on the rewritten graph and
    load `state` into it (see the module docstring). `callables`: the `_Callable`s
    made on the old one (their handles are released; they run through Session.run)."""
    config = result.session_config(session._config)
    options = tf_session.TF_NewSessionOptions(target=session._target, config=config)
    try:
        with session._graph._c_graph.get() as c_graph:
            new = tf_session.TF_NewSessionRef(c_graph, options)
    finally:
        tf_session.TF_DeleteSessionOptions(options)
    old = session._session
    for callable_ in callables:
        if callable_._handle is not None:
            tf_session.TF_SessionReleaseCallable(old, callable_._handle)
            callable_._handle = None
    session._session, session._config = new, config
    for cache in ("_epl_run_plans", "_epl_step_reader"):
        session.__dict__.pop(cache, None)
    tf_session.TF_CloseSession(old)
    tf_session.TF_DeleteSession(old)
    load_state(session, state)


def load_state(session, state: SessionState) -> None:
    """Run every known variable's initializer in `session`, the ones with a value in
    `state` fed that value."""
    if not state.variables:
        return
    feeds = {v.initializer.inputs[1]: value for v, value in state.values.items()}
    session.run([v.initializer for v in state.variables], feed_dict=feeds)
