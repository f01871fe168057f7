"""Cost of the graph dumps: EPL's rewrite with `debug.dump_dir` against without, and epl-dump.

- rewrite: the time of `epl.parallelize` on examples/bert_pipeline.py's graph
  (4 layers, 2 stages x 4 micro-batches on 2 virtual devices: about 11,000 ops
  after the rewrite), built afresh each time, without and with `debug.dump_dir`,
  alternating (the order flips every repeat, so load drift on a shared machine
  falls on both). The ratio is the median with / the median without, of this
  process's CPU time (the rewrite runs in this thread; on a shared machine
  other processes' load moves the wall time by more than the dump costs) and,
  for reference, of the wall time; target <= 1.3 (a dump adds at most 30% to
  the rewrite).
- epl-dump: the wall time of `epl-dump DIR` (a fresh process: Python start,
  reading and reporting every pass) on the dump of examples/train_mlp.py
  (written here, one training step); the median of the repeats; target < 2 s.
  It imports no TensorFlow (the line says so).

Last lines:

    dump_overhead: ratio rewrite with dump / without = R (bert_pipeline, CPU time; wall W); target <= 1.3
    dump_overhead: epl-dump on the train_mlp dump = S s (median of N); target < 2 s

    python bench/dump_overhead.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from epl.observability.logs import quiet_tensorflow_startup  # noqa: E402

with quiet_tensorflow_startup():
    import tensorflow as tf  # noqa: E402

import bert_pipeline  # noqa: E402
import epl  # noqa: E402
from epl import env  # noqa: E402

TARGET_RATIO, TARGET_DUMP_S = 1.3, 2.0
EPL_DUMP = os.path.join(os.path.dirname(sys.executable), "epl-dump")


def rewrite_seconds(dump_dir: str | None) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of epl.parallelize on a fresh bert_pipeline graph
    (dumps to `dump_dir`)."""
    args = bert_pipeline.parse_args([])
    config = {"pipeline.num_micro_batch": args.micro_batches, "cluster.virtual_devices": 2}
    if dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)
        config["debug.dump_dir"] = dump_dir
    env.reset()
    epl.init(epl.Config(config))
    graph = tf.Graph()
    with graph.as_default():
        bert_pipeline.build(args)
        cpu, wall = time.process_time(), time.perf_counter()
        epl.parallelize(graph)
        return time.process_time() - cpu, time.perf_counter() - wall


def train_mlp_dump(dump_dir: str) -> None:
    """Write examples/train_mlp.py's dump (one step) to `dump_dir`, in a subprocess."""
    environ = dict(os.environ, EPL_DEBUG_DUMP_DIR=dump_dir, TF_USE_LEGACY_KERAS="1")
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_mlp.py"), "--steps",
                    "1"], env=environ, check=True, capture_output=True, timeout=600)


def epl_dump_seconds(dump_dir: str) -> tuple[float, bool]:
    """(wall seconds of `epl-dump DIR`, whether it imported TensorFlow)."""
    probe = ("import runpy, sys; sys.argv = ['epl-dump', %r]; "
             "from epl.tools.dump import main; code = main(); "
             "sys.stderr.write('TF %%s\\n' %% ('tensorflow' in sys.modules)); sys.exit(code)"
             % dump_dir)
    start = time.perf_counter()
    subprocess.run([EPL_DUMP, dump_dir], check=True, capture_output=True, timeout=120)
    seconds = time.perf_counter() - start
    result = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True,
                            text=True, timeout=120)
    return seconds, "TF True" in result.stderr


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="epl-dump-bench-")
    try:
        times = {False: [], True: []}
        for repeat in range(args.repeats):
            for dumped in ((False, True) if repeat % 2 == 0 else (True, False)):
                times[dumped].append(rewrite_seconds(os.path.join(work, "bert") if dumped
                                                     else None))
        (plain, plain_wall), (dumped, dumped_wall) = (
            [statistics.median(t[i] for t in times[key]) for i in (0, 1)]
            for key in (False, True))
        print(f"rewrite of bert_pipeline: {plain:.3f} s CPU ({plain_wall:.3f} s wall) without "
              f"a dump, {dumped:.3f} s CPU ({dumped_wall:.3f} s wall) with (medians of "
              f"{args.repeats})")
        mlp = os.path.join(work, "mlp")
        train_mlp_dump(mlp)
        size = sum(os.path.getsize(os.path.join(mlp, n)) for n in os.listdir(mlp))
        runs = [epl_dump_seconds(mlp) for _ in range(args.repeats)]
        dump_s = statistics.median(seconds for seconds, _ in runs)
        imported = any(tf_loaded for _, tf_loaded in runs)
        print(f"dump_overhead: ratio rewrite with dump / without = {dumped / plain:.2f} "
              f"(bert_pipeline, CPU time; wall {dumped_wall / plain_wall:.2f}); "
              f"target <= {TARGET_RATIO}")
        print(f"dump_overhead: epl-dump on the train_mlp dump ({size / 2**20:.2f} MiB) = "
              f"{dump_s:.2f} s (median of {args.repeats}; TensorFlow "
              f"{'imported' if imported else 'not imported'}); target < {TARGET_DUMP_S:g} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
