"""Pipeline schedules: peak memory per stage and the bubble, 1F1B against GPipe.

One run of this script trains a transformer encoder split into K stages
(`epl.replicate(device_count=1, name="stage_<i>")`, one virtual CPU device per
stage) with M micro-batches of a fixed size (so the global batch is M x the
micro-batch), under both schedules: PreferForward (GPipe, the peer) and
PreferBackward (1F1B, EPL's default), for M in 4, 8, 16. For each it runs a
warm-up step and then traced steps (`RunOptions.FULL_TRACE`), and reads from
TensorFlow's own RunMetadata step stats:

- Peak memory per stage: every node's allocation records (bytes allocated
  and freed, with timestamps, as TensorFlow's tracking allocator reports
  them), summed per device in time order; the peak of that running sum is the
  most memory the stage's step held at once: activations kept for backward,
  gradients and temporaries (variables and optimizer slots are allocated
  before the step and are not counted). GPipe keeps the activations of all M
  micro-batches; 1F1B at most K - s on stage s, so its peak stays flat as M
  grows while GPipe's grows with M.
- The bubble: per stage, the union of its ops' execution intervals over the
  step's span (first op start to last op end, over all stages); idle fraction
  = 1 - busy / span, printed next to GPipe's ideal (K - 1) / (M + K - 1).
  The virtual CPU devices share this machine's cores and one inter-op thread
  pool, so stages do not overlap as they would on separate accelerators and
  the measured idle fractions are only indicative.

Medians over `--repeats` traced steps.

    python bench/pipeline.py [--quick] [--copies] [--stages 2] [--micro-batches 4 8 16]
        [--micro-batch-size 8] [--layers 4] [--hidden 128] [--seq 64] [--repeats 3]
Prints: pipeline: peak memory 1F1B / GPipe at M=16 = X (stage 0) ... ; growth M=4->16 ...
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import epl  # noqa: E402
from epl import env  # noqa: E402

STRATEGIES = ("PreferForward", "PreferBackward")
LABEL = {"PreferForward": "GPipe", "PreferBackward": "1F1B"}


def encoder_layer(x: tf.Tensor, index: int, hidden: int, rng: np.random.RandomState) -> tf.Tensor:
    """Single-head self-attention and a ReLU MLP (4x), residuals, layer norm."""
    def var(name, shape):
        value = (rng.randn(*shape) / np.sqrt(shape[0])).astype(np.float32)
        return tf.compat.v1.get_variable(f"layer{index}/{name}", initializer=value)

    wq, wk, wv, wo = (var(n, [hidden, hidden]) for n in ("wq", "wk", "wv", "wo"))
    w1, w2 = var("ff1", [hidden, 4 * hidden]), var("ff2", [4 * hidden, hidden])
    q, k, v = (tf.einsum("bsd,de->bse", x, w) for w in (wq, wk, wv))
    attention = tf.nn.softmax(tf.einsum("bsd,btd->bst", q, k) / np.float32(np.sqrt(hidden)))
    h = x + tf.einsum("bsd,de->bse", tf.einsum("bst,btd->bsd", attention, v), wo)
    mean, variance = tf.nn.moments(h, axes=[-1], keepdims=True)
    h = (h - mean) * tf.math.rsqrt(variance + 1e-5)
    return h + tf.einsum("bsf,fd->bsd", tf.nn.relu(tf.einsum("bsd,df->bsf", h, w1)), w2)


def build(args, stages: int, batch: int, micro: int):
    """The K-stage encoder on a placeholder of one micro-batch (EPL's batch contract)
    fed with `micro` of them; returns (train_op, feed)."""
    rng = np.random.RandomState(0)
    features = tf.compat.v1.placeholder(tf.float32, [batch, args.seq, args.hidden])
    labels = tf.compat.v1.placeholder(tf.int32, [batch])
    h = features
    for i in range(args.layers):
        with epl.replicate(device_count=1, name=f"stage_{i * stages // args.layers}"):
            h = encoder_layer(h, i, args.hidden, rng)
    with epl.replicate(device_count=1, name=f"stage_{stages - 1}"):
        head = tf.compat.v1.get_variable(
            "head", initializer=(rng.randn(args.hidden, 8) * 0.1).astype(np.float32))
        logits = tf.matmul(tf.reduce_mean(h, axis=1), head)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=logits))
    train_op = tf.compat.v1.train.GradientDescentOptimizer(0.01).minimize(loss)
    feed = {features: rng.randn(batch * micro, args.seq, args.hidden).astype(np.float32),
            labels: rng.randint(0, 8, batch * micro)}
    return train_op, feed


def peak_bytes_per_device(metadata) -> dict[str, int]:
    """device -> peak of the running sum of its nodes' allocation records."""
    peaks = {}
    for device in metadata.step_stats.dev_stats:
        events = [(record.alloc_micros, record.alloc_bytes)
                  for node in device.node_stats for memory in node.memory
                  for record in memory.allocation_records]
        events.sort(key=lambda e: (e[0], -e[1]))  # at equal times count allocations first
        live = peak = 0
        for _, size in events:
            live += size
            peak = max(peak, live)
        peaks[_short(device.device)] = peak
    return peaks


def busy_intervals(metadata) -> dict[str, list[tuple[int, int]]]:
    """device -> [(start, end)] in microseconds of every op it ran."""
    spans = {}
    for device in metadata.step_stats.dev_stats:
        spans[_short(device.device)] = [
            (node.all_start_micros, node.all_start_micros + node.all_end_rel_micros)
            for node in device.node_stats if node.node_name != "_SOURCE"]
    return spans


def idle_fractions(spans: dict, devices: list[str]) -> list[float]:
    """Per device: 1 - (union of its busy intervals) / (the step's span over `devices`)."""
    starts = [s for d in devices for s, _ in spans[d]]
    ends = [e for d in devices for _, e in spans[d]]
    total = max(ends) - min(starts)
    fractions = []
    for d in devices:
        busy, current = 0, None
        for start, end in sorted(spans[d]):
            if current is None or start > current[1]:
                if current is not None:
                    busy += current[1] - current[0]
                current = [start, end]
            else:
                current[1] = max(current[1], end)
        if current is not None:
            busy += current[1] - current[0]
        fractions.append(1.0 - busy / total if total > 0 else 0.0)
    return fractions


def _short(device: str) -> str:
    return "/device:" + device.rsplit("/device:", 1)[-1]


def measure(args, stages: int, micro: int, strategy: str) -> dict:
    """Build, parallelize, warm up, then trace `args.repeats` steps of one configuration."""
    env.reset()
    epl.init(epl.Config({"cluster.virtual_devices": stages, "pipeline.num_micro_batch": micro,
                         "pipeline.strategy": strategy,
                         "pipeline.unit_functions": not args.copies}))
    devices = [f"/device:CPU:{s}" for s in range(stages)]
    with tf.Graph().as_default() as graph:
        train_op, feed = build(args, stages, args.micro_batch_size, micro)
        start = time.perf_counter()
        epl.parallelize(graph)
        rewrite_s = time.perf_counter() - start
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=args.inter_op)
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        peaks, idles, steps = [], [], []
        with tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train_op, feed)  # warm-up (graph optimization, first allocations)
            for _ in range(args.repeats):
                metadata = tf.compat.v1.RunMetadata()
                start = time.perf_counter()
                sess.run(train_op, feed, options=options, run_metadata=metadata)
                steps.append(time.perf_counter() - start)
                per_device = peak_bytes_per_device(metadata)
                peaks.append([per_device.get(d, 0) for d in devices])
                idles.append(idle_fractions(busy_intervals(metadata), devices))
    env.reset()
    return {"peak": [statistics.median(p[s] for p in peaks) for s in range(stages)],
            "idle": [statistics.median(i[s] for i in idles) for s in range(stages)],
            "step_s": statistics.median(steps), "rewrite_s": rewrite_s}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="1F1B vs GPipe: peak memory and bubble")
    parser.add_argument("--quick", action="store_true", help="tiny model, M in 2 4, 1 repeat")
    parser.add_argument("--copies", action="store_true",
                        help="pipeline.unit_functions off: a copy of each stage's ops per "
                             "micro-batch instead of a call of a shared function (the default)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inter-op", type=int, default=0, help="inter-op threads (0 = TF default)")
    args = parser.parse_args(argv)
    if args.quick:
        args.micro_batches, args.layers, args.hidden, args.seq = [2, 4], 2, 16, 8
        args.micro_batch_size, args.repeats = 4, 1
    stages = args.stages
    print(f"pipeline: {stages} stages on {stages} virtual CPU devices, {args.layers}-layer "
          f"encoder (hidden {args.hidden}, seq {args.seq}), micro-batch {args.micro_batch_size} "
          f"examples (global batch = M x {args.micro_batch_size}); medians of {args.repeats} "
          "traced steps" + ("; pipeline.unit_functions off (copies)" if args.copies else ""),
          flush=True)
    results = {}
    for micro in args.micro_batches:
        for strategy in STRATEGIES:
            results[(micro, strategy)] = measure(args, stages, micro, strategy)
    header = (["M", "schedule"] + [f"peak MB s{s}" for s in range(stages)]
              + [f"idle s{s}" for s in range(stages)] + ["idle mean", "(K-1)/(M+K-1)",
                                                         "step ms", "rewrite s"])
    rows = []
    for (micro, strategy), r in results.items():
        ideal = (stages - 1) / (micro + stages - 1)
        rows.append([micro, LABEL[strategy]] + [f"{b / 2**20:.2f}" for b in r["peak"]]
                    + [f"{f:.3f}" for f in r["idle"]]
                    + [f"{statistics.mean(r['idle']):.3f}", f"{ideal:.3f}",
                       f"{r['step_s'] * 1e3:.1f}", f"{r['rewrite_s']:.2f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in [header] + rows:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    first, last = args.micro_batches[0], args.micro_batches[-1]
    ratio = [results[(last, "PreferBackward")]["peak"][s] / results[(last, "PreferForward")]["peak"][s]
             for s in range(stages)]

    def growth(strategy):
        return [results[(last, strategy)]["peak"][s] / results[(first, strategy)]["peak"][s]
                for s in range(stages)]

    print(f"pipeline: peak memory 1F1B / GPipe at M={last} = "
          + ", ".join(f"{r:.2f} (stage {s})" for s, r in enumerate(ratio))
          + f"; growth M={first}->{last}: 1F1B "
          + ", ".join(f"{g:.2f}x" for g in growth("PreferBackward"))
          + ", GPipe " + ", ".join(f"{g:.2f}x" for g in growth("PreferForward"))
          + f" (ideal: 1F1B flat, GPipe {last / first:.0f}x)")
    print("pipeline: bubble (mean idle fraction over stages), measured vs GPipe's ideal "
          "(K-1)/(M+K-1): " + "; ".join(
              f"M={m}: GPipe {statistics.mean(results[(m, 'PreferForward')]['idle']):.3f}, "
              f"1F1B {statistics.mean(results[(m, 'PreferBackward')]['idle']):.3f}, "
              f"ideal {(stages - 1) / (m + stages - 1):.3f}" for m in args.micro_batches))
    return results


if __name__ == "__main__":
    main()
