"""The graph a parallelized graph's sessions run: the ops their runs need, copied in on demand.

Why: a rewritten graph holds far more than any run needs. The unit_functions pass
leaves the copies it replaced by calls in the graph, unread (TensorFlow's graph API
removes no op), and the model as the user built it stays as the template, never
run. A TensorFlow session copies and converts its whole graph at every new set of
fetches (`GraphExecutionState::MakeForPrunedGraph`, even with `place_pruned_graph`):
at 24 layers and 16 micro-batches (bench/startup.py's encoder) 108,530 nodes; the
run graph after the initializer's run and two sets of training fetches holds 8,976.

So a session of a parallelized graph runs a graph of its own, the run graph: a
TensorFlow graph that holds the ops its runs have needed so far, each with the
definition and device it has in the user's graph (`debug.whole_graph_sessions` turns
this off). `attach_session` gives a session a TensorFlow session on the run graph and
takes over the one place where TensorFlow's Session hands a run to it
(`_call_tf_sessionrun`, set on the instance): the run's fetches, feeds and targets,
the user's graph's, are looked up by name in the run graph (`RunGraph.run_args`)
after copying in what they need and the run graph lacks (`RunGraph.need`): their
ancestors through data and control inputs and the ops they are colocated with (a
`_class` attribute names them), with every library function of the user's graph.
Everything above that place (the fetch structures, the feed conversion, EPL's own
hooks in epl/hooks/session.py) is TensorFlow's and EPL's as for any session.

An op keeps its name in the run graph unless the run graph already holds an op
named under it ("a/b" once "a/b/c" came in: TensorFlow's import refuses the name of
an existing op's scope, and a copy's variable read is named under the copy): it then
gets another, and the lookup finds it by the user's name all the same. A partial
run's setup names its fetches and feeds to TensorFlow itself, so a fetch of such an
op cannot be set up (epl/hooks/session.py copies in what the setup names).

Ops are only ever added to the run graph, as TensorFlow's session only ever extends
its graph: an op of the user's graph changed after a run copied it is not changed
there (TensorFlow's own session does not see such a change either: it warns that it
has no effect). Every session of one graph shares its run graph.
"""
from __future__ import annotations

import functools
import threading
import weakref

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.client import pywrap_tf_session as c_api
from tensorflow.python.framework import c_api_util

_COLOCATION = "_class"
_LOCATION_PREFIX = b"loc:@"
_RUN_GRAPHS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # graph -> RunGraph


def attach_session(session, config, close_old: bool = True) -> None:
    """Run `session` (a `tf.compat.v1.Session` of a parallelized graph) on its graph's
    run graph: its TensorFlow session is replaced by a new one on the run graph
    (created with `config`; the old one closed unless `close_old` is False), and its
    runs' feeds, fetches and targets are translated to the run graph's ops where
    TensorFlow's Session hands them to its session (`_call_tf_sessionrun` and
    `_call_tf_sessionprun`, set on the instance)."""
    runs = run_graph(session._graph)
    old, session._session = session._session, runs.new_session(session._target, config)
    ref = weakref.ref(session)   # no cycle through the session's own attributes
    session.__dict__["_epl_run_graph"] = runs
    session.__dict__["_call_tf_sessionrun"] = functools.partial(_run, ref, runs)
    session.__dict__["_call_tf_sessionprun"] = functools.partial(_partial_run, ref, runs)
    if close_old and old is not None:
        c_api.TF_CloseSession(old)
        c_api.TF_DeleteSession(old)


def _run(ref, runs, options, feed_dict, fetch_list, target_list, run_metadata):
    """BaseSession._call_tf_sessionrun of a session on a run graph (TensorFlow extended
    the session before: it extends it again when the run graph grew)."""
    session = ref()
    feeds, fetches, targets = runs.run_args(feed_dict, fetch_list, target_list)
    c_api.ExtendSession(session._session)
    return c_api.TF_SessionRun_wrapper(session._session, options, feeds, fetches, targets,
                                       run_metadata)


def _partial_run(ref, runs, handle, feed_dict, fetch_list):
    """BaseSession._call_tf_sessionprun of a session on a run graph."""
    session = ref()
    feeds, fetches, _ = runs.run_args(feed_dict, fetch_list, [])
    return c_api.TF_SessionPRun_wrapper(session._session, handle, feeds, fetches)


def run_graph(graph: tf.Graph) -> "RunGraph":
    """The run graph of `graph` (made at the first call)."""
    found = _RUN_GRAPHS.get(graph)
    if found is None:
        found = _RUN_GRAPHS[graph] = RunGraph(graph)
    return found


class RunGraph:
    """The ops of `graph` its sessions' runs have needed, in a TensorFlow graph of their
    own (module docstring)."""

    def __init__(self, graph: tf.Graph):
        self._graph = weakref.ref(graph)
        self.graph = tf.Graph()           # the run graph
        self._ops: dict = {}              # name -> the run graph's TF_Operation
        self._lock = threading.Lock()     # runs may come from several threads

    def __len__(self) -> int:
        return len(self._ops)

    def new_session(self, target: str, config) -> object:
        """A TensorFlow session (`TF_NewSessionRef`) on the run graph."""
        options = c_api.TF_NewSessionOptions(target=target, config=config)
        try:
            with self.graph._c_graph.get() as c_graph:   # pylint: disable=protected-access
                return c_api.TF_NewSessionRef(c_graph, options)
        finally:
            c_api.TF_DeleteSessionOptions(options)

    def need(self, names) -> int:
        """Copy into the run graph what the ops named `names` need and it lacks (module
        docstring); returns how many ops were copied."""
        graph = self._graph()
        with self._lock:
            nodes = self._missing(graph, names)
            if nodes:
                self._functions(graph)
                self._import(graph, nodes)
            return len(nodes)

    def run_args(self, feed_dict: dict, fetch_list: list, target_list: list) -> tuple:
        """A session run's feeds ({TF_Output: value}), fetches ([TF_Output]) and targets
        ([TF_Operation]) of the user's graph as the run graph's, after copying in what
        they need."""
        name = c_api.TF_OperationName
        feeds = [(name(output.oper), output.index, value) for output, value in feed_dict.items()]
        fetches = [(name(output.oper), output.index) for output in fetch_list]
        targets = [name(op) for op in target_list]
        self.need([f[0] for f in feeds] + [f[0] for f in fetches] + targets)
        ops = self._ops
        return ({c_api_util.tf_output(ops[op], index): value for op, index, value in feeds},
                [c_api_util.tf_output(ops[op], index) for op, index in fetches],
                [ops[op] for op in targets])

    def _missing(self, graph: tf.Graph, names) -> list:
        """The NodeDefs of the ops named `names` and of their ancestors and colocation
        targets that the run graph lacks, read from the C graph (what TensorFlow runs)."""
        by_name = graph._nodes_by_name   # pylint: disable=protected-access
        nodes, seen = [], set()
        stack = list(names)
        while stack:
            name = stack.pop()
            if name in seen or name in self._ops:
                continue
            seen.add(name)
            node = node_def_pb2.NodeDef.FromString(by_name[name]._node_def)  # pylint: disable=protected-access
            nodes.append(node)
            for source in node.input:
                stack.append(source.lstrip("^").partition(":")[0])
            if _COLOCATION in node.attr:
                stack.extend(location[len(_LOCATION_PREFIX):].decode()
                             for location in node.attr[_COLOCATION].list.s
                             if location.startswith(_LOCATION_PREFIX))
        return nodes

    def _functions(self, graph: tf.Graph) -> None:
        """Every library function of `graph` the run graph lacks."""
        for name, function in list(graph._functions.items()):   # pylint: disable=protected-access
            if not self.graph._is_function(name):   # pylint: disable=protected-access
                self.graph._add_function(function)   # pylint: disable=protected-access

    def _import(self, graph: tf.Graph, nodes: list) -> None:
        """Import `nodes` into the run graph, their inputs from earlier imports mapped
        to the run graph's ops of those names."""
        names = {node.name for node in nodes}
        for node in nodes:   # colocated with an op an earlier import gave another name
            if _COLOCATION in node.attr:
                locations = node.attr[_COLOCATION].list.s
                for i, location in enumerate(locations):
                    target = location[len(_LOCATION_PREFIX):].decode()
                    if target not in names and target in self._ops:
                        locations[i] = _LOCATION_PREFIX + c_api.TF_OperationName(
                            self._ops[target]).encode()
        graph_def = graph_pb2.GraphDef()
        graph_def.versions.CopyFrom(graph.graph_def_versions)
        graph_def.node.extend(nodes)
        scoped = c_api_util.ScopedTFImportGraphDefOptions()
        options = scoped.options
        c_api.TF_ImportGraphDefOptionsSetPrefix(options, "")
        # an op named like a scope of one the run graph holds ("a/b" once "a/b/c" is
        # there: a copy's variable read is named under the copy) gets another name
        # there: TensorFlow's import refuses the name itself
        c_api.TF_ImportGraphDefOptionsSetUniquifyNames(options, True)
        c_api.TF_ImportGraphDefOptionsSetValidateColocationConstraints(options, False)
        mapped = set()
        for node in nodes:
            for source in node.input:
                if source in mapped:
                    continue
                mapped.add(source)
                name, _, index = source.lstrip("^").partition(":")
                if name in names:
                    continue
                if source.startswith("^"):
                    c_api.TF_ImportGraphDefOptionsRemapControlDependency(
                        options, name, self._ops[name])
                else:
                    c_api.TF_ImportGraphDefOptionsAddInputMapping(
                        options, name, int(index or 0),
                        c_api_util.tf_output(self._ops[name], int(index or 0)))
        for node in nodes:
            c_api.TF_ImportGraphDefOptionsAddReturnOperation(options, node.name)
        buffer = c_api.TF_NewBufferFromString(graph_def.SerializeToString())
        try:
            with self.graph._c_graph.get() as c_graph:   # pylint: disable=protected-access
                results = c_api_util.ScopedTFImportGraphDefResults(
                    c_api.TF_GraphImportGraphDefWithResults(c_graph, buffer, options))
        finally:
            c_api.TF_DeleteBuffer(buffer)
        created = c_api.TF_ImportGraphDefResultsReturnOperations(results.results)
        for node, c_op in zip(nodes, created):
            self._ops[node.name] = c_op
