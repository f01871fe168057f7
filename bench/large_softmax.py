"""A 100,000-class classifier on 4 devices: epl.split(4) against data parallelism.

Whale's large-scale classification case (the paper reports 14.8x over
Horovod data parallelism on 64 GPUs). Both sides train the same model (a
small data-parallel body, a [64, 100000] classifier, sparse softmax
cross-entropy, Adam) on the same global batch over the same 4 virtual CPU
devices of one process, with EPL:
- split: the classifier under `epl.split(4)` (each device holds a quarter of
  the classes; features all-gathered; distributed softmax), the body under
  `epl.replicate(1)`, `cluster.colocate_split_and_replicate`;
- replicate: everything under `epl.replicate(1)`: every device holds the
  whole classifier and all-reduces its gradient (what Horovod data
  parallelism does).

Memory, read from the placed graph: per device, the bytes of the variables
placed there (weights and Adam slots) and of the dense gradients its updates
read (the last input of each ResourceApply* op, on its variable's device).
Time: `--repeats` repetitions, each running `--steps` timed steps (after a
warm-up) of one side and then the other, so both see the same load on a
shared machine; per side the median of the repetitions' median step time,
and the median over repetitions of the paired ratio split / replicate.

    python bench/large_softmax.py [--classes 100000] [--batch 64] [--steps 5] [--repeats 5]

Last lines: `large_softmax: per-device parameter+gradient bytes split/replicate = X.XX
(target <= 0.3)` and `large_softmax: step time split/replicate = X.XX
(speed-up Y.YYx)`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import epl  # noqa: E402
import epl.layers as layers  # noqa: E402
from common import format_table, median  # noqa: E402
from epl import env  # noqa: E402

FEATURES, HIDDEN, DEVICES = 32, 64, 4


class Side:
    """One side of the comparison: its graph, session and per-device bytes."""

    def __init__(self, name: str, classes: int, batch: int):
        env.reset()
        epl.init(epl.Config({"cluster.virtual_devices": DEVICES,
                             "cluster.colocate_split_and_replicate": True}))
        self.name = name
        self.graph = tf.Graph()
        rng = np.random.RandomState(0)
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(1)
            features = tf.constant(rng.randn(batch, FEATURES).astype(np.float32))
            labels = tf.constant(rng.randint(0, classes, batch).astype(np.int64))
            with epl.replicate(1, name="body"):
                hidden = layers.dense(features, HIDDEN, activation=tf.nn.relu, name="body")
            head = epl.split(DEVICES, name="classifier") if name == "split" else \
                epl.replicate(1, name="body")
            with head:
                logits = layers.dense(hidden, classes, name="classifier")
                self.loss = layers.sparse_softmax_cross_entropy(labels, logits)
            self.train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(self.loss)
            result = epl.parallelize(self.graph)
            self.sess = tf.compat.v1.Session(config=result.session_config())
            self.sess.run(tf.compat.v1.global_variables_initializer())
        env.reset()
        self.param_bytes, self.grad_bytes = self._bytes()

    def _bytes(self) -> tuple[dict, dict]:
        params: dict = {}
        grads: dict = {}
        for op in self.graph.get_operations():
            if op.type == "VarHandleOp" and op.device and "_epl_split_replaced" not in op.node_def.attr:
                shape = tf.TensorShape(op.get_attr("shape"))
                params[op.device] = params.get(op.device, 0) + shape.num_elements() * 4
            if op.type.startswith("ResourceApply") and op.inputs:
                device = op.inputs[0].op.device
                grad = op.inputs[-1]
                if grad.shape.is_fully_defined():
                    grads[device] = grads.get(device, 0) + grad.shape.num_elements() * 4
        return params, grads

    def steps(self, count: int) -> float:
        """Median seconds per step over `count` steps."""
        times = []
        for _ in range(count):
            start = time.perf_counter()
            self.sess.run([self.train_op, self.loss])
            times.append(time.perf_counter() - start)
        return median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--classes", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    sides = [Side("split", args.classes, args.batch), Side("replicate", args.classes, args.batch)]
    for side in sides:
        side.steps(args.warmup)
    times = {side.name: [] for side in sides}
    ratios = []
    for _ in range(args.repeats):
        for side in sides:
            times[side.name].append(side.steps(args.steps))
        ratios.append(times["split"][-1] / times["replicate"][-1])

    devices = sorted(set(sides[0].param_bytes) | set(sides[1].param_bytes))
    rows = []
    for device in devices:
        rows.append([device] + [f"{side.param_bytes.get(device, 0) / 2**20:.1f}" for side in sides]
                    + [f"{side.grad_bytes.get(device, 0) / 2**20:.1f}" for side in sides])
    print(format_table(["device", "params+slots MB split", "params+slots MB replicate",
                        "gradients MB split", "gradients MB replicate"], rows))
    worst = {side.name: max(side.param_bytes.get(d, 0) + side.grad_bytes.get(d, 0)
                            for d in devices) for side in sides}
    print(format_table(["side", "median step s", "max per-device params+slots+grads MB"],
                       [[side.name, median(times[side.name]), worst[side.name] / 2**20]
                        for side in sides]))
    memory_ratio = worst["split"] / worst["replicate"]
    time_ratio = median(ratios)
    print(f"large_softmax: per-device parameter+gradient bytes split/replicate = "
          f"{memory_ratio:.2f} (target <= 0.3)")
    print(f"large_softmax: step time split/replicate = {time_ratio:.2f} "
          f"(speed-up {1 / time_ratio:.2f}x; Whale reports 14.8x over Horovod on 64 GPUs)")
    for side in sides:
        side.sess.close()
    return {"memory_ratio": memory_ratio, "time_ratio": time_ratio,
            "param_bytes": {side.name: side.param_bytes for side in sides},
            "grad_bytes": {side.name: side.grad_bytes for side in sides}}


if __name__ == "__main__":
    main()
