"""Step time of EPL data parallelism against tf.distribute.MirroredStrategy.

Both sides train the same model (an MLP, 4 x 512 ReLU layers, and a small
transformer) on the same global batch with Adam, data-parallel over the same
2 virtual CPU devices of one process:

- epl: a `tf.compat.v1` graph built under `epl.replicate(device_count=1)`,
  `tf.compat.v1.train.AdamOptimizer.minimize`, `epl.parallelize` with
  `cluster.virtual_devices: 2` (the plan must have 2 replicas, checked), one
  `Session.run([train_op, loss])` per step.
- mirrored: TF2 style. `tf.config.set_logical_device_configuration` splits the
  CPU into 2 logical devices, `tf.distribute.MirroredStrategy` over them,
  `tf.Variable`s and `tf.keras.optimizers.Adam` (Keras 3; it all-reduces the
  gradients with SUM, so each replica's loss is divided by the replica count,
  as `tf.nn.compute_average_loss` does) created in the strategy's scope, a
  `tf.function` step of `strategy.run` + `apply_gradients` returning the
  loss reduced over the replicas.
- plain (reference, `--plain`, not part of the ratio): the epl side's graph
  without EPL, on one device, the whole global batch.

The batch is a constant in both programs (on the EPL side a tf.constant that
the replicate pass slices; on the MirroredStrategy side one slice per replica
from `experimental_distribute_values_from_function`), so neither side pays
for an input pipeline.

Logical devices must be configured before any other TensorFlow use, so each
side runs in its own subprocess: `python bench/dp_overhead.py --side
epl|mirrored|plain --serve` builds every model, runs `--warmup` untimed steps,
then waits for commands on stdin. The parent keeps all sides alive and
alternates them: each repetition runs `--steps` timed steps (after
`--burst-warmup` untimed ones) of one side, then of the other, so both see the
same load on a shared machine. Reported per side: the median over repetitions
of the median step time of a repetition. The ratio is the median over
repetitions of EPL's step time over MirroredStrategy's in the same repetition
(paired, so that load drift between repetitions cancels); the ratio of the two
medians is printed next to it. Without `--serve`, `--side` runs
warm-up and `--steps` steps once and prints one `DP_RESULT {json}` line per
model.

Last line: `dp_overhead: EPL/MirroredStrategy step time ratio = X.XX (target <= 1.0)`
for the first model (the MLP); a line per model precedes it.

    python bench/dp_overhead.py                   # MLP + transformer, 8 reps x 25 steps
    python bench/dp_overhead.py --plain --profile # + single-device reference, traced steps
    python bench/dp_overhead.py --quick           # tiny MLP, few steps (smoke test)
    python bench/dp_overhead.py --device gpu      # on the GPUs (make gpu-check)

With `--device gpu` both sides run on this machine's GPUs instead: all of
them where there are two or more (EPL's local collectives and
MirroredStrategy's all-reduce both use NCCL), or one GPU split into 2 logical
GPUs (`epl.runtime.cluster.use_logical_gpus`; EPL's collectives then use TensorFlow's
ring and MirroredStrategy reduces to one device, NCCL refusing a GPU twice).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TARGET = 1.0
RESULT_TAG = "DP_RESULT "
READY_TAG = "DP_READY "
NUM_DEVICES = 2                 # virtual CPU devices, or logical GPUs on a one-GPU machine
LOGICAL_GPU_MEMORY_MB = 8192    # each logical GPU's share with --device gpu on one GPU
MODELS = ("mlp", "transformer")


# -- settings ----------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", choices=["epl", "mirrored", "plain"],
                        help="run one side in this process (see --serve)")
    parser.add_argument("--serve", action="store_true",
                        help="with --side: build, warm up, then run steps on the parent's commands")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--mlp-batch", type=int, default=256, help="global batch of the MLP")
    parser.add_argument("--transformer-batch", type=int, default=64,
                        help="global batch of the transformer")
    parser.add_argument("--steps", type=int, default=25, help="timed steps per repetition")
    parser.add_argument("--reps", type=int, default=8, help="repetitions (alternating sides)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps after building")
    parser.add_argument("--burst-warmup", type=int, default=2,
                        help="untimed steps before each repetition's timed ones")
    parser.add_argument("--intra", type=int, default=0, help="intra-op threads (0: TF default)")
    parser.add_argument("--inter", type=int, default=0, help="inter-op threads (0: TF default)")
    parser.add_argument("--plain", action="store_true",
                        help="also time the single-device reference (plain TF graph, no EPL)")
    parser.add_argument("--profile", action="store_true",
                        help="also trace EPL and plain steps (RunMetadata) and summarize them")
    parser.add_argument("--quick", action="store_true", help="tiny MLP, few steps (smoke test)")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="virtual CPU devices (default) or this machine's GPUs")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.steps, args.reps, args.warmup, args.burst_warmup = ["mlp"], 5, 1, 2, 0
        args.plain = args.profile = False
    args.models = list(dict.fromkeys(args.models))
    return args


def model_spec(name: str, quick: bool):
    """The model spec of `name` ("mlp" or "transformer")."""
    from common import MLPSpec, TransformerSpec
    if name == "mlp":
        return MLPSpec(input_dim=32, width=32, layers=2) if quick else MLPSpec()
    if quick:
        return TransformerSpec(layers=1, hidden=16, heads=2, ffn=32, seq=4, input_dim=8)
    return TransformerSpec(layers=4, hidden=64, heads=4, ffn=256, seq=16, input_dim=32)


def global_batch(args, name: str) -> int:
    """The global batch size of model `name`."""
    if args.quick:
        return 8
    return args.mlp_batch if name == "mlp" else args.transformer_batch


# -- one side (child process) ------------------------------------------------------------

class Runner:
    """One model's training step on one side: step() -> loss, profile() -> summary or None."""

    info: dict

    def step(self) -> float:
        raise NotImplementedError

    def profile(self, steps: int) -> dict | None:
        return None

    def time_steps(self, warmup: int, steps: int) -> dict:
        """`warmup` untimed then `steps` timed steps: {"times": seconds, "losses": ...}."""
        for _ in range(warmup):
            self.step()
        times, losses = [], []
        for _ in range(steps):
            start = time.perf_counter()
            loss = self.step()
            times.append(time.perf_counter() - start)
            losses.append(float(loss))
        return {"times": times, "losses": losses}


class V1Runner(Runner):
    """The epl side (use_epl) or the plain single-device reference: a tf.compat.v1 Session."""

    def __init__(self, args, spec, x, y, use_epl: bool):
        import tensorflow as tf
        import epl
        from common import model_fns, v1_variable
        params_fn, loss_fn, _ = model_fns(spec)
        graph = tf.Graph()
        with graph.as_default():
            inputs, labels = tf.constant(x, name="inputs"), tf.constant(y, name="labels")
            if use_epl:
                with epl.replicate(device_count=1):
                    loss = loss_fn(spec, params_fn(spec, v1_variable), inputs, labels)
            else:
                loss = loss_fn(spec, params_fn(spec, v1_variable), inputs, labels)
            train_op = tf.compat.v1.train.AdamOptimizer(1e-3).minimize(loss)
            init = tf.compat.v1.global_variables_initializer()
        self.info = {"num_replicas": 1}
        if use_epl:
            result = epl.parallelize(graph)
            expected = len(device_names(args)) if args.device == "gpu" else NUM_DEVICES
            if result.plan.num_replicas != expected:
                raise AssertionError(
                    f"EPL plan has {result.plan.num_replicas} replicas, expected {expected}")
            self.info = {"num_replicas": result.plan.num_replicas,
                         "devices": sorted({d for ds in result.plan.devices.values() for d in ds})}
        self.info["graph_ops"] = len(graph.get_operations())
        config = tf.compat.v1.ConfigProto()
        if args.device == "gpu":  # TensorFlow's default config: it holds the logical GPUs
            from tensorflow.python.eager import context
            config.CopyFrom(context.context().config)
        config.intra_op_parallelism_threads = args.intra
        config.inter_op_parallelism_threads = args.inter
        self.session = tf.compat.v1.Session(graph=graph, config=config)
        self.session.run(init)
        self.fetches = [train_op, loss]

    def step(self) -> float:
        return self.session.run(self.fetches)[1]

    def profile(self, steps: int) -> dict:
        """Trace `steps` runs: per device op count and summed op time; top op types."""
        import tensorflow as tf
        options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        devices = collections.defaultdict(lambda: [0, 0.0])
        types, counts, walls = collections.Counter(), collections.Counter(), []
        for _ in range(steps):
            metadata = tf.compat.v1.RunMetadata()
            start = time.perf_counter()
            self.session.run(self.fetches, options=options, run_metadata=metadata)
            walls.append(time.perf_counter() - start)
            for dev in metadata.step_stats.dev_stats:
                name = dev.device.split("/")[-1]
                for node in dev.node_stats:
                    ms = node.all_end_rel_micros / 1e3
                    devices[name][0] += 1
                    devices[name][1] += ms
                    op_type = node.timeline_label.split("(")[0].split(" = ")[-1].strip()
                    types[op_type or node.node_name] += ms
                    counts[op_type or node.node_name] += 1
        return {"per_device": {d: [n / steps, ms / steps] for d, (n, ms) in sorted(devices.items())},
                "top_types": [[t, ms / steps, counts[t] / steps] for t, ms in types.most_common(12)],
                "traced_wall_ms": 1e3 * min(walls)}


def configure_devices(args) -> None:
    """Before any other TF use: 2 logical CPU devices (the mirrored side; the epl side
    asks for virtual CPU devices through its config), or with --device gpu, 2 logical
    GPUs where there is one GPU (both sides)."""
    import tensorflow as tf
    if args.device == "gpu":
        if len(tf.config.list_physical_devices("GPU")) == 1:
            from epl.runtime.cluster import use_logical_gpus
            use_logical_gpus(NUM_DEVICES, LOGICAL_GPU_MEMORY_MB)
    elif args.side == "mirrored":
        cpus = tf.config.list_physical_devices("CPU")
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(NUM_DEVICES)])


def device_names(args) -> list[str]:
    """The devices both sides train on (after configure_devices; on CPU the
    mirrored side's logical devices, the epl side's come from its session)."""
    import tensorflow as tf
    if args.device == "gpu":
        return [d.name for d in tf.config.list_logical_devices("GPU")]
    return [d.name for d in tf.config.list_logical_devices("CPU")][:NUM_DEVICES]


def make_mirrored_strategy(args):
    """A MirroredStrategy over the devices (configure_devices ran first)."""
    import tensorflow as tf
    if args.intra:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra)
    if args.inter:
        tf.config.threading.set_inter_op_parallelism_threads(args.inter)
    devices = device_names(args)
    strategy = tf.distribute.MirroredStrategy(devices)
    if strategy.num_replicas_in_sync != len(devices):
        raise AssertionError(f"MirroredStrategy has {strategy.num_replicas_in_sync} replicas, "
                             f"expected {len(devices)}")
    return strategy


def _describe_cross_device_ops(strategy) -> str:
    """The class (and implementation) MirroredStrategy picked for all-reduce (private fields)."""
    extended = strategy.extended
    ops = getattr(extended, "_cross_device_ops", None)
    if ops is None:
        return "unknown"
    implementation = getattr(getattr(extended, "_communication_options", None), "implementation", None)
    return type(ops).__name__ + (f" ({implementation.name})" if implementation is not None else "")


class MirroredRunner(Runner):
    """The MirroredStrategy side: a tf.function step of strategy.run + Keras Adam."""

    def __init__(self, strategy, spec, x, y):
        import tensorflow as tf
        from common import model_fns, v2_variable
        params_fn, loss_fn, _ = model_fns(spec)
        replicas = strategy.num_replicas_in_sync
        with strategy.scope():
            params = params_fn(spec, v2_variable)
            variables = list(params.values())
            optimizer = tf.keras.optimizers.Adam(1e-3)
            optimizer.build(variables)
        per_replica = len(x) // replicas

        def replica_batch(ctx):
            part = slice(ctx.replica_id_in_sync_group * per_replica,
                         (ctx.replica_id_in_sync_group + 1) * per_replica)
            return tf.constant(x[part]), tf.constant(y[part])

        inputs, labels = strategy.experimental_distribute_values_from_function(replica_batch)

        def step_fn(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(spec, params, xb, yb)
                scaled = loss / replicas       # Keras' optimizer sums gradients over replicas
            grads = tape.gradient(scaled, variables)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        @tf.function
        def train_step(xs, ys):
            losses = strategy.run(step_fn, args=(xs, ys))
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, losses, axis=None)

        self.step = lambda: train_step(inputs, labels).numpy()
        self.step()  # trace
        self.info = {"num_replicas": replicas, "devices": list(strategy.extended.worker_devices),
                     "graph_ops": len(train_step.get_concrete_function(inputs, labels)
                                      .graph.get_operations()),
                     "cross_device_ops": _describe_cross_device_ops(strategy)}


def make_runners(args) -> dict:
    """Build every model of args.models on args.side; return {model: Runner}."""
    from common import model_fns
    configure_devices(args)
    strategy = make_mirrored_strategy(args) if args.side == "mirrored" else None
    if args.side == "epl":
        import epl
        epl.init(epl.Config({"cluster.virtual_devices": NUM_DEVICES}))
    runners = {}
    for model in args.models:
        spec = model_spec(model, args.quick)
        x, y = model_fns(spec)[2](spec, global_batch(args, model))
        if strategy is not None:
            runners[model] = MirroredRunner(strategy, spec, x, y)
        else:
            runners[model] = V1Runner(args, spec, x, y, use_epl=args.side == "epl")
        runners[model].time_steps(args.warmup, 0)
    return runners


def run_side(args) -> None:
    """Child process. One-shot: print a DP_RESULT per model. --serve: answer the parent's commands.

    Commands (one per line on stdin, one JSON line answered on stdout):
    `run MODEL STEPS WARMUP` -> {"times", "losses"}; `profile MODEL STEPS` -> summary; `quit`.
    """
    runners = make_runners(args)
    if not args.serve:
        for model, runner in runners.items():
            result = runner.time_steps(0, args.steps)
            result.update(runner.info, side=args.side, model=model)
            print(RESULT_TAG + json.dumps(result), flush=True)
        return
    print(READY_TAG + json.dumps({m: r.info for m, r in runners.items()}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "run":
            answer = runners[words[1]].time_steps(int(words[3]), int(words[2]))
        elif words[0] == "profile":
            answer = runners[words[1]].profile(int(words[2]))
        else:
            answer = {"error": f"unknown command {line.strip()!r}"}
        print(json.dumps(answer), flush=True)


# -- parent ------------------------------------------------------------------------------

class Side:
    """A child process serving one side; commands are answered one JSON line each."""

    def __init__(self, args, side: str):
        self.name = side
        self.cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--serve",
                    "--models", *args.models, "--warmup", str(args.warmup),
                    "--mlp-batch", str(args.mlp_batch),
                    "--transformer-batch", str(args.transformer_batch),
                    "--intra", str(args.intra), "--inter", str(args.inter),
                    "--device", args.device]
        if args.quick:
            self.cmd.append("--quick")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        self.stderr = tempfile.TemporaryFile(mode="w+")   # a pipe could fill up and block
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env)
        self.info = None

    def wait_ready(self) -> dict:
        """Wait for the child to build and warm up; return {model: info}."""
        for line in self.proc.stdout:
            if line.startswith(READY_TAG):
                self.info = json.loads(line[len(READY_TAG):])
                return self.info
        self._fail()

    def ask(self, command: str) -> dict:
        """Send one command and return its JSON answer."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self._fail()
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()

    def _fail(self):
        self.proc.kill()
        self.proc.wait()
        self.stderr.seek(0)
        stderr = self.stderr.read()
        raise RuntimeError(f"{' '.join(self.cmd)}\nfailed (exit code {self.proc.returncode}):\n"
                           f"{stderr[-4000:]}")


def measure(args, sides: dict) -> dict:
    """Alternate the sides over args.reps repetitions; return {model: {side: [rep results]}}."""
    runs = {model: {name: [] for name in sides} for model in args.models}
    names = list(sides)
    for rep in range(args.reps):
        order = names if rep % 2 == 0 else names[::-1]
        for model in args.models:
            for name in order:
                runs[model][name].append(
                    sides[name].ask(f"run {model} {args.steps} {args.burst_warmup}"))
    return runs


def summarize(results: list[dict], batch: int) -> dict:
    """Median over repetitions of each repetition's median step time."""
    from common import median
    per_rep = [median(r["times"]) for r in results]
    step = median(per_rep)
    return {"step_s": step, "samples_per_s": batch / step, "per_rep": per_rep,
            "first_loss": results[0]["losses"][0], "last_loss": results[-1]["losses"][-1]}


def print_profile(model: str, side: str, profile: dict) -> None:
    from common import format_table
    print(f"\nprofile ({model}, {side}): traced step wall {profile['traced_wall_ms']:.2f} ms")
    print(format_table(["device", "ops/step", "sum of op times ms/step"],
                       [[d, n, ms] for d, (n, ms) in profile["per_device"].items()]))
    print(format_table(["op type", "ms/step", "count/step"], profile["top_types"]))


def main(argv=None) -> dict:
    """Run every side of every model, print the table and the ratio lines; return the ratios."""
    args = parse_args(argv)
    if args.side:
        run_side(args)
        return {}
    from common import format_table, median
    names = ["epl", "mirrored"] + (["plain"] if args.plain or args.profile else [])
    sides = {}
    try:
        for name in names:          # the children build concurrently, then take turns
            sides[name] = Side(args, name)
        for side in sides.values():
            side.wait_ready()
        runs = measure(args, sides)
        profiles = {}
        if args.profile:
            for name in ("epl", "plain"):
                profiles[name] = {m: sides[name].ask(f"profile {m} 5") for m in args.models}
    finally:
        for side in sides.values():
            side.close()

    import tensorflow as tf
    where = (f"{len(sides['epl'].info[args.models[0]]['devices'])} GPU devices"
             if args.device == "gpu" else f"{NUM_DEVICES} virtual CPU devices")
    print(f"dp_overhead: {where}, Adam, sides alternating over "
          f"{args.reps} rep(s) of {args.steps} timed steps (after {args.warmup} warm-up); median "
          f"over reps of each rep's median; TensorFlow {tf.__version__}, {os.cpu_count()} CPU cores")
    ratios, rows = {}, []
    for model in args.models:
        batch = global_batch(args, model)
        summary = {name: summarize(runs[model][name], batch) for name in names}
        per_rep = [e / m for e, m in zip(summary["epl"]["per_rep"], summary["mirrored"]["per_rep"])]
        ratios[model] = median(per_rep)
        of_medians = summary["epl"]["step_s"] / summary["mirrored"]["step_s"]
        for name in names:
            s, info = summary[name], sides[name].info[model]
            rows.append([model, name, batch, info["num_replicas"], info["graph_ops"],
                         1e3 * s["step_s"], s["samples_per_s"],
                         " ".join(f"{1e3 * t:.1f}" for t in s["per_rep"]),
                         f"{s['first_loss']:.3f}->{s['last_loss']:.4f}"])
        print(f"{model}: MirroredStrategy all-reduce: {sides['mirrored'].info[model]['cross_device_ops']}"
              f"; EPL/Mirrored per rep: {' '.join(f'{r:.2f}' for r in per_rep)}; ratio of the "
              f"medians: {of_medians:.2f}")
    for name, by_model in profiles.items():
        for model, profile in by_model.items():
            print_profile(model, name, profile)
    print()
    print(format_table(["model", "side", "global batch", "replicas", "graph ops", "step ms",
                        "samples/s", "step ms per rep", "loss"], rows))
    print("(graph ops: the whole parallel graph for epl, the traced tf.function for mirrored)")
    for model, ratio in ratios.items():
        print(f"dp_overhead[{model}]: EPL/MirroredStrategy step time ratio = {ratio:.2f}")
    print(f"dp_overhead: EPL/MirroredStrategy step time ratio = {ratios[args.models[0]]:.2f} "
          f"(target <= {TARGET})")
    return ratios


if __name__ == "__main__":
    main()
