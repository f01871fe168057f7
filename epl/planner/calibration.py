"""The CPU micro-benchmark (calibration): the "CPU" profile of this machine.

`calibrate_cpu_profile` measures this machine's "CPU" `DeviceProfile` with
TensorFlow (imported inside the functions, so that planning on the GPU
table never loads it): the step costs fitted on reference training steps,
memory bandwidth, the collectives' latency and bandwidth, the input
pipeline's reads and the replicas' sync and concurrency.  `cpu_profile`
measures it once per process; `profile_file` writes a profile in the form
``epl-plan --profiles`` and `cluster.device_profiles` accept.
`epl.planner.profiles` re-exports the public names and asks `cpu_profile`
for the built-in "CPU" profile.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

from epl.planner.device_profile import (CPU_PROFILE_NAME, DEFAULT_INTER_NODE_BANDWIDTH,
                                        DeviceProfile)
from epl.planner.roofline import DEFAULT_EFFICIENCY

#: Virtual CPU devices the collectives' part of the calibration runs on.
CALIBRATION_DEVICES = 2
#: Virtual CPU devices the rates (per-op costs, matmul and optimizer rates)
#: are measured on: one executor alone, as one replica runs; how many times
#: that several replicas reach together is measured apart
#: (`replica_concurrency`).
RATE_DEVICES = 1
#: Timed session runs per measurement (the median is kept).
_CALIBRATION_RUNS = 7
#: Rounds of the figures measured more than once (the median is kept).
_CALIBRATION_ROUNDS = 5
#: Timed runs of each reference training step per round.
_STEP_RUNS = 25
#: Bytes all-reduced per collective in the collective fit.
_COLLECTIVE_BYTES = (4 << 10, 1 << 20)


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    return mean_y - slope * mean_x, slope


def _median(values) -> float:
    """The median of an odd number of values (the middle one)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class _Bench:
    """Times graphs built by a function of one count, on virtual CPU devices.

    Runs go through tf.compat.v1 sessions with `device_count` CPUs, with
    Grappler and the classic graph optimizer's constant folding and common
    subexpression elimination off, so the ops run as built (a chain of tiny
    ops would be folded away, and identical ops merged, otherwise); with
    as_built=False, in a session configured as a training script's (the
    reference training steps: Grappler fuses a step's ops as it does a
    user's).

    A fit's points are timed interleaved: every point's session is opened
    and warmed up first, then the runs go round the points `_CALIBRATION_RUNS`
    times, and each point keeps its median.  On a shared machine the load
    changes within seconds; interleaved, every point sees the same load, so
    a change moves the line up or down rather than tilting it (timed one
    point after the other, a fitted slope moved 3x between two calls).
    The examples' step times are medians too, taken under the same load.
    """

    def __init__(self, tf: Any, as_built: bool = True) -> None:
        self.tf = tf
        self.as_built = as_built

    def _config(self, devices: int) -> Any:
        """The session config: `devices` CPUs; the graph as built, or
        (as_built=False) optimized as a training script's session runs it."""
        tf = self.tf
        config = tf.compat.v1.ConfigProto(device_count={"CPU": devices})
        if not self.as_built:
            return config
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        options = config.graph_options.optimizer_options
        options.opt_level = tf.compat.v1.OptimizerOptions.L0
        options.do_common_subexpression_elimination = False
        options.do_constant_folding = False
        return config

    def times(self, builds: list, devices: int,
              runs: int = _CALIBRATION_RUNS) -> list[float]:
        """Median seconds of one run of each graph that a function of
        `builds` returns, timed interleaved, `runs` runs each."""
        tf = self.tf
        sessions, fetches = [], []
        try:
            for build in builds:
                graph = tf.Graph()
                with graph.as_default():
                    fetches.append(build())
                    init = tf.compat.v1.global_variables_initializer()
                sessions.append(tf.compat.v1.Session(
                    graph=graph, config=self._config(devices)))
                sessions[-1].run(init)
                for _ in range(2):  # warm-up
                    sessions[-1].run(fetches[-1])
            samples: list[list[float]] = [[] for _ in builds]
            for _ in range(runs):
                for session, fetch, times in zip(sessions, fetches, samples):
                    start = time.perf_counter()
                    session.run(fetch)
                    times.append(time.perf_counter() - start)
        finally:
            for session in sessions:
                session.close()
        return [_median(t) for t in samples]

    def line(self, build, counts: tuple[int, ...], devices: int
             ) -> tuple[float, float]:
        """(intercept, slope) of run time over `counts` of `build`."""
        seconds = self.times([functools.partial(build, c) for c in counts],
                             devices)
        return _fit_line(list(zip(counts, seconds)))

    def slope(self, build, counts: tuple[int, ...], devices: int) -> float:
        """Seconds per unit of count: the slope of run time over `counts`."""
        return max(self.line(build, counts, devices)[1], 1e-12)


#: The training steps the step costs are fitted on (`_step_costs`):
#: ("mlp", width, layers, batch) and ("transformer", blocks, einsum).  Tiny
#: MLPs (the per-op and the fixed cost), MLPs of training widths at two
#: batches (the matmul rate apart from the optimizer's bytes, which grow
#: with the width but not the batch), a wide layer at batch 1 (the
#: optimizer's bytes, with few FLOPs) and stacks of transformer blocks
#: (layer norm, self-attention, a feed-forward layer: the costly kernels)
#: with matmul dense layers or, as BERT-style code writes them, einsums.
#: None of them is an example's model.
REFERENCE_STEPS = (("mlp", 16, 2, 8), ("mlp", 16, 10, 8),
                   ("mlp", 256, 2, 64), ("mlp", 256, 2, 256),
                   ("mlp", 512, 2, 32), ("mlp", 1024, 1, 1),
                   ("transformer", 1, False), ("transformer", 4, False),
                   ("transformer", 1, True), ("transformer", 4, True))
#: Classes of op types whose cost in a training step is fitted on top of
#: op_overhead_s, one cost per class: kernels with a large fixed cost on the
#: CPU, tens of microseconds in a step whatever their size -- oneDNN's
#: batched matmuls, transposes and softmaxes (attention), einsums (dense
#: layers written as einsums, expert dispatch), and reductions (Eigen's
#: parallel reductions: bias gradients, means, layer norms).
KERNEL_CLASSES = (("BatchMatMulV2", "Transpose", "Softmax"), ("Einsum",),
                  ("Sum", "Mean"))
#: Shape of the transformer blocks: batch, sequence, model width, heads.
_TRANSFORMER = (4, 32, 64, 4)


def _dense(tf: Any, x: Any, units: int, name: str, einsum: bool = False
           ) -> Any:
    """x @ kernel + bias, as tf.compat.v1 code writes a dense layer (an
    einsum over the last axis with einsum=True)."""
    kernel = tf.compat.v1.get_variable(
        f"{name}/kernel", [int(x.shape[-1]), units],
        initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
    bias = tf.compat.v1.get_variable(
        f"{name}/bias", [units], initializer=tf.compat.v1.zeros_initializer())
    if einsum:
        return tf.einsum("bsd,du->bsu", x, kernel) + bias
    if len(x.shape) > 2:
        return tf.tensordot(x, kernel, 1) + bias
    return tf.matmul(x, kernel) + bias


def _reference_loss(tf: Any, kind: str, *params: int) -> Any:
    """The loss of one of `REFERENCE_STEPS`, its input a variable's value
    (the input pipeline's costs are measured apart, `_input_costs`)."""
    if kind == "mlp":
        width, layers, batch = params
        x = tf.Variable(tf.ones([batch, width]), trainable=False).read_value()
        for i in range(layers):
            x = tf.nn.relu(_dense(tf, x, width, f"layer_{i}"))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.zeros([batch], tf.int32), logits=x))
    blocks, einsum = params
    batch, length, width, heads = _TRANSFORMER
    x = tf.Variable(tf.ones([batch, length, width]) / 8,
                    trainable=False).read_value()

    def layer_norm(t, name):
        gamma = tf.compat.v1.get_variable(
            f"{name}/gamma", [width], initializer=tf.compat.v1.ones_initializer())
        beta = tf.compat.v1.get_variable(
            f"{name}/beta", [width], initializer=tf.compat.v1.zeros_initializer())
        mean, variance = tf.nn.moments(t, axes=[-1], keepdims=True)
        return (t - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta

    def split_heads(t):  # [B, L, D] -> [B, H, L, D/H]
        return tf.transpose(tf.reshape(
            t, [batch, length, heads, width // heads]), [0, 2, 1, 3])
    for i in range(blocks):
        h = layer_norm(x, f"block_{i}/ln_attention")
        q, k, v = tf.split(_dense(tf, h, 3 * width, f"block_{i}/qkv", einsum), 3, -1)
        scores = tf.matmul(split_heads(q), split_heads(k), transpose_b=True)
        context = tf.matmul(tf.nn.softmax(scores / (width // heads) ** 0.5),
                            split_heads(v))
        context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]),
                             [batch, length, width])
        x = x + _dense(tf, context, width, f"block_{i}/out", einsum)
        h = layer_norm(x, f"block_{i}/ln_ffn")
        h = tf.nn.relu(_dense(tf, h, 2 * width, f"block_{i}/ffn_in", einsum))
        x = x + _dense(tf, h, width, f"block_{i}/ffn_out", einsum)
    return tf.reduce_mean(tf.square(x))


def _reference_step(tf: Any, step: tuple):
    """build(): the Adam training step of `step` (one of REFERENCE_STEPS):
    the ops tf.compat.v1.train.AdamOptimizer builds (the gradients, each
    variable's two slots and its ResourceApplyAdam), built as EPL's own
    autodiff and raw apply kernels so that EPL's optimizer hooks, when EPL
    is initialised in this process, record no training step (a session on
    a recorded step would be parallelized)."""
    from epl.ir.autodiff import internal_autodiff

    def build():
        loss = _reference_loss(tf, *step)
        variables = tf.compat.v1.trainable_variables()
        with internal_autodiff():
            grads = tf.gradients(loss, variables)
        updates = []
        for var, grad in zip(variables, grads):
            m, v = (tf.Variable(tf.zeros(var.shape), trainable=False)
                    for _ in range(2))
            updates.append(tf.raw_ops.ResourceApplyAdam(
                var=var.handle, m=m.handle, v=v.handle, beta1_power=0.9,
                beta2_power=0.999, lr=1e-3, beta1=0.9, beta2=0.999,
                epsilon=1e-7, grad=grad))
        return tf.group(*updates)
    return build


def _step_terms(tf: Any, step: tuple) -> list[float]:
    """What the planner counts in one of `REFERENCE_STEPS`, the terms of
    `_step_costs`' fit: [1 (the fixed cost), ops, FLOPs, the optimizer's
    bytes, then each of `KERNEL_CLASSES`' ops].  The ops are the forward,
    backward and apply ops `epl.planner.graph_model.model_from_graph` counts
    (as the planner counts an example's); the FLOPs
    `epl.planner.cost_model.graph_cost`'s;
    the optimizer's bytes Adam's (variable, slots and gradient in, variable
    and slots out: 3 + 2 x 2 times the parameter bytes)."""
    from epl.planner import cost_model
    from epl.planner.graph_model import model_from_graph
    with tf.Graph().as_default() as graph:
        _reference_step(tf, step)()
    spec = model_from_graph(graph)
    counts: dict[str, int] = {}
    for layer in spec.layers:
        for op_type, count in layer.op_counts:
            counts[op_type] = counts.get(op_type, 0) + count
    params = sum(layer.parameter_bytes for layer in spec.layers)
    return [1.0, float(sum(counts.values())),
            cost_model.graph_cost(graph)[cost_model.ALL].flops,
            params * (3 + 2 * cost_model.optimizer_slots("adam")),
            *(float(sum(counts.get(t, 0) for t in types))
              for types in KERNEL_CLASSES)]


#: Smallest value of each coefficient of the step fit (seconds per unit of
#: its term): a term the noise drives to zero or below is held at this (an
#: op costs at least 1 ns; FLOPs and bytes at most 1 PFLOP/s and 10 TB/s).
#: The per-op cost is small beside the kernel classes and the fixed cost
#: (0-0.2 us fitted here), so noise can take it to the floor.
_FIT_FLOORS = (0.0, 1e-9, 1e-15, 1e-13) + (0.0,) * len(KERNEL_CLASSES)


def _fit_nonnegative(rows: list[list[float]], times: list[float],
                     floors: tuple[float, ...]) -> list[float]:
    """Least-squares coefficients c of times ~ rows @ c, each at least its
    floor: a coefficient the fit puts below its floor is held there and the
    others are fitted again (an active set), so that noise cannot give a
    negative cost."""
    import numpy as np
    a, y = np.asarray(rows, float), np.asarray(times, float)
    fixed: dict[int, float] = {}
    while True:
        free = [j for j in range(a.shape[1]) if j not in fixed]
        rest = y - sum(a[:, j] * v for j, v in fixed.items())
        coef = np.linalg.lstsq(a[:, free], rest, rcond=None)[0] if free \
            else []
        low = [(c - floors[j], j) for c, j in zip(coef, free)
               if c < floors[j]]
        if not low:
            out = [0.0] * a.shape[1]
            for j, v in fixed.items():
                out[j] = v
            for c, j in zip(coef, free):
                out[j] = float(c)
            return out
        fixed[min(low)[1]] = floors[min(low)[1]]


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What a training step costs on this CPU, fitted by `_step_costs`.

    Attributes:
        fixed_s: seconds of a session run of a training step beyond its ops.
        op_s: seconds per counted op.
        flop_rate: FLOP/s of the step's counted FLOPs.
        optimizer_bandwidth: bytes/s of the optimizer's apply ops.
        kernel_s: op type -> seconds per op beyond op_s, for the types of
            `KERNEL_CLASSES` (one cost per class).
    """

    fixed_s: float
    op_s: float
    flop_rate: float
    optimizer_bandwidth: float
    kernel_s: dict[str, float]


def _step_costs(terms: list[list[float]], seconds: list[float]
                ) -> StepCosts:
    """The step costs fitted on the `REFERENCE_STEPS`' terms
    (`_step_terms`) and measured seconds per step: time = fixed + ops x
    op_s + FLOPs / flop_rate + optimizer bytes / optimizer_bandwidth +
    each kernel class's ops x its cost, least squares with no cost below
    zero."""
    fixed, op, per_flop, per_byte, *kernels = _fit_nonnegative(
        terms, seconds, _FIT_FLOORS)
    return StepCosts(fixed_s=fixed, op_s=op, flop_rate=1.0 / per_flop,
                     optimizer_bandwidth=1.0 / per_byte,
                     kernel_s={t: cost for types, cost in
                               zip(KERNEL_CLASSES, kernels) for t in types})


def _all_reduces(tf: Any, nbytes: int, devices: int):
    """build(n): n chained all-reduces of `nbytes` over `devices` devices, built by
    the communicator EPL's local gradient reduction uses on CPU devices (the sum
    on one device, `LocalCommunicator(reduce_to_one_device=True)`)."""
    from epl.runtime.communicators import LocalCommunicator
    names = [f"/device:CPU:{d}" for d in range(devices)]

    def build(n: int):
        communicator = LocalCommunicator(reduce_to_one_device=True)
        xs = []
        for name in names:
            with tf.device(name):
                xs.append(tf.Variable(tf.ones([nbytes // 4])).read_value())
        for _ in range(n):
            xs = communicator.all_reduce(xs, names)
        return tf.group(*xs)
    return build


_COPY_BYTES = 32 << 20
_COPY_SECONDS = 0.05


def _best_rate(work: float, run, seconds: float) -> float:
    """Best observed `work` per second of `run()` over about `seconds`."""
    run()  # warm up (thread pools, page faults)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() >= deadline:
            return work / max(best, 1e-9)


def _measure_copy_bandwidth() -> float:
    """Memory bandwidth in B/s from a 32 MiB numpy copy (read + write)."""
    import numpy as np
    src = np.ones(_COPY_BYTES // 4, np.float32)
    dst = np.empty_like(src)
    return _best_rate(2.0 * _COPY_BYTES, lambda: np.copyto(dst, src),
                      _COPY_SECONDS)


def _replica_steps(tf: Any, devices: int, real: bool, width: int = 256,
                   layers: int = 2):
    """build(batch): `devices` replicas of a 2-layer `width`-wide MLP's
    training step (matmuls, their gradients, the SGD apply kernel), one per
    virtual device.  real=True builds the structure of a data-parallel
    step: every replica reads its batch from one input pipeline
    (`_input_dataset`) whose iterator sits on device 0 (as EPL places the
    input), and the replicas'
    gradients are fused (concat) and all-reduced in one reduction (EPL's on
    CPU devices: the sum on device 0; split back) before the apply; real=False the same replicas independently,
    each on a constant batch of its own."""
    from epl.runtime.communicators import LocalCommunicator
    names = [f"/device:CPU:{d}" for d in range(devices)]

    def build(batch: int):
        if real:
            with tf.device("/device:CPU:0"):
                iterator = tf.compat.v1.data.make_one_shot_iterator(
                    _input_dataset(tf, batch, width))
        replicas = []   # per device: (its weights, their gradients)
        for name in names:
            if real:
                with tf.device("/device:CPU:0"):
                    x, _ = iterator.get_next()
            with tf.device(name):
                if not real:
                    x = tf.ones([batch, width])
                weights = [tf.Variable(tf.ones([width, width]) / width)
                           for _ in range(layers)]
                values = [w.read_value() for w in weights]
                for value in values:
                    x = tf.nn.relu(tf.matmul(x, value))
                replicas.append((weights, tf.gradients(tf.reduce_sum(x), values)))
        if real and devices > 1:
            flats = []
            for name, (_, grads) in zip(names, replicas):
                with tf.device(name):
                    flats.append(tf.concat([tf.reshape(g, [-1]) for g in grads], 0))
            reduced = LocalCommunicator(reduce_to_one_device=True).all_reduce(flats, names)
            for name, flat, (weights, grads) in zip(names, reduced, replicas):
                with tf.device(name):
                    grads[:] = [tf.reshape(g, [width, width]) for g in tf.split(flat, layers)]
        trains = []
        for name, (weights, grads) in zip(names, replicas):
            with tf.device(name):
                trains += [tf.raw_ops.ResourceApplyGradientDescent(
                    var=w.handle, alpha=0.01, delta=g)
                    for w, g in zip(weights, grads)]
        return tf.group(*trains)
    return build


#: Per-replica batches of the replica-step fit.
_REPLICA_BATCHES = (16, 128)
#: Virtual devices of the replica-step fit: more replicas than a small
#: host has cores, so that the fit sees them take turns.
REPLICA_SYNC_DEVICES = 4


#: Examples held by the input pipeline of the input and replica fits.
_INPUT_EXAMPLES = 4096
#: Batches of the input-read fit.
_INPUT_BATCHES = (8, 256)


def _input_dataset(tf: Any, batch: int, width: int) -> Any:
    """The input pipeline the examples build: in-memory slices (float
    features of `width`, an int64 label), shuffled over all of them,
    repeated and batched."""
    import numpy as np
    rng = np.random.RandomState(0)
    features = rng.randn(_INPUT_EXAMPLES, width).astype(np.float32)
    labels = rng.randint(0, 10, _INPUT_EXAMPLES).astype(np.int64)
    dataset = tf.data.Dataset.from_tensor_slices((features, labels))
    return dataset.shuffle(_INPUT_EXAMPLES, seed=0).repeat().batch(
        batch, drop_remainder=True)


def _input_costs(bench: "_Bench", tf: Any) -> tuple[float, float]:
    """(seconds per read, seconds per example) of reads from
    `_input_dataset` (64 features): the line of a session run's time over
    the batch read, less the time of a run of nothing (a NoOp: the
    session's own fixed cost), timed interleaved."""
    def reads(batch: int):
        with tf.device("/device:CPU:0"):
            return tf.group(*tf.compat.v1.data.make_one_shot_iterator(
                _input_dataset(tf, batch, 64)).get_next())
    times = bench.times([tf.no_op] + [functools.partial(reads, b)
                                      for b in _INPUT_BATCHES], 1)
    intercept, slope = _fit_line(list(zip(_INPUT_BATCHES, times[1:])))
    return max(intercept - times[0], 0.0), max(slope, 0.0)


def _replica_sync(bench: "_Bench", tf: Any, devices: int, latency: float,
                  link: float, memory_bandwidth: float, read: float
                  ) -> tuple[float, float]:
    """(sync seconds, concurrency) of data-parallel replicas on `devices`
    virtual devices.

    Sync seconds: per step, what each replica beyond the first adds to a
    data-parallel step on `devices` virtual devices, beyond its own work
    and the all-reduce's ring: `devices` replicas of a real data-parallel
    step (`_replica_steps`, real=True) against the same replicas run
    independently (real=False), timed interleaved at two batches.

    The extra fixed time of the real step (the difference of the two
    lines' intercepts) less the all-reduce the planner predicts for its
    gradients (`roofline.comm_time` at `link` and `latency`, with the
    fusion copies at `memory_bandwidth`) and less the replicas' input
    reads (`read` seconds each, `input_read_s`), per replica beyond the
    first: the replicas' waits at the all-reduce barrier.

    Concurrency: how many times one replica's rate the `devices` replicas
    of the real step reach together, `devices` times the per-example time
    (the slope over the batch) of one replica alone (the same step on one
    device) over the per-example time of the `devices` replicas (1: they
    take turns on the shared cores; up to the host's cores where they ran
    side by side).
    """
    from epl.planner import roofline
    steps = [_replica_steps(tf, devices, False),
             _replica_steps(tf, devices, True), _replica_steps(tf, 1, True)]
    times = bench.times([functools.partial(step, b) for step in steps
                         for b in _REPLICA_BATCHES], devices, runs=_STEP_RUNS)
    span = _REPLICA_BATCHES[1] - _REPLICA_BATCHES[0]
    free_fixed = times[0] - (times[1] - times[0]) / span * \
        _REPLICA_BATCHES[0]
    real_fixed = times[2] - (times[3] - times[2]) / span * \
        _REPLICA_BATCHES[0]
    nbytes = 2 * 256 * 256 * 4.0  # the two layers' float32 gradients
    allreduce = roofline.comm_time(nbytes, link, devices, latency) + \
        4 * nbytes / memory_bandwidth
    sync = max(real_fixed - free_fixed - allreduce - devices * read, 0.0) \
        / (devices - 1)
    concurrency = devices * max(times[5] - times[4], 1e-12) / \
        max(times[3] - times[2], 1e-12)
    return sync, min(max(concurrency, 1e-3), float(devices))


def calibrate_cpu_profile(progress: Callable[[str], None] | None = None) -> DeviceProfile:
    """Measure this machine's "CPU" profile with TensorFlow (~30 s on 2 cores).

    progress(line), when given, is told as each round starts and before the fit.

    Needs TensorFlow (imported here, so that planning on the GPU table
    never loads it).  The rates are one executor's alone, measured on
    `RATE_DEVICES` (one) device, as one replica runs; what several replicas
    on virtual devices reach together is `replica_concurrency`:

    - The step costs (`_step_costs`): the training steps of
      `REFERENCE_STEPS` (small MLPs and transformer stacks with Adam,
      none of them an example's model) are timed on one device in a
      session as a training script opens it (Grappler on), and the
      planner's own counts of each step (its ops, FLOPs, optimizer bytes
      and costly kernels, `_step_terms`) fitted to the times by least
      squares.  A step's kernels cost far more than the same kernels in a
      chain: a chain of 64x256x256 matmuls ran at 180 GFLOP/s where a
      training step's ran at 140, Adam's apply moved 40 GB/s alone, and
      softmaxes and batched matmuls in a chain cost 22-25 us, in a step
      about 45 (this machine); fitted, the costs are the step's.  They give
      - step_overhead_s: the fixed cost of a step's session run;
      - op_overhead_s: seconds per counted op;
      - peak_flops: the float32 rate of the steps' FLOPs, divided by
        `epl.planner.roofline.DEFAULT_EFFICIENCY` so that the planner's
        default efficiency predicts that rate; float16 and bfloat16 at the
        float32 rate, float64 at half;
      - optimizer_bandwidth: the bytes Adam's apply ops move per second;
      - op_type_overhead_s: the types of `KERNEL_CLASSES`, each class's
        fitted cost of one such kernel beyond op_overhead_s.
      The steps are timed in five rounds spread through the calibration,
      each step's median kept: on a shared machine a round samples the load
      of under a second, which flips between states 2x apart.
    - memory_bandwidth: a 32 MiB numpy copy (read + write).
    - replica_sync_s: the median of five rounds of `_replica_sync` on
      `REPLICA_SYNC_DEVICES` devices (a real data-parallel step's extra
      fixed time per replica, beyond its work, its input read and the
      all-reduce's ring).
    - input_read_s and input_example_s: reads of a shuffled, batched
      pipeline of in-memory slices (`_input_costs`), the session's own
      fixed cost (a NoOp's run) taken off.
    - intra_node_bandwidth and collective_latency_s: chained all-reduces
      of 4 KiB and 1 MiB over `CALIBRATION_DEVICES` virtual devices, built as
      EPL reduces among CPU devices (the sum on one device); the cost model
      reads them as a ring (`step_cost`), so they are fitted in its terms:
      the small one's time over 2 (n - 1) ring steps is the latency, the
      bytes every device would send (2 (n - 1) / n of the buffer each) over
      the extra time of the large one the bandwidth of the whole CPU
      (`virtual_cpu_profiles` divides it among the devices, which share it).

    Memory is the machine's RAM; inter-node bandwidth the 100 Gb/s default.
    """
    import tensorflow as tf

    bench, k, one = _Bench(tf), CALIBRATION_DEVICES, RATE_DEVICES
    as_run = _Bench(tf, as_built=False)
    steps = [_reference_step(tf, step) for step in REFERENCE_STEPS]
    rounds, syncs = [], []
    say = progress or (lambda line: None)
    for round_ in range(_CALIBRATION_ROUNDS):
        say(f"calibrating the CPU profile: round {round_ + 1} of {_CALIBRATION_ROUNDS} "
            f"({len(steps)} reference training steps"
            f"{', memory, collectives and input reads' if round_ == 0 else ''}, replica sync)")
        rounds.append(as_run.times(steps, one, runs=_STEP_RUNS))
        if round_ == 0:
            bandwidth = _measure_copy_bandwidth()
            small, large = (bench.slope(_all_reduces(tf, b, k), (1, 5), k)
                            for b in _COLLECTIVE_BYTES)
            latency = small / (2 * (k - 1))
            moved = 2 * (k - 1) * (_COLLECTIVE_BYTES[1] - _COLLECTIVE_BYTES[0])
            link = moved / max(large - small, 1e-12)
            read, per_example = _input_costs(bench, tf)
        syncs.append(_replica_sync(bench, tf, REPLICA_SYNC_DEVICES, latency,
                                   link, bandwidth, read))
    say("calibrating the CPU profile: fitting the step costs")
    costs = _step_costs([_step_terms(tf, step) for step in REFERENCE_STEPS],
                        [_median(times) for times in zip(*rounds)])
    fp32 = costs.flop_rate / DEFAULT_EFFICIENCY
    return DeviceProfile(
        name=CPU_PROFILE_NAME,
        peak_flops={"float32": fp32, "float16": fp32, "bfloat16": fp32,
                    "float64": fp32 / 2},
        memory_bytes=float(_total_ram_bytes()),
        memory_bandwidth=bandwidth,
        intra_node_bandwidth=link,
        inter_node_bandwidth=DEFAULT_INTER_NODE_BANDWIDTH,
        op_overhead_s=costs.op_s,
        collective_latency_s=latency,
        op_type_overhead_s=costs.kernel_s,
        optimizer_bandwidth=costs.optimizer_bandwidth,
        step_overhead_s=costs.fixed_s,
        replica_sync_s=_median(sync for sync, _ in syncs),
        replica_concurrency=_median(c for _, c in syncs),
        host_cores=_host_cores(), input_read_s=read,
        input_example_s=per_example)


def _total_ram_bytes() -> int:
    """This machine's physical memory in bytes (os.sysconf)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@functools.lru_cache(maxsize=1)
def cpu_profile() -> DeviceProfile:
    """The "CPU" profile of this machine, measured once per process
    (`calibrate_cpu_profile`, ~30 s, imports TensorFlow).  To skip the
    measurement (and have every worker plan with the same figures), write
    a profile file with ``epl-plan --calibrate --output FILE`` and give it
    as `cluster.device_profiles` or ``epl-plan --profiles FILE``."""
    return calibrate_cpu_profile()


def profile_file(profile: DeviceProfile) -> dict[str, dict[str, Any]]:
    """{name: fields}: the JSON object ``epl-plan --profiles`` and
    `cluster.device_profiles` accept, defining `profile` in full."""
    fields = profile.to_dict()
    name = fields.pop("name")
    return {name: fields}


def _host_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
