"""Tests of the hardware-aware planner: balancing, plans, explain, epl-plan."""
import re

import pytest
import tensorflow as tf

import epl
from epl import env
from epl.errors import ClusterError
from epl.planner import balance
from epl.planner.balance import (balance_batch, balance_shards,
                                 proportional_shares)
from epl.planner.stage_cuts import balance_stages
from epl.planner.planner import (LayerSpec, ModelSpec, PlanOptions,
                                 model_from_graph, plan_cluster,
                                 replica_weights_for_local_devices)
from epl.planner.profiles import virtual_cpu_profiles
from epl.tools import plan as epl_plan

GiB = float(1 << 30)
FAST_SLOW = ["V100", "V100", "T4", "T4"]


@pytest.fixture(autouse=True)
def fresh_epl():
    env.reset()
    yield
    env.reset()


def _model(layers=4, act_gb=0.05, params_gb=0.025, gflop=100.0, name="toy"):
    """A ModelSpec of identical layers (per-example figures)."""
    return ModelSpec(name, tuple(
        LayerSpec(f"layer_{i}", flops_per_example=gflop * 1e9,
                  activation_bytes_per_example=act_gb * GiB,
                  parameter_bytes=params_gb * GiB)
        for i in range(layers)))


# ------------------------------------------------------------ balance_batch --

def test_batch_shares_follow_capability():
    shares = balance_batch(12, [2.0, 2.0, 1.0, 1.0])
    assert shares.sizes == (4, 4, 2, 2)
    assert shares.moves == ()
    assert shares.weights == (4 / 12, 4 / 12, 2 / 12, 2 / 12)
    # largest remainder: 100 * 2/6 = 33.33.., 100 * 1/6 = 16.67 -> 33,33,17,17
    assert balance_batch(100, [2.0, 2.0, 1.0, 1.0]).sizes == (33, 33, 17, 17)


def test_rounding_ties_go_to_faster_then_lower_index():
    assert proportional_shares(3, [1.0, 1.0, 1.0, 1.0]) == [1, 1, 1, 0]
    assert proportional_shares(10, [3.0, 1.0]) == [8, 2]  # 7.5/2.5: faster
    assert proportional_shares(1, [1.0, 2.0]) == [0, 1]


def test_tight_memory_on_fast_devices_moves_load_to_slow_ones():
    # 2 fast (2x) + 2 slow; the fast ones hold only 5 examples each.
    shares = balance_batch(24, [2.0, 2.0, 1.0, 1.0],
                           memory_per_example=1 * GiB, fixed_memory=2 * GiB,
                           capacity=[7 * GiB, 7 * GiB, 20 * GiB, 20 * GiB],
                           names=FAST_SLOW)
    assert shares.sizes == (5, 5, 7, 7)
    assert sum(shares.sizes) == 24
    assert all(m <= c for m, c in zip(shares.memory, shares.capacity))
    # one example at a time to whichever slow device finishes first
    assert shares.moves == (balance.Move(0, 2, 2), balance.Move(0, 3, 1),
                            balance.Move(1, 3, 2), balance.Move(1, 2, 1))
    assert shares.makespan == 7.0


def test_moved_load_goes_to_least_loaded_device():
    # device 0 overflows by 3; device 2 (fast, idle) finishes first.
    shares = balance_batch(12, [1.0, 1.0, 4.0], memory_per_example=1.0,
                           capacity=[1.0, 100.0, 100.0])
    assert shares.sizes == (1, 2, 9)


def test_fixed_time_makes_devices_finish_together():
    shares = balance_batch(10, [1.0, 1.0], fixed_time=[4.0, 0.0])
    assert shares.sizes == (3, 7)
    assert shares.times == (7.0, 7.0)


def test_nothing_fits_names_each_shortfall_and_remedies():
    with pytest.raises(ClusterError) as err:
        balance_batch(100, [2.0, 2.0, 1.0, 1.0], memory_per_example=GiB,
                      fixed_memory=2 * GiB,
                      capacity=[16 * GiB, 16 * GiB, 8 * GiB, 8 * GiB],
                      names=FAST_SLOW)
    assert str(err.value) == (
        "the global batch of 100 examples does not fit in device memory: the "
        "devices hold at most 40 of the 100 examples. At each device's "
        "capability share:\n"
        "  devices 0-1 (V100): 33 examples need 35.0 GB (2.0 GB fixed + "
        "33.0 GB for the examples) with 16.0 GB available: short by 19.0 GB\n"
        "  devices 2-3 (T4): 17 examples need 19.0 GB (2.0 GB fixed + 17.0 GB "
        "for the examples) with 8.0 GB available: short by 11.0 GB\n"
        "What would help: gradient checkpointing (activations take up to "
        "33.0 GB per device and shrink to about the square root of the number "
        "of layers' worth); ZeRO or offloading parameters and optimizer state "
        "to host memory (fixed memory is up to 2.0 GB per device); more "
        "devices (about 5 more like the roomiest one, which holds 14 "
        "examples); a smaller global batch (at most 40 examples fit).")


def test_model_alone_over_capacity_is_named():
    with pytest.raises(ClusterError) as err:
        balance_batch(8, [1.0, 1.0], memory_per_example=0.1 * GiB,
                      fixed_memory=[4 * GiB, 20 * GiB],
                      capacity=[16 * GiB, 15 * GiB], names=["V100", "T4"])
    text = str(err.value)
    assert ("device 1 (T4): 20.0 GB before any example (parameters, "
            "gradients, optimizer state) with 15.0 GB available: short by "
            "5.0 GB") in text
    assert "pipeline or split parallelism" in text
    assert "smaller global batch" not in text


def test_bad_balance_inputs():
    with pytest.raises(ClusterError, match="capabilities must be positive"):
        balance_batch(4, [1.0, 0.0])
    with pytest.raises(ClusterError, match="3 values for 2 devices"):
        balance_batch(4, [1.0, 1.0], fixed_memory=[1.0, 2.0, 3.0])


# ------------------------------------------------------ shards and stages --

def test_shard_sizes_follow_capability_with_at_least_one_each():
    assert balance_shards(10, [3.0, 1.0]).sizes == (8, 2)
    assert balance_shards(32, [2.5] * 2 + [1.0] * 2).sizes == (11, 11, 5, 5)
    assert balance_shards(4, [10.0, 1.0, 1.0, 1.0]).sizes == (1, 1, 1, 1)
    with pytest.raises(ClusterError, match="cannot be split into 4 shards"):
        balance_shards(3, [1.0] * 4)


def test_shards_move_off_a_device_without_memory():
    shards = balance_shards(12, [3.0, 1.0], memory_per_unit=GiB,
                            capacity=[4 * GiB, 100 * GiB])
    assert shards.sizes == (4, 8)


def test_stage_cuts_balance_capability_and_put_memory_first():
    cuts = balance_stages([1.0] * 6, [2.0, 1.0], stage_memory=[100.0, 200.0],
                          layer_memory=[10.0] * 6)
    assert cuts.devices == (1, 0)  # more memory first
    assert cuts.bounds == ((0, 2), (2, 6))  # the 2x faster device: 4 layers
    assert cuts.times == (2.0, 2.0)
    assert cuts.memory == (20.0, 40.0)


def test_stage_cuts_respect_memory_and_in_flight_activations():
    # stage 0 keeps 2 micro-batches alive: its cut shrinks to fit.
    cuts = balance_stages([1.0] * 4, [1.0, 1.0], stage_memory=[6.0, 6.0],
                          layer_activation_memory=[2.0] * 4,
                          activation_multiplier=[2.0, 1.0])
    assert cuts.bounds == ((0, 1), (1, 4))
    assert cuts.memory == (4.0, 6.0)


def test_stage_cuts_that_fit_nowhere_say_which_stage_needs_what():
    with pytest.raises(ClusterError) as err:
        balance_stages([1.0] * 4, [1.0, 1.0],
                       stage_memory=[15 * GiB, 16 * GiB],
                       layer_memory=[10 * GiB] * 4, names=["T4", "V100"])
    assert str(err.value).splitlines()[:3] == [
        "no pipeline cut fits in device memory. In the fastest cut:",
        "  stage 0 (layers 0-1) needs 20.0 GB on device 1 (V100) with 16.0 GB "
        "available: short by 4.0 GB",
        "  stage 1 (layers 2-3) needs 20.0 GB on device 0 (T4) with 15.0 GB "
        "available: short by 5.0 GB"]
    assert "What would help: gradient checkpointing" in str(err.value)


# ----------------------------------------------------------- plan_cluster --

def test_plan_balances_a_mixed_cluster_by_capability():
    plan = plan_cluster(_model(), "1x2xV100-32GB,1x2xT4", "sgd", 60)
    balanced = plan.alternative("data-parallel, balanced by capability")
    even = plan.alternative("data-parallel, even split")
    sizes = balanced.batch_sizes
    assert sum(sizes) == 60 and sizes[0] == sizes[1] and sizes[2] == sizes[3]
    assert sizes[0] / sizes[2] == pytest.approx(15.7 / 8.1, rel=0.1)
    assert even.batch_sizes == [15, 15, 15, 15]
    assert balanced.step_time < even.step_time
    assert plan.chosen.feasible
    assert abs(sum(plan.replica_weights) - 1) < 1e-12


def test_plan_moves_load_when_fast_devices_run_short_of_memory():
    # A fast device whose memory is small (override) gets fewer examples.
    # An A100 with 14 GiB: 1 GiB per example, 0.4 GiB fixed -> 12 examples.
    overrides = {"FastSmall": {"base": "A100-40GB", "memory_bytes": "14GiB"}}
    plan = plan_cluster(_model(act_gb=0.25, params_gb=0.05),
                        "1x2xFastSmall,1x2xT4", "sgd", 40,
                        overrides=overrides)
    balanced = plan.alternative("data-parallel, balanced by capability")
    assert balanced.feasible
    # capability share of a fast device: 40 * 19.5 / (2 * 27.6) = 14.1
    assert balanced.batch_sizes == [12, 12, 8, 8]
    assert all(load.total <= load.usable for load in balanced.loads)
    unlimited = plan_cluster(_model(act_gb=0.25, params_gb=0.05),
                             "1x2xA100-40GB,1x2xT4", "sgd", 40)
    assert unlimited.alternative(balanced.name).batch_sizes == [14, 14, 6, 6]


def test_explain_prints_table_chosen_plan_and_rejections():
    plan = plan_cluster(_model(act_gb=0.25, params_gb=0.05),
                        "1x2xV100-32GB,1x2xT4", "adam", 64)
    text = plan.explain()
    assert re.search(r"^devices\s+hosts\s+profile\s+batch\s+params\s+grads"
                     r"\s+optim\s+activ\s+total/usable\s+compute ms\s+"
                     r"comm ms\s+count$", text, re.M)
    assert re.search(r"^0-1\s+0\s+V100-32GB\s+\d+", text, re.M)
    assert re.search(r"^2-3\s+1\s+T4\s+\d+", text, re.M)
    assert f"Chosen plan: {plan.chosen.name}: predicted step" in text
    even = plan.alternative("data-parallel, even split")
    assert not even.feasible
    assert even.reason == (
        "device 2 needs 16.8 GB on a 16.0 GB T4 (15.2 GB usable) for 16 "
        "examples: parameters 0.2 GB, gradients 0.2 GB, optimizer 0.4 GB, "
        "activations 16.0 GB (and 1 more device)")
    assert f"rejected: {even.reason}" in text
    assert plan.chosen.name != even.name


def test_plan_is_deterministic():
    first = plan_cluster(_model(), "1x4xV100-32GB,1x4xT4", "adam", 256)
    second = plan_cluster(_model(), "1x4xV100-32GB,1x4xT4", "adam", 256)
    assert first.explain() == second.explain()
    assert first.batch_sizes == second.batch_sizes


def test_nothing_fits_says_by_how_much_and_what_would_help():
    with pytest.raises(ClusterError) as err:
        plan_cluster(_model(layers=8, act_gb=0.25, params_gb=0.5),
                     "1x2xT4", "adam", 64)
    lines = str(err.value).splitlines()
    assert lines[:9] == [
        "model 'toy' does not fit on this cluster under any plan (global "
        "batch 64, optimizer adam, 2 devices).",
        "Closest plan: data-parallel, balanced + ZeRO + gradient "
        "checkpointing. Per device:",
        "  devices 0-1 (T4): needs 54.0 GB with 15.2 GB usable: short by "
        "38.8 GB (parameters 6.0 GB, gradients 4.0 GB, optimizer 4.0 GB, "
        "activations 40.0 GB)",
        "What would help:",
        "  - gradient checkpointing and ZeRO were tried; the closest plan "
        "(data-parallel, balanced + ZeRO + gradient checkpointing) uses both "
        "and is still short",
        "  - more devices: 8x this cluster (16 devices) fits, with ZeRO and "
        "split layers sharded further and the same global batch",
        "Rejected plans:",
        "  - data-parallel, even split: device 0 needs 80.0 GB on a 16.0 GB "
        "T4 (15.2 GB usable) for 32 examples: parameters 4.0 GB, gradients "
        "4.0 GB, optimizer 8.0 GB, activations 64.0 GB (and 1 more device)",
        "  - data-parallel, balanced by capability: device 0 needs 80.0 GB on a "
        "16.0 GB T4 (15.2 GB usable) for 32 examples: parameters 4.0 GB, gradients "
        "4.0 GB, optimizer 8.0 GB, activations 64.0 GB (and 1 more device)"]


def test_offload_is_suggested_when_it_would_fit():
    with pytest.raises(ClusterError) as err:
        plan_cluster(_model(layers=8, act_gb=0.001, params_gb=1.0),
                     "1x2xT4", "adam", 8)
    assert ("  - offloading parameters, gradients and optimizer state to host "
            "memory (PlanOptions(offload=True), epl-plan --offload) makes it "
            "fit") in str(err.value).splitlines()


def test_pipeline_stages_put_earlier_stages_on_bigger_memory():
    plan = plan_cluster(_model(layers=6), "1x2xT4,1x2xV100-32GB", "sgd", 16,
                        PlanOptions(pipeline_stages=2, num_micro_batch=4))
    pipe = plan.alternative("pipeline, 2 stages")
    assert pipe.feasible
    stage_of = {load.device.index: load.stage for load in pipe.loads}
    assert stage_of == {0: 1, 1: 1, 2: 0, 3: 0}  # V100s (32 GB) first
    layers = {load.stage: load.layers for load in pipe.loads}
    assert layers[0][1] - layers[0][0] > layers[1][1] - layers[1][0]
    assert "stage  layers" in plan.explain() or pipe is not plan.chosen


def test_offload_keeps_state_in_host_memory():
    model = _model(layers=4, act_gb=0.01, params_gb=4.0)
    with pytest.raises(ClusterError):
        plan_cluster(model, "1x2xV100-32GB", "adam", 8)
    plan = plan_cluster(model, "1x2xV100-32GB", "adam", 8,
                        PlanOptions(offload=True))
    load = plan.chosen.loads[0]
    assert load.host_bytes >= 16 * GiB * 2 - 1
    assert load.total < 32 * GiB
    assert "host GB" in plan.explain()


def test_split_layers_shard_units_by_capability():
    layer = LayerSpec("moe", flops_per_example=1e9, parameter_bytes=GiB,
                      split_parameter_bytes=8 * GiB,
                      split_flops_per_example=1e10)
    model = ModelSpec("moe", (layer,) * 2, split_units=16)
    plan = plan_cluster(model, "1x2xA100-80GB,1x2xT4", "sgd", 64)
    loads = plan.alternative("data-parallel, balanced by capability").loads
    assert sum(l.shards for l in loads) == 16
    assert loads[0].shards > loads[2].shards >= 1
    even = plan.alternative("data-parallel, even split").loads
    assert [l.shards for l in even] == [4, 4, 4, 4]


# ---------------------------------------------------------- host networks --

EVEN = "data-parallel, even split"


def _comm(spec, model, batch=64):
    """Each device's communication seconds under the even split (the
    all-to-all unchunked, moe_chunks=1: all of it is communication)."""
    plan = plan_cluster(model, spec, "sgd", batch, PlanOptions(moe_chunks=1))
    return [load.comm_s for load in plan.alternative(EVEN).loads]


def _allreduce_model(params_gb=1.0):
    """Replicated parameters only: communication is the gradient ring."""
    return _model(layers=2, params_gb=params_gb / 2, act_gb=0.001)


@pytest.mark.parametrize("network, bandwidth", [
    ("", 12.5e9),                 # default: one 100 Gb/s NIC per host
    ("@1x100Gbps", 12.5e9),
    ("@8x200Gbps", 200e9),        # a DGX A100's compute fabric
    ("@4x100Gb/s", 50e9),         # a DGX-1's
    ("@25GB/s", 25e9),
])
def test_allreduce_across_hosts_runs_at_the_host_network(network, bandwidth):
    # 2 hosts x 4 A100s (NVLink 300 GB/s, faster than any network here):
    # 2 (n - 1) / n x bytes / (NICs x rate), n = 8.
    comm = _comm(f"2x4xA100-40GB{network}", _allreduce_model())
    expected = 2 * 7 / 8 * GiB / bandwidth
    assert comm == pytest.approx([expected] * 8, rel=1e-9)


def test_allreduce_is_bound_by_the_slowest_host_or_a_slower_intra_link():
    model = _allreduce_model()
    mixed = _comm("1x4xA100-40GB@8x200Gbps,1x4xV100-32GB@4x100Gbps", model)
    assert mixed == pytest.approx([2 * 7 / 8 * GiB / 50e9] * 8, rel=1e-9)
    # T4s talk over PCIe 3 (16 GB/s): four 100 Gb/s NICs (50 GB/s) cannot
    # make the ring faster than that.
    pcie = _comm("2x2xT4@4x100Gbps", model)
    assert pcie == pytest.approx([2 * 3 / 4 * GiB / 16e9] * 4, rel=1e-9)
    plan = plan_cluster(model, "2x2xT4@4x100Gbps", "sgd", 64)
    assert "slowest link 16.0 GB/s (intra-node)" in plan.explain()
    # one device per host: no intra-node link in the ring
    single = _comm("2x1xT4@4x100Gbps", model)
    assert single == pytest.approx([GiB / 50e9] * 2, rel=1e-9)


def _moe_model(alltoall_mb=64.0):
    """Split (expert) layers only, no replicated parameters: communication
    is the expert all-to-all."""
    layer = LayerSpec("moe", flops_per_example=1e9,
                      split_parameter_bytes=0.01 * GiB,
                      split_flops_per_example=1e9,
                      alltoall_bytes_per_example=alltoall_mb * 2**20)
    return ModelSpec("moe", (layer,) * 2, split_units=8)


@pytest.mark.parametrize("network, bandwidth", [
    ("", 12.5e9), ("@2x100Gbps", 25e9), ("@4x100Gbps", 50e9)])
def test_alltoall_leaves_the_host_through_its_network(network, bandwidth):
    # 2 hosts x 2 T4s, 16 examples per device: each device sends
    # (n - local) / n = 1/2 of its bytes to the other host, through the
    # host's network shared by its 2 devices; the intra-node part,
    # (local - 1) / n = 1/4 over PCIe 3 (16 GB/s), takes less time.
    comm = _comm(f"2x2xT4{network}", _moe_model())
    per_example = 2 * 64 * 2**20
    inter = per_example * 2 / 4 / (bandwidth / 2)
    intra = per_example * 1 / 4 / 16e9
    assert inter > intra
    assert comm == pytest.approx([16 * inter] * 4, rel=1e-9)


def test_alltoall_is_bound_by_the_slowest_host_network():
    fast_slow = _comm("1x2xT4@8x200Gbps,1x2xT4@1x100Gbps", _moe_model())
    slow = _comm("2x2xT4@1x100Gbps", _moe_model())
    assert fast_slow == pytest.approx(slow, rel=1e-9)


def _alltoall(cluster, units, batch, alltoall_mb=64.0):
    """alltoall_time of one explicit placement and batch."""
    from epl.planner.search import _context
    from epl.planner.step_cost import alltoall_time, layer_totals
    from epl.planner.profiles import parse_cluster
    model = _moe_model(alltoall_mb)
    ctx = _context(model, parse_cluster(cluster), "sgd", sum(batch),
                   PlanOptions())
    return alltoall_time(ctx, layer_totals(model.layers, False), units, batch)


def test_alltoall_follows_the_expert_placement():
    # One device per host, 6 + 2 of the 8 experts, 12 + 4 examples; 128 MiB
    # per example (2 layers x 64 MiB), 16 MiB per expert.  Host 0 sends its
    # 12 examples' share for host 1's 2 experts (12 x 2 x 16 MiB) and
    # receives host 1's 4 examples' share for its 6 (4 x 6 x 16 MiB).
    unit = 2 * 64 * 2**20 / 8
    seconds = _alltoall("2x1xT4@1x100Gbps", [6, 2], [12, 4])
    assert seconds == pytest.approx(max(12 * 2, 4 * 6) * unit / 12.5e9,
                                    rel=1e-9)
    # The placement that follows the batch (6 : 2 for 12 : 4) sends less
    # than the even one: a host keeps its tokens when it holds the experts.
    assert seconds < _alltoall("2x1xT4@1x100Gbps", [4, 4], [12, 4])
    # Each host's own network carries its traffic: host 0's four NICs
    # take its 24 units' worth; host 1's one NIC binds.
    mixed = _alltoall("1x1xT4@4x100Gbps,1x1xT4@1x100Gbps", [6, 2], [12, 4])
    assert mixed == pytest.approx(24 * unit / 12.5e9, rel=1e-9)


def test_alltoall_within_a_host_uses_each_devices_link():
    # One host, 2 T4s (PCIe 3, 16 GB/s): device 0 sends 12 examples' share
    # for device 1's 2 experts and receives 4 examples' share for its 6.
    unit = 2 * 64 * 2**20 / 8
    seconds = _alltoall("1x2xT4", [6, 2], [12, 4])
    assert seconds == pytest.approx(max(12 * 2, 4 * 6) * unit / 16e9,
                                    rel=1e-9)


def test_balanced_moe_loads_pay_the_slowest_phase_at_every_barrier():
    # Experts and batch placed apart: every device's step is the slowest
    # replicated work plus the slowest expert work plus the exchange (and
    # its own optimizer update, after the last barrier); a device that is
    # done early waits.
    model = epl_plan.builtin_model("m6-mini", "float16")
    plan = plan_cluster(model, "1x8xA100-40GB,1x8xV100-32GB", "adam", 1024,
                        PlanOptions(compute_dtype="float16"))
    loads = plan.alternative("data-parallel, balanced by capability").loads
    steps = [load.step_s for load in loads]
    assert max(steps) - min(steps) < 0.01 * max(steps)
    assert min(load.wait_s for load in loads) >= 0
    assert max(load.wait_s for load in loads) > 0
    assert max(load.compute_s for load in loads) + loads[0].comm_s <= \
        steps[0] * (1 + 1e-12)
    text = plan.explain()
    assert "wait ms" in text and "Note: wait: every split layer's " \
        "all-to-all is a barrier" in text
    # the dense model has no barrier and no wait column
    dense = plan_cluster(_model(), "1x2xA100-40GB,1x2xT4", "sgd", 64)
    assert all(load.wait_s == 0 for load in dense.chosen.loads)
    assert "wait ms" not in dense.explain()


@pytest.mark.parametrize("cluster", [
    "1x8xV100-32GB,1x8xT4", "1x8xA100-40GB,1x8xV100-32GB",
    "2x4xA100-80GB,2x4xT4",
    "1x8xV100-32GB@4x100Gbps,1x8xT4@1x100Gbps",
    "1x8xA100-40GB@8x200Gbps,1x8xV100-32GB@4x100Gbps",
    "2x4xA100-80GB@4x200Gbps,2x4xT4@1x100Gbps"])
def test_balanced_moe_plan_is_faster_than_the_even_split(cluster):
    # The placements and batches the balanced plan tries include ones that
    # keep the hosts' exchange small; before they did, balancing the
    # V100 + T4 M6-mini made it slower than the even split.
    model = epl_plan.builtin_model("m6-mini", "float16")
    plan = plan_cluster(model, cluster, "adam", 1024,
                        PlanOptions(compute_dtype="float16"))
    even = plan.alternative(EVEN)
    balanced = plan.alternative("data-parallel, balanced by capability")
    assert balanced.feasible
    assert balanced.step_time < even.step_time
    # the fast devices hold more experts and more of the batch
    first, last = balanced.loads[0], balanced.loads[-1]
    assert first.shards > last.shards and first.batch > last.batch
    assert sum(load.shards for load in balanced.loads) == model.split_units


def test_experts_without_work_of_their_own_are_placed_by_whole_examples():
    # split parameters and an all-to-all but no split FLOPs or bytes
    layer = LayerSpec("moe", flops_per_example=1e9,
                      split_parameter_bytes=2**20,
                      alltoall_bytes_per_example=2**20)
    model = ModelSpec("moe", (layer,) * 2, split_units=8)
    plan = plan_cluster(model, "1x2xA100-40GB,1x2xT4", "sgd", 64)
    loads = plan.alternative("data-parallel, balanced by capability").loads
    assert sum(load.shards for load in loads) == 8
    assert loads[0].batch > loads[-1].batch


def test_expert_placements_run_from_even_to_proportional():
    from epl.planner.data_parallel import _placement_path
    path = _placement_path([2, 2, 2, 2], [3.0, 3.0, 1.0, 1.0])
    assert path[0] == [2, 2, 2, 2]
    assert all(sum(p) == 8 for p in path)
    assert all(sum(abs(a - b) for a, b in zip(p, q)) == 2
               for p, q in zip(path, path[1:]))
    assert path[-1] == [3, 3, 1, 1]  # 3/3 = 1/1: no move shortens it
    assert _placement_path([2, 2], [1.0, 1.0]) == [[2, 2]]


def test_batches_tried_run_from_balanced_to_even_and_to_the_experts():
    from epl.planner.data_parallel import _blended_batches
    batches = _blended_batches(16, [12, 4], [1, 3])
    assert batches[0] == [12, 4]                 # the balanced one first
    assert [8, 8] in batches and [4, 12] in batches  # even; follows experts
    assert all(sum(b) == 16 for b in batches)
    assert len(batches) == len({tuple(b) for b in batches})


def test_more_network_makes_the_balanced_moe_plan_faster():
    model = epl_plan.builtin_model("m6-mini", "float16")
    options = PlanOptions(compute_dtype="float16")
    one = plan_cluster(model, "1x8xA100-40GB,1x8xV100-32GB", "adam", 1024,
                       options)
    dgx = plan_cluster(model, "1x8xA100-40GB@8x200Gbps,"
                              "1x8xV100-32GB@4x100Gbps", "adam", 1024,
                       options)
    for name in (EVEN, "data-parallel, balanced by capability"):
        assert dgx.alternative(name).step_time < \
            one.alternative(name).step_time


def test_explain_prints_each_host_groups_network():
    plan = plan_cluster(_model(), "2x2xA100-40GB@8x200Gbps,1x2xT4,"
                                  "1x2xT4@1x100Gbps", "sgd", 64)
    lines = plan.explain().splitlines()
    assert lines[2] == ("Network per host: hosts 0-1: 8 x 200 Gb/s (200.0 "
                        "GB/s); hosts 2-3: 1 x 100 Gb/s (12.5 GB/s)")
    single = plan_cluster(_model(), "1x2xT4", "sgd", 8).explain()
    assert single.splitlines()[2] == ("Network per host: host 0: 1 x 100 "
                                      "Gb/s (12.5 GB/s); one host: not used")


def test_remedies_keep_the_host_network():
    from epl.planner.planner import cluster_devices
    from epl.planner.search import _hosts_of
    from epl.planner.profiles import parse_cluster
    hosts = parse_cluster("1x2xA100-40GB@8x200Gbps,2x2xT4@2x100Gbps")
    assert _hosts_of(cluster_devices(hosts)) == hosts


# ------------------------------------------------------------ from graphs --

def _one_stage_graph(batch=12):
    """An EPL graph with one TaskGraph; returns (graph, view)."""
    from epl.ir.graph_view import analyze
    from epl.hooks.record import record_of
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 16])
        with epl.replicate(device_count=1, name="body"):
            w = tf.compat.v1.get_variable("w", [16, 4])
            loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return graph, analyze(graph, record_of(graph))


def _two_stage_graph(batch=8):
    """An EPL graph with two TaskGraphs; returns (graph, view)."""
    from epl.ir.graph_view import analyze
    from epl.hooks.record import record_of
    epl.init(epl.Config({"cluster.virtual_devices": 2}))
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [batch, 16])
        y = tf.compat.v1.placeholder(tf.int64, [batch])
        with epl.replicate(device_count=1, name="stage_0"):
            w1 = tf.compat.v1.get_variable("w1", [16, 32])
            hidden = tf.nn.relu(tf.matmul(x, w1))
        with epl.replicate(device_count=1, name="stage_1"):
            w2 = tf.compat.v1.get_variable("w2", [32, 4])
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=tf.matmul(hidden, w2)))
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
    return graph, analyze(graph, record_of(graph))


def test_model_from_graph_has_one_layer_per_taskgraph():
    graph, view = _two_stage_graph()
    model = model_from_graph(graph, view=view)
    assert [l.name for l in model.layers] == ["stage_0", "stage_1"]
    assert model.batch_size == 8
    first = model.layers[0]
    # forward: matmul 2*16*32 + relu 32; backward: relu grad 32 and both
    # matmul gradients (TF builds the one for the placeholder too)
    assert first.flops_per_example == 3 * 2 * 16 * 32 + 2 * 32
    assert first.parameter_bytes == 16 * 32 * 4
    assert first.activation_bytes_per_example == (16 + 32) * 4
    plan = plan_cluster(view, "1x2xV100-32GB")
    assert plan.optimizer == "adam"  # read from the apply ops
    assert "pipeline, 2 stages" in [a.name for a in plan.alternatives]


def test_saved_graph_gives_the_same_description_as_the_live_one():
    graph, view = _two_stage_graph()
    live = model_from_graph(graph, view=view)
    saved = model_from_graph(graph.as_graph_def())
    for a, b in zip(saved.layers, live.layers):
        assert a.name == b.name and a.parameter_bytes == b.parameter_bytes
        assert a.activation_bytes_per_example == b.activation_bytes_per_example
        # the loss's Mean is not needed by the backward ops: "other" there
        assert a.flops_per_example == pytest.approx(b.flops_per_example,
                                                    abs=1.0)
    assert saved.batch_size == 8 and saved.optimizer == "adam"


def test_local_replica_weights_from_virtual_device_profiles():
    graph, view = _two_stage_graph(batch=12)
    profiles = virtual_cpu_profiles(
        4, {"CPU:0": "V100-32GB", "CPU:1": "V100-32GB", "CPU:2": "T4",
            "CPU:3": "T4"})
    weights = replica_weights_for_local_devices(view, profiles, 12,
                                                device_counts=[1])
    assert sum(weights) == pytest.approx(1.0)
    assert [round(w * 12) for w in weights] == [4, 4, 2, 2]
    # a replica of two TaskGraphs spans 2 devices: 2 replicas
    weights = replica_weights_for_local_devices(view, profiles, 12)
    assert len(weights) == 2 and weights[0] > weights[1]


def test_local_replica_weights_follow_cluster_device_profiles():
    from epl.runtime.cluster import Cluster
    from epl.planner.plan import make_plan
    from epl.planner.planner import local_replica_weights
    graph, view = _one_stage_graph(batch=12)
    cluster = Cluster("CPU", 2)
    plain = epl.Config({"cluster.virtual_devices": 2})
    assert local_replica_weights(view, cluster, plain) is None
    mixed = epl.Config({"cluster.virtual_devices": 2, "cluster.device_profiles":
                        {"CPU:0": "V100-32GB", "CPU:1": "T4"}})
    weights = local_replica_weights(view, cluster, mixed)
    # the shares of the dry run (the local ClusterPlan's balanced alternative):
    # compute and the optimizer update per device, not compute alone (9 : 3)
    from epl.planner.search import plan_local_devices
    dry = plan_local_devices(view, virtual_cpu_profiles(
        2, {"CPU:0": "V100-32GB", "CPU:1": "T4"}), global_batch=12,
        options=PlanOptions(try_checkpointing=False, try_zero=False))
    sizes = dry.alternative("data-parallel, balanced by capability").batch_sizes
    assert weights == [s / 12 for s in sizes] == [10 / 12, 2 / 12]
    plan = make_plan(view.taskgraphs, cluster, weights)
    assert plan.batch_sizes(12) == [10, 2]


def test_local_weights_use_the_dtype_training_computes_in():
    # An A100 is 1.24x a V100 in float32 and 2.5x in float16: under AMP the
    # batch shares and the split pass's shard sizes follow the float16 peaks.
    from epl.runtime.cluster import Cluster
    from epl.planner.planner import local_replica_weights, local_shard_weights
    from epl.planner.profiles import get_profile
    graph, view = _one_stage_graph(batch=12)
    cluster = Cluster("CPU", 2)
    # memory bandwidth out of the way: the tiny matmul is compute-bound
    profiles = {"CPU:0": {"base": "A100-40GB", "memory_bandwidth": 1e18},
                "CPU:1": {"base": "V100-32GB", "memory_bandwidth": 1e18}}
    a100, v100 = get_profile("A100-40GB"), get_profile("V100-32GB")
    devices = ["/device:CPU:0", "/device:CPU:1"]
    for amp, dtype in (("", "float32"), ("O1", "float16")):
        config = epl.Config({"cluster.virtual_devices": 2, "amp.level": amp,
                             "cluster.device_profiles": profiles})
        fast, slow = a100.flops(dtype), v100.flops(dtype)
        assert local_shard_weights(cluster, config, devices) == \
            pytest.approx([fast / (fast + slow), slow / (fast + slow)])
        expected = proportional_shares(12, [fast, slow])
        weights = local_replica_weights(view, cluster, config)
        assert [round(w * 12) for w in weights] == expected
    assert expected == [9, 3]  # float16: 312 vs 125 TFLOP/s (float32: 7, 5)


# ------------------------------------------------------------------ CLI --

def _cli(capsys, *argv):
    code = epl_plan.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_plans_bert_base_on_a_mixed_cluster(capsys):
    code, out, err = _cli(capsys, "--cluster", "1x4xV100-32GB,1x4xT4",
                          "--model", "bert-base")
    assert code == 0, err
    assert out.startswith("Model: bert-base: 14 layer(s), 109.8 M parameters")
    assert "Cluster: 2 host(s), 8 devices (host 0: 4 x V100-32GB; host 1: " \
           "4 x T4)" in out
    assert re.search(r"^devices\s+hosts\s+profile\s+batch", out, re.M)
    assert re.search(r"^0-3\s+0\s+V100-32GB\s+42\s", out, re.M)
    assert re.search(r"^4-7\s+1\s+T4\s+22\s", out, re.M)
    assert "Chosen plan: data-parallel, balanced by capability" in out
    assert "data-parallel, even split" in out


def test_cli_prints_the_host_networks(capsys):
    code, out, err = _cli(capsys, "--cluster",
                          "1x8xA100-40GB@8x200Gbps,1x8xV100-32GB@4x100Gbps",
                          "--model", "m6-mini", "--dtype", "float16")
    assert code == 0, err
    assert ("Cluster: 2 host(s), 16 devices (host 0: 8 x A100-40GB; host 1: "
            "8 x V100-32GB); slowest link 50.0 GB/s (inter-node)") in out
    assert ("Network per host: host 0: 8 x 200 Gb/s (200.0 GB/s); host 1: "
            "4 x 100 Gb/s (50.0 GB/s)") in out


@pytest.mark.parametrize("cluster,expected", [
    ("2x8xA100@8x200",  # a bad host network
     "'2x8xA100@8x200':\n  2x8xA100@8x200\n           ^^^^^\ncannot read the host network "
     "'8x200'; a host network is [NICS x] RATE"),
    ("2x8xV100-32GB,,2x8xT4",  # an empty token
     "'2x8xV100-32GB,,2x8xT4':\n  2x8xV100-32GB,,2x8xT4\n                ^\nempty token"),
])
def test_cli_bad_cluster_spec_points_at_the_bad_part(capsys, cluster, expected):
    code, out, err = _cli(capsys, "--cluster", cluster, "--model", "bert-base")
    assert code == 2 and out == ""
    assert err.startswith("epl-plan: error: cannot parse cluster spec " + expected)


def test_cli_unknown_device_lists_known_profiles(capsys):
    code, out, err = _cli(capsys, "--cluster", "1x4xV200", "--model",
                          "resnet50")
    assert code == 2
    assert "unknown device profile 'V200'. Known profiles: ['A10'," in err
    assert "cluster.device_profiles" in err


def test_cli_unknown_device_with_override_works(capsys):
    code, out, err = _cli(capsys, "--cluster", "1x2xV200", "--model",
                          "resnet50", "--profiles",
                          '{"V200": {"base": "V100-32GB"}}')
    assert code == 0, err
    assert "2 x V200" in out


def test_cli_model_that_fits_nowhere(capsys):
    code, out, err = _cli(capsys, "--cluster", "1x8xV100-32GB", "--model",
                          "m6-mini", "--global-batch", "4096")
    assert code == 2
    assert "epl-plan: error: model 'm6-mini' does not fit" in err
    assert "short by" in err and "What would help:" in err
    assert "a smaller global batch: at most" in err


def test_cli_m6_10t_needs_offload(capsys):
    code, _, err = _cli(capsys, "--cluster", "64x8xV100-32GB", "--model",
                        "m6-10t")
    assert code == 2
    assert "devices 0-511 (V100-32GB): needs" in err
    assert "epl-plan --offload) makes it fit" in err
    code, out, err = _cli(capsys, "--cluster", "64x8xV100-32GB", "--model",
                          "m6-10t", "--offload")
    assert code == 0, err
    assert "9.90 T parameters" in out
    assert re.search(r"^0-511\s+0-63\s+V100-32GB\s+2\s+6\s", out, re.M)


def test_cli_saved_graph(capsys, tmp_path):
    graph, _ = _two_stage_graph()
    path = tmp_path / "model.pbtxt"
    tf.io.write_graph(graph.as_graph_def(), str(tmp_path), "model.pbtxt")
    code, out, err = _cli(capsys, "--cluster", "1x2xV100-32GB,1x2xT4",
                          "--graph", str(path))
    assert code == 0, err
    assert "Model: model: 2 layers (w1, w2) in 2 TaskGraphs" in out
    assert "optimizer adam; global batch 8" in out
    code, out, err = _cli(capsys, "--cluster", "1xT4", "--graph",
                          str(tmp_path / "missing.pbtxt"))
    assert code == 2 and "does not exist" in err


SCRIPT = '''
import sys
import tensorflow as tf
import epl

tf.compat.v1.disable_eager_execution()
epl.init(epl.Config({"cluster.device_profiles":
                     {"Small": {"base": "T4", "memory_bytes": "8GiB"}}}))
x = tf.compat.v1.placeholder(tf.float32, [32, 8])
with epl.replicate(device_count=1, name="body"):
    w = tf.compat.v1.get_variable("w", [8, 2])
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w)))
train = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
with tf.compat.v1.train.MonitoredTrainingSession() as sess:
    sys.exit(3)  # never reached: epl-plan stops at the session
'''


def test_cli_script_is_captured_at_its_first_session(capsys, tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    code, out, err = _cli(capsys, "--cluster", "1x2xV100-32GB,1x2xSmall",
                          "--script", str(path))
    assert code == 0, err
    assert "Model: train: 1 layer (w) in 1 TaskGraph" in out
    # EPL's batch contract: 2 workers x 2 replicas x the script's 32
    assert "optimizer momentum; global batch 128" in out
    assert "Batch: global batch 128 (2 workers x 2 replicas x 32) per step of this script " \
        "on this cluster; the script's batch 32 is one replica's micro-batch" in out
    assert "2 x Small" in out
    assert not env.is_initialized()  # the script's epl.init was undone
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    code, out, err = _cli(capsys, "--cluster", "1xT4", "--script", str(bad))
    assert code == 2
    assert "failed before creating a session: RuntimeError: boom" in err


# ------------------------------------------- chunked expert dispatch --

def test_pipelined_time_overlaps_comparable_comm_and_compute():
    from epl.planner.step_cost import pipelined_time
    # one chunk: the exchange, then the computation
    assert pipelined_time(3.0, 2.0, 1) == 5.0
    # C chunks: the busier stream throughout, one chunk of the other sticks
    # out (Tutel / FasterMoE): max + min / C
    assert pipelined_time(3.0, 2.0, 4) == pytest.approx(3.0 + 2.0 / 4)
    assert pipelined_time(2.0, 3.0, 4) == pytest.approx(3.0 + 2.0 / 4)
    # comparable figures gain most: 2 -> 1.125 of 2 for equal comm and compute
    assert pipelined_time(1.0, 1.0, 8) == pytest.approx(1.125)
    # each chunk past the first pays its message latency
    assert pipelined_time(1.0, 1.0, 8, 0.01) == pytest.approx(1.125 + 0.07)


def _chunk_ctx(cluster, latency=0.0):
    import dataclasses as dc
    from epl.planner.search import _context
    from epl.planner.step_cost import layer_totals
    from epl.planner.profiles import parse_cluster
    model = _moe_model()
    ctx = _context(model, parse_cluster(cluster), "sgd", 64, PlanOptions())
    ctx.devices = [dc.replace(d, profile=dc.replace(
        d.profile, collective_latency_s=latency)) for d in ctx.devices]
    return ctx, layer_totals(model.layers, False)


def test_chunking_helps_when_comm_and_compute_are_comparable():
    from epl.planner.step_cost import exposed_alltoall_time
    ctx, totals = _chunk_ctx("2x2xT4")
    # the dispatch (half the exchange) pipelines with half the expert compute
    exposed, chunks = exposed_alltoall_time(ctx, totals, 0.2, 0.2)
    assert chunks == 8
    assert exposed == pytest.approx(0.1 + 0.1 / 8)
    assert exposed_alltoall_time(ctx, totals, 0.2, 0.2, 1) == (0.2, 1)
    # a given chunk count is evaluated, not searched
    assert exposed_alltoall_time(ctx, totals, 0.2, 0.2, 2) == \
        pytest.approx((0.1 + 0.05, 2))
    # nothing to hide behind: no gain, the smallest count on the tie
    assert exposed_alltoall_time(ctx, totals, 0.2, 0.0) == (0.2, 1)


def test_chunking_is_not_chosen_where_the_latency_outweighs_it():
    from epl.planner.step_cost import alltoall_chunk_latency, exposed_alltoall_time
    # 2 layers x 2 chunked exchanges x 3 peers x 1 ms = 12 ms per extra chunk
    ctx, totals = _chunk_ctx("2x2xT4", latency=1e-3)
    assert alltoall_chunk_latency(ctx, totals) == pytest.approx(12e-3)
    assert exposed_alltoall_time(ctx, totals, 0.01, 0.01) == (0.01, 1)
    # a larger exchange gains from a few chunks, not from 8:
    # 0.1 + 0.1 / C + 12 ms x (C - 1) is least at C = 4
    exposed, chunks = exposed_alltoall_time(ctx, totals, 0.2, 0.2)
    assert chunks == 4 and exposed == pytest.approx(0.1 + 0.025 + 0.036)


def test_chunking_is_never_predicted_to_help_on_one_device():
    model = epl_plan.builtin_model("m6-mini", "float16")
    plan = plan_cluster(model, "1x1xA100-80GB", "adam", 64,
                        PlanOptions(compute_dtype="float16"))
    assert all(load.moe_chunks == 1 for alt in plan.alternatives
               for load in alt.rows)
    same = plan_cluster(model, "1x1xA100-80GB", "adam", 64,
                        PlanOptions(compute_dtype="float16", moe_chunks=8))
    assert same.chosen.step_time == plan.chosen.step_time


def test_the_planner_chooses_the_chunk_count_of_the_mixed_cluster_row():
    # bench/planner.py's "8 fast + 8 slow, m6-mini, one NIC per host":
    # the all-to-all and the expert compute are comparable and the GPU
    # table has no message latency, so the largest count wins.
    model = epl_plan.builtin_model("m6-mini", "float16")
    options = PlanOptions(compute_dtype="float16")
    name = "data-parallel, balanced by capability"
    chunked = plan_cluster(model, "2x4xA100-80GB,2x4xT4", "adam", 1024,
                           options).alternative(name)
    whole = plan_cluster(model, "2x4xA100-80GB,2x4xT4", "adam", 1024,
                         PlanOptions(compute_dtype="float16", moe_chunks=1)
                         ).alternative(name)
    assert {load.moe_chunks for load in chunked.loads} == {8}
    assert chunked.step_time < 0.95 * whole.step_time
    assert "split.moe_chunks=8" in plan_cluster(
        model, "2x4xA100-80GB,2x4xT4", "adam", 1024, options).explain()


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "4"])
def test_bad_moe_chunks_option_names_it(bad):
    from epl.errors import ConfigError
    with pytest.raises(ConfigError) as err:
        PlanOptions(moe_chunks=bad)
    assert str(err.value) == ("moe_chunks (split.moe_chunks) must be an int >= 1 or None "
                              f"(the planner chooses), got {bad!r}")
