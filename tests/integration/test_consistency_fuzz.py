"""A fuzz check of replica consistency: random small training scripts under 2 replicas.

Each graph comes from a small grammar (`Program.random(seed)`): a linear model and its
loss; a training step built by minimize, by tf.gradients and apply_gradients, or by
an accumulate-then-apply wrapper (accumulators added in one run, applied in the
next); script variables written by assign or assign_add from expressions over
constants, the loss, reductions of the batch (its mean or sum, sometimes in the EPL
merge collection that makes it the global batch's), the squared norm of the
gradients and reads of other script variables; each write inside the training step
(the train op waits for it), grouped with the train op, or in a run of its own.
Every graph runs under EPL with 2 replicas and single-device on the concatenated
batches: EPL either refuses it with an EPLError before step 0, or computes the same
variables and fetched losses. Nothing else passes: no silent difference, no
internal error. The seed of a failing graph is in the assertion message
(`Program.random(seed)` rebuilds it); EPL_FUZZ_GRAPHS sets how many graphs run.
"""
from __future__ import annotations

import dataclasses
import os
import random

import numpy as np
import tensorflow as tf

import epl
from epl import env

GRAPHS = int(os.environ.get("EPL_FUZZ_GRAPHS", "300"))
B, FEATURES, STEPS, REPLICAS = 2, 2, 2, 2
DATA = np.random.RandomState(5).randn(REPLICAS * B * STEPS * 3, FEATURES + 1).astype(np.float32)
LEAVES = ("const", "loss", "batch_mean", "batch_sum", "grad_norm", "read")
PLACES = ("in_step", "grouped", "separate")


@dataclasses.dataclass
class Write:
    """One script variable's write: `kind` (assign or assign_add) of `expr` (a tuple
    tree: ("leaf", name, arg) or (op, left, right)) placed at `place`; `collect` puts
    the batch reduction it reads in the merge collection that makes it global."""

    variable: int
    kind: str
    expr: tuple
    place: str
    collect: bool


@dataclasses.dataclass
class Program:
    """A random training script (module docstring)."""

    seed: int
    step: str                 # "minimize", "gradients" or "accumulate"
    num_state: int
    writes: list

    @staticmethod
    def random(seed: int) -> "Program":
        rng = random.Random(seed)
        step = rng.choice(["minimize", "gradients", "accumulate"])
        num_state = rng.randint(1, 3)
        chosen = rng.sample(range(num_state), rng.randint(1, num_state))
        places = {variable: rng.choice(PLACES) for variable in chosen}
        writes = []
        for variable in chosen:
            # no read of a variable the same session.run writes (TensorFlow would not
            # order the two): the training run holds the in_step and grouped writes
            same_run = {v for v, p in places.items() if (p == "separate") == (
                places[variable] == "separate")}
            writes.append(Write(variable, rng.choice(["assign", "assign_add"]),
                                _expression(rng, 2, num_state, same_run), places[variable],
                                rng.random() < 0.5))
        return Program(seed, step, num_state, writes)


def _expression(rng: random.Random, depth: int, num_state: int, written: set) -> tuple:
    if depth == 0 or rng.random() < 0.4:
        leaf = rng.choice(LEAVES)
        readable = [j for j in range(num_state) if j not in written]
        if leaf == "read" and not readable:
            leaf = "const"
        return ("leaf", leaf, rng.choice(readable) if leaf == "read" else rng.randint(1, 3))
    return (rng.choice(["add", "mul"]), _expression(rng, depth - 1, num_state, written),
            _expression(rng, depth - 1, num_state, written))


def _build(program: Program, rows: int, use_epl: bool):
    """The script's graph in the default graph; returns (feed(run) -> dict, runs of one
    step: [(fetches, is the training run)])."""
    data = tf.compat.v1.placeholder(tf.float32, [rows, FEATURES + 1], name="data")
    x, y = data[:, :FEATURES], data[:, FEATURES:]
    w = tf.compat.v1.get_variable("w", initializer=np.full([FEATURES, 1], 0.5, np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    state = [tf.Variable(0.25 * (j + 1), trainable=False, name=f"s{j}")
             for j in range(program.num_state)]
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    grads = tf.gradients(loss, [w]) if program.step != "minimize" else None
    collected = {"batch_mean": epl.GraphKeys.GLOBAL_MEAN_OBJECTS,
                 "batch_sum": epl.GraphKeys.GLOBAL_SUM_OBJECTS}

    def value(expr, collect):
        if expr[0] == "leaf":
            name, arg = expr[1], expr[2]
            if name == "const":
                return tf.constant(float(arg))
            if name == "loss":
                return loss
            if name == "read":
                return state[arg].read_value()
            if name == "grad_norm":
                if grads is None:
                    return tf.constant(1.0)
                return tf.reduce_sum(tf.square(grads[0]))
            tensor = tf.reduce_mean(x) if name == "batch_mean" else tf.reduce_sum(x)
            if collect and use_epl:
                epl.add_to_collection(tensor, collected[name])
            return tensor
        left, right = value(expr[1], collect), value(expr[2], collect)
        return left + right if expr[0] == "add" else left * right

    def write(spec):
        target = state[spec.variable]
        new = value(spec.expr, spec.collect)
        return (target.assign if spec.kind == "assign" else target.assign_add)(new).op

    accum = tf.Variable(tf.zeros([FEATURES, 1]), trainable=False, name="accum")
    in_step = [write(s) for s in program.writes if s.place == "in_step"]
    with tf.control_dependencies(in_step):
        if program.step == "minimize":
            train = optimizer.minimize(loss)
        elif program.step == "gradients":
            train = optimizer.apply_gradients([(grads[0], w)])
        else:
            train = tf.group(accum.assign_add(grads[0]))
    runs = []
    separate = [write(s) for s in program.writes if s.place == "separate"]
    if separate:
        runs.append((tf.group(separate), False))
    grouped = [write(s) for s in program.writes if s.place == "grouped"]
    runs.append(([tf.group(train, *grouped), loss], True))
    if program.step == "accumulate":
        runs.append((optimizer.apply_gradients([(accum / 2.0, w)]), False))
    return data, runs


def _train(program: Program, use_epl: bool):
    env.reset()
    if use_epl:
        epl.init(epl.Config({"cluster.virtual_devices": REPLICAS,
                             "debug.check_invariants": False}))
    rows = B if use_epl else REPLICAS * B
    with tf.Graph().as_default():
        data, runs = _build(program, rows, use_epl)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses, index = [], 0
            for _ in range(STEPS):
                for fetches, trains in runs:
                    batch = DATA[index * REPLICAS * B:(index + 1) * REPLICAS * B]
                    index += 1
                    out = sess.run(fetches, {data: batch})
                    if trains:
                        losses.append(out[1])
            values = {v.op.name: sess.run(v) for v in tf.compat.v1.global_variables()}
    env.reset()
    return losses, values


def test_random_graphs_are_refused_or_match_single_device():
    refused, matched = 0, 0
    for seed in range(GRAPHS):
        program = Program.random(seed)
        reference = _train(program, False)
        where = f"seed {seed} (Program.random({seed}) = {program})"
        try:
            result = _train(program, True)
        except epl.EPLError:
            refused += 1
            continue
        except Exception as err:   # an internal error is a failure too
            raise AssertionError(f"not an EPLError: {err!r}: {where}") from err
        np.testing.assert_allclose(result[0], reference[0], rtol=1e-5, atol=1e-6,
                                   err_msg=f"losses differ: {where}")
        for name, expected in reference[1].items():
            np.testing.assert_allclose(result[1][name], expected, rtol=1e-5, atol=1e-6,
                                       err_msg=f"variable {name} differs: {where}")
        matched += 1
    print(f"{GRAPHS} graphs: {matched} matched single-device training, {refused} refused")
    assert matched > GRAPHS // 4 and refused > 0, (matched, refused)
