"""Multi-worker scaling: training samples/s with 1 and 2 workers.

Each worker drives one (virtual CPU) device and trains the example MLP on its
own batch of --batch examples (weak scaling: the global batch grows with the
workers). Both configurations share this machine's cores, so on a 2-core
machine the 2-worker figure shows the communication overhead more than any
speed-up; the numbers are reported as measured.

    python bench/scaling.py [--steps 50] [--batch 256] [--repeats 3]
Prints: scaling: 2 workers / 1 worker samples/s = X.XX
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


def worker(steps: int, batch: int, out: str) -> None:
    import tensorflow as tf
    import epl
    tf.compat.v1.disable_eager_execution()
    epl.init(epl.Config({"cluster.virtual_devices": 1}))
    cluster = epl.Cluster.current()
    rng = np.random.RandomState(cluster.worker_rank)
    x = tf.constant(rng.randn(batch, 64).astype(np.float32))
    y = tf.constant(rng.randint(0, 10, batch).astype(np.int64))
    with epl.replicate(1):
        h = x
        for i, width in enumerate([512, 512, 10]):
            w = tf.compat.v1.get_variable(f"w{i}", [h.shape[-1], width])
            h = tf.matmul(h, w)
            h = tf.nn.relu(h) if width != 10 else h
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
    train = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(5):
            sess.run(train)
        start = time.perf_counter()
        for _ in range(steps):
            sess.run(train)
        elapsed = time.perf_counter() - start
    if cluster.worker_rank == 0:
        with open(out, "w") as f:
            json.dump({"samples_per_s": steps * batch * cluster.num_workers / elapsed}, f)


def run(workers: int, steps: int, batch: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        args = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(steps),
                "--batch", str(batch), "--out", out]
        if workers > 1:
            horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
            args = [horovodrun, "--gloo", "-np", str(workers), "-H", f"localhost:{workers}"] + args
        result = subprocess.run(args, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise SystemExit(f"{workers} worker(s) failed:\n{result.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)["samples_per_s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="samples/s for 1 and 2 workers")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.steps, args.batch, args.out)
        return 0
    if args.quick:
        args.steps, args.repeats, args.batch = 5, 1, 32
    rates = {1: [], 2: []}
    for _ in range(args.repeats):
        for workers in (1, 2):
            rates[workers].append(run(workers, args.steps, args.batch))
    medians = {w: statistics.median(r) for w, r in rates.items()}
    for w in (1, 2):
        print(f"{w} worker(s): {medians[w]:10.0f} samples/s (runs: "
              f"{', '.join(f'{r:.0f}' for r in rates[w])})")
    print(f"scaling: 2 workers / 1 worker samples/s = {medians[2] / medians[1]:.2f} "
          f"(both share this machine's {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
