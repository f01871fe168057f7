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
from epl.planner.search import _alternatives, _context, _per_device_data_parallel
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
    assert capsys.readouterr().out.startswith(f"wrote the CPU profile to {out}")
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
