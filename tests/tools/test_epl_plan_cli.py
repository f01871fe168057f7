"""epl-plan: grouped planning of huge clusters, the report's units, the
choice rule, unknown op types, --json, and a TensorFlow-free --model."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from epl.planner import balance
from epl.planner.model_spec import LayerSpec, ModelSpec
from epl.planner.planner import (DeviceLayout, PlanOptions, plan_cluster,
                                 size_text)
from epl.planner.data_parallel import _per_device_data_parallel
from epl.planner.search import _alternatives, _context
from epl.planner.profiles import parse_cluster
from epl.tools import plan as epl_plan

from paths import ROOT  # noqa: E402
GiB = float(1 << 30)


def _cli(capsys, *argv):
    code = epl_plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- grouping --

@pytest.mark.parametrize("cluster,batch", [
    ("2x8xV100-32GB", 512),
    ("2x8xV100-32GB", 509),            # rounding inside one group
    ("1x4xV100-32GB,1x4xT4", 256),
    ("1x3xV100-32GB,2x2xT4,1x3xV100-32GB", 101),  # a group on two runs
    ("1x2xA100-40GB@8x200Gbps,1x2xA100-40GB,1x2xT4", 37),
])
def test_grouped_plan_equals_the_per_device_plan(cluster, batch):
    model = epl_plan.builtin_model("bert-base")
    ctx = _context(model, parse_cluster(cluster), "adam", batch,
                   PlanOptions())
    for alt in _alternatives(ctx):
        assert alt.layout is not None  # computed per group
        reference = _per_device_data_parallel(
            ctx, alt.name, "even" not in alt.name,
            alt.checkpointing, alt.zero)
        assert alt.loads == reference.loads
        assert (alt.feasible, alt.reason) == (reference.feasible,
                                              reference.reason)
        assert alt.batch_sizes == reference.batch_sizes


def test_grouped_shares_round_like_device_by_device():
    # the leftover example goes to the lowest-indexed of the tied devices,
    # across the two runs of the fast group: device 3 of the slow group
    parts = balance.grouped_proportional_shares(
        23, [3.0, 1.0], [((0, 3), (5, 7)), ((3, 5),)])
    expanded = [0] * 7
    for group in parts:
        for size, runs in group:
            for first, end in runs:
                for i in range(first, end):
                    expanded[i] = size
    assert expanded == balance.proportional_shares(
        23, [3.0] * 3 + [1.0] * 2 + [3.0] * 2) == [4, 4, 4, 2, 1, 4, 4]
    assert parts[1] == [(2, ((3, 4),)), (1, ((4, 5),))]


def test_memory_moves_fall_back_to_the_per_device_balancer():
    # the fast devices cannot hold their capability share: examples move
    # one by one (balance_batch), which only the per-device path does
    overrides = {"FastSmall": {"base": "A100-40GB", "memory_bytes": "14GiB"}}
    model = ModelSpec("toy", tuple(LayerSpec(
        f"l{i}", flops_per_example=1e11, activation_bytes_per_example=0.25
        * GiB, parameter_bytes=0.05 * GiB) for i in range(4)))
    plan = plan_cluster(model, "1x2xFastSmall,1x2xT4", "sgd", 40,
                        overrides=overrides)
    balanced = plan.alternative("data-parallel, balanced by capability")
    assert balanced.layout is None  # per device
    assert balanced.batch_sizes == [12, 12, 8, 8]
    assert plan.alternative("data-parallel, even split").layout is not None


def test_huge_cluster_answers_in_seconds_with_one_row_per_group(capsys):
    start = time.perf_counter()
    code, out, err = _cli(capsys, "--cluster", "100000x8xV100-32GB",
                          "--model", "bert-base")
    assert time.perf_counter() - start < 60
    assert code == 0, err
    assert "Cluster: 100000 host(s), 800000 devices" in out
    table = [line for line in out.splitlines()
             if line.startswith("0-799999")]
    assert len(table) == 1 and table[0].split()[-1] == "800000"
    assert "batch sizes per replica: 32 x800000 (sum 25600000)" in out


def test_layout_makes_devices_on_demand():
    layout = DeviceLayout(parse_cluster("3x8xV100-32GB,1x4xT4"))
    assert len(layout) == 28
    assert (layout[27].host, layout[27].local) == (3, 3)
    assert [(c.profile.name, c.runs, c.count) for c in layout.classes] == [
        ("V100-32GB", ((0, 24),), 24), ("T4", ((24, 28),), 4)]


# ------------------------------------------------------------------ report --

@pytest.mark.parametrize("nbytes,text", [
    (0, "0"), (512, "512 B"), (3277, "3.2 KiB"), (419.3 * 2**20, "419.3 MiB"),
    (30.4 * GiB, "30.4 GiB"), (1.5 * 2**40, "1.5 TiB"), (1023.99 * GiB,
                                                         "1.0 TiB")])
def test_sizes_scale_their_unit(nbytes, text):
    assert size_text(nbytes) == text


def test_small_figures_are_readable(capsys):
    code, out, err = _cli(capsys, "--cluster", "1x2xV100-32GB", "--model",
                          "resnet50", "--global-batch", "2")
    assert code == 0, err
    assert "<0.1" not in out and "0.0/" not in out
    assert "MiB" in out


def test_a_faster_alternative_inside_the_margin_says_why(capsys):
    code, out, err = _cli(capsys, "--cluster", "2x8xV100-32GB", "--model",
                          "bert-base")
    assert code == 0, err
    assert re.search(
        r"^  data-parallel, balanced \+ ZeRO +352\.1 ms  fits, not chosen: "
        r"0\.99x the chosen step time \(within the 3% simplicity margin: a "
        r"plan listed earlier is chosen unless a later one is more than 3% "
        r"faster\)$", out, re.M)
    # a slower one needs no reason
    assert re.search(r"^  data-parallel, balanced \+ gradient checkpointing "
                     r"+450\.7 ms  fits, not chosen: 1\.27x the chosen step "
                     r"time$", out, re.M)


def test_unknown_op_types_are_named_with_counts():
    model = ModelSpec("g", (LayerSpec("l", flops_per_example=1e9,
                                      parameter_bytes=GiB),),
                      exact=False, unknown_op_types=(("Lgamma", 3),
                                                     ("Bucketize", 1)))
    text = plan_cluster(model, "1x2xV100-32GB", "sgd", 8).explain()
    assert ("Note: op types the cost model does not know (their bytes are "
            "counted, no FLOPs): Lgamma x3, Bucketize x1") in text


def test_model_from_graph_counts_unknown_op_types():
    import tensorflow as tf
    from epl.planner.graph_model import model_from_graph
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 8])
        y = tf.math.lgamma(tf.math.lgamma(x))
        tf.raw_ops.Bucketize(input=y, boundaries=[0.0, 1.0])
    spec = model_from_graph(graph)
    assert spec.unknown_op_types == (("Lgamma", 2), ("Bucketize", 1))


def test_json_output(capsys):
    code, out, err = _cli(capsys, "--cluster", "1x4xV100-32GB,1x4xT4",
                          "--model", "bert-base", "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["chosen"]["name"] == "data-parallel, balanced by capability"
    assert plan["chosen"]["batch_sizes"] == [{"batch": 42, "replicas": 4},
                                             {"batch": 22, "replicas": 4}]
    rows = plan["chosen"]["rows"]
    assert [(r["devices"], r["hosts"], r["count"], r["profile"], r["batch"])
            for r in rows] == [("0-3", "0", 4, "V100-32GB", 42),
                               ("4-7", "1", 4, "T4", 22)]
    assert plan["choice_rule"]["simplicity_margin"] == 0.03
    assert plan["model"]["unknown_op_types"] == {}
    names = [a["name"] for a in plan["alternatives"]]
    assert names[0] == "data-parallel, even split"
    assert all(a["step_time_s"] > 0 for a in plan["alternatives"]
               if a["feasible"])


def test_json_names_the_constraint_that_ruled_an_alternative_out(capsys):
    code, out, err = _cli(capsys, "--cluster", "1x8xV100-32GB", "--model",
                          "m6-mini", "--global-batch", "1024", "--json")
    assert code == 0, err
    rejected = [a for a in json.loads(out)["alternatives"]
                if not a["feasible"]]
    assert rejected and all(a["step_time_s"] is None and
                            "needs" in a["rejected_because"]
                            for a in rejected)


# -------------------------------------------------------------- TF-free --

def test_model_plans_without_importing_tensorflow():
    code = ("import sys\n"
            "from epl.tools import plan as epl_plan\n"
            "rc = epl_plan.main(['--model', 'bert-base', '--cluster', "
            "'2x8xV100-32GB'])\n"
            "assert rc == 0, rc\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
            "print('TF-FREE')\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("TF-FREE")


# -------------------------------------------------------------- calibrate --

def test_calibrate_writes_a_profile_file_that_profiles_accepts(tmp_path, capsys):
    from epl.tools import plan as epl_plan
    out = tmp_path / "cpu.json"
    assert epl_plan.main(["--calibrate", "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote the CPU profile to {out}")
    progress = [line for line in captured.err.splitlines()
                if line.startswith("calibrating the CPU profile: ")]
    assert [line.split(": ", 1)[1].split(" (")[0] for line in progress] == [
        "round 1 of 5", "round 2 of 5", "round 3 of 5", "round 4 of 5", "round 5 of 5",
        "fitting the step costs"]
    written = json.loads(out.read_text())
    assert list(written) == ["CPU"]
    assert written["CPU"]["op_overhead_s"] > 0
    assert epl_plan.main(["--model", "bert-base", "--cluster", "1x2xCPU",
                          "--profiles", str(out)]) == 0
    assert "2 x CPU" in capsys.readouterr().out


def test_calibrate_errors(tmp_path, capsys):
    from epl.tools import plan as epl_plan
    assert epl_plan.main(["--model", "bert-base"]) == 2
    assert capsys.readouterr().err.strip() == (
        "epl-plan: error: --cluster is required (or use --calibrate)")
    assert epl_plan.main(["--model", "bert-base", "--cluster", ""]) == 2
    assert capsys.readouterr().err.strip() == (
        "epl-plan: error: empty cluster spec ''; expected comma-separated tokens of the form "
        "[HOSTS x] [DEVICES_PER_HOST x] PROFILE [@ [NICS x] RATE], e.g. '2x8xV100-32GB,2x8xT4', "
        "'8xA100', 'V100' or '2x8xA100-80GB@8x200Gbps,2x8xT4@1x100Gbps'; RATE is one NIC's rate "
        "in Gbps or Gb/s (bits) or GBps or GB/s (bytes), NICS defaults to 1")
    assert epl_plan.main(["--model", "bert-base", "--cluster", "1xA10",
                          "--output", "x.json"]) == 2
    assert capsys.readouterr().err.strip() == (
        "epl-plan: error: --output is for --calibrate")


def test_calibration_warns_of_a_loaded_host_and_of_far_fitted_values(monkeypatch):
    import dataclasses
    assert epl_plan.host_load_warnings(load=0.9, cores=2) == []
    assert epl_plan.host_load_warnings(load=3.2, cores=2) == [
        "epl-plan: warning: the host is loaded (load average 3.2 over the last minute on 2 "
        "cores): the figures will measure that load, not the machine; calibrate on an idle "
        "host for figures that hold"]
    base = parse_cluster("1xT4")[0].profile
    from epl.planner.roofline import DEFAULT_EFFICIENCY
    fine = dataclasses.replace(base, step_overhead_s=0.4e-3, op_overhead_s=0.15e-6,
                               peak_flops={"float32": 140e9 / DEFAULT_EFFICIENCY},
                               replica_concurrency=0.8, replica_sync_s=0.3e-3, host_cores=2)
    assert epl_plan.calibration_warnings(fine) == []
    far = dataclasses.replace(fine, op_overhead_s=1.2e-6, replica_concurrency=0.2)
    assert epl_plan.calibration_warnings(far) == [
        "epl-plan: warning: op_overhead_s = 1.2 us is far outside the 0.1-0.2 us an idle "
        "2-core host fits (docs/planner.md, \"Planner calibration\"): the host was busy, or "
        "its CPU differs; check the figures before planning with them",
        "epl-plan: warning: replica_concurrency = 0.2 is far outside the 0.7-1 an idle "
        "2-core host fits (docs/planner.md, \"Planner calibration\"): the host was busy, or "
        "its CPU differs; check the figures before planning with them"]
    # calibrate() says both, through its progress function, around the measurement
    from epl.planner import calibration
    monkeypatch.setattr(calibration, "calibrate_cpu_profile",
                        lambda progress=None: (progress("round 1"), far)[1])
    monkeypatch.setattr(epl_plan, "host_load_warnings", lambda: ["loaded"])
    said = []
    epl_plan.calibrate(None, said.append)
    assert said[:2] == ["loaded", "round 1"] and len(said) == 4


# ------------------------------------------------------------------ --script --

def _script(tmp_path, body: str) -> str:
    path = tmp_path / "train.py"
    path.write_text("import tensorflow as tf\nimport epl\n"
                    "tf.compat.v1.disable_eager_execution()\n" + body)
    return str(path)


def test_capture_uses_epls_hooks_and_restores_the_state(tmp_path):
    """epl.capture stops the script at the session on the graph EPL would parallelize
    (a session on another graph runs); it patches nothing and restores EPL's state."""
    import tensorflow as tf
    import epl
    from epl import env
    from tensorflow.python.client import session as session_lib
    path = _script(tmp_path, """
with tf.Graph().as_default():
    with tf.compat.v1.Session() as other:      # no EPL step on this graph: it runs
        print("other graph", other.run(tf.constant(41) + 1))
epl.init(epl.Config({"pipeline.num_micro_batch": 2}))
x = tf.compat.v1.placeholder(tf.float32, [16, 8])
with epl.replicate(device_count=1, name="body"):
    loss = tf.reduce_mean(tf.compat.v1.layers.dense(x, 2, name="dense"))
tf.compat.v1.train.AdamOptimizer().minimize(loss)
tf.compat.v1.Session()
raise SystemExit("not reached: capture stops at the session above")
""")
    from epl import hooks as epl_hooks
    epl_hooks.install()   # EPL's own session hooks, as epl.init installs them
    hooks = (session_lib.BaseSession.__init__, tf.compat.v1.train.Scaffold.finalize,
             epl.init, epl.parallelize)
    before = env.save_state()
    captured = epl.capture(path, ["--flag"])
    assert (session_lib.BaseSession.__init__, tf.compat.v1.train.Scaffold.finalize,
            epl.init, epl.parallelize) == hooks
    assert env.save_state() == before and not env.capturing()
    assert captured.config.get("pipeline.num_micro_batch") == 2
    assert [tg.name for tg in captured.record.taskgraphs] == ["body"]
    assert captured.record.train_steps and not captured.record.parallelized
    assert captured.graph.get_operation_by_name("dense/MatMul").type == "MatMul"


def test_capture_stops_at_epl_parallelize_and_reports_failures(tmp_path):
    import epl
    path = _script(tmp_path, """
x = tf.compat.v1.placeholder(tf.float32, [4, 3])
loss = tf.reduce_mean(tf.compat.v1.layers.dense(x, 1))
tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
epl.parallelize()
raise SystemExit(3)
""")
    assert not epl.capture(path).record.parallelized
    with pytest.raises(epl.CaptureError) as caught:
        epl.capture(str(tmp_path / "missing.py"))
    assert str(caught.value) == f"training script {str(tmp_path / 'missing.py')!r} does not exist"
    exits = _script(tmp_path, "raise SystemExit(4)\n")
    with pytest.raises(epl.CaptureError) as caught:
        epl.capture(exits)
    assert str(caught.value) == (f"training script {exits!r} exited with 4 before creating "
                                 "a session")


@pytest.mark.parametrize("example, argv, layers, batch, unit", [
    ("train_mlp.py", [], "3 layers (hidden1, hidden2, logits) in 1 TaskGraph",
     "256 (4 replicas x 64)", 64),
    ("bert_pipeline.py", ["--devices", "2"],
     "6 layers (embeddings, layer_0, layer_1, layer_2, layer_3, mlm_head) in 2 TaskGraphs",
     "64 (2 replicas x 4 micro-batches x 8)", 8),
])
def test_script_plans_the_run_it_predicts(capsys, example, argv, layers, batch, unit):
    """train_mlp trains 4 x 64 = 256 per step on 4 devices; the 2-stage bert pipeline on
    4 devices runs 2 pipelines of 4 micro-batches of 8. Input ops are known to the cost
    model, and the script's own lines go to stderr."""
    code, out, err = _cli(capsys, "--cluster", "1x4xT4", "--script",
                          os.path.join(ROOT, "examples", example), "--", "--steps", "1", *argv)
    assert code == 0, err
    model_line, batch_line = out.splitlines()[:2]
    total = batch.split()[0]
    assert layers in model_line and f"global batch {total};" in model_line
    assert batch_line.startswith(f"Batch: global batch {batch} per step of this script on "
                                 "this cluster; the script's batch ")
    assert batch_line.endswith(f"; {unit} per (replica, micro-batch)")
    assert "does not know" not in out
    name = example.split(".")[0]
    assert f"{name}: " in err and f"{name}: " not in out.split("\n", 1)[1]


def test_script_in_global_batch_mode_slices_each_workers_batch(capsys, tmp_path):
    path = _script(tmp_path, """
epl.init(epl.Config({"io.batch_mode": "global"}))
x = tf.compat.v1.placeholder(tf.float32, [64, 8])
loss = tf.reduce_mean(tf.compat.v1.layers.dense(x, 2))
tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
tf.compat.v1.Session()
""")
    code, out, err = _cli(capsys, "--cluster", "2x4xT4", "--script", path, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["script_batch"] == {"global_batch": 128, "workers": 2, "replicas_per_worker": 4,
                                    "micro_batches": 1, "batch_mode": "global",
                                    "script_batch": 64}
    assert plan["model"]["model_layers"] == ["dense"]


def test_model_layers_are_the_scopes_of_the_variables():
    from epl.planner.graph_model import model_layer_names
    assert model_layer_names(["hidden1/kernel", "hidden1/bias", "hidden2/kernel",
                              "logits/kernel"]) == ("hidden1", "hidden2", "logits")
    assert model_layer_names(["dense/kernel", "dense/bias"]) == ("dense",)
    assert model_layer_names(["model/l1/w", "model/l2/w", "model/l1/b"]) == ("l1", "l2")
    assert model_layer_names(["position", "layer_0/attention/w", "layer_1/attention/w"]) == (
        "position", "layer_0", "layer_1")
    assert model_layer_names([]) == ()
