"""Tests of epl.planner.profiles: the device table, overrides, detection, clusters;
and of epl.planner.calibration, the CPU micro-benchmark."""

import os

import pytest

from epl.planner import calibration, profiles
from epl.errors import ClusterError, ConfigError
from epl.planner.profiles import (DeviceProfile, HostNetwork, HostSpec,
                          detect_profile, get_profile, parse_cluster,
                          virtual_cpu_profiles)

GiB = 2**30
TERA = 1e12

#: A complete "CPU" profile: configuring it skips the CPU micro-benchmark.
FIXED_CPU = {"CPU": {"peak_flops": {"float32": 1e11}, "memory_bytes": 8 * GiB,
                     "memory_bandwidth": 2e10, "intra_node_bandwidth": 2e10,
                     "inter_node_bandwidth": 1.25e9}}


@pytest.mark.parametrize("name, fp32, fp16, memory, bandwidth", [
    ("P100-16GB", 9.3, 18.7, 16, 732e9),
    ("V100-16GB", 15.7, 125, 16, 900e9),
    ("V100-32GB", 15.7, 125, 32, 900e9),
    ("T4", 8.1, 65, 16, 320e9),
    ("A10", 31.2, 125, 24, 600e9),
    ("A100-40GB", 19.5, 312, 40, 1555e9),
    ("A100-80GB", 19.5, 312, 80, 2039e9),
    ("H100-80GB", 67, 989.5, 80, 3.35e12),
    ("H200-141GB", 67, 989.5, 141, 4.8e12),
])
def test_table_values_are_the_datasheet_figures(name, fp32, fp16, memory,
                                                bandwidth):
    profile = get_profile(name)
    assert profile.name == name
    assert profile.flops("float32") == pytest.approx(fp32 * TERA)
    assert profile.flops("float16") == pytest.approx(fp16 * TERA)
    assert profile.memory_bytes == memory * GiB
    assert profile.memory_bandwidth == pytest.approx(bandwidth)
    assert profile.inter_node_bandwidth == pytest.approx(12.5e9)
    assert set(profiles.STANDARD_DTYPES) <= set(profile.peak_flops)


def test_links_nvlink_and_pcie_per_direction():
    assert get_profile("V100-32GB").intra_node_bandwidth == 150e9
    assert get_profile("A100-40GB").intra_node_bandwidth == 300e9
    assert get_profile("H100-80GB").intra_node_bandwidth == 450e9
    assert get_profile("T4").intra_node_bandwidth == 16e9
    assert get_profile("A10").intra_node_bandwidth == 32e9


def test_bfloat16_without_hardware_runs_at_float32_rate():
    v100 = get_profile("V100-16GB")
    assert v100.flops("bfloat16") == v100.flops("float32")
    assert get_profile("A100-40GB").flops("bf16") == pytest.approx(312e12)
    assert get_profile("A100-40GB").flops("tf32") == pytest.approx(156e12)


@pytest.mark.parametrize("alias, name", [
    ("V100", "V100-16GB"), ("v100", "V100-16GB"), ("A100", "A100-40GB"),
    ("H100", "H100-80GB"), ("h200", "H200-141GB"), ("P100", "P100-16GB"),
    ("v100-32gb", "V100-32GB"), ("V100_32GB", "V100-32GB"),
    ("V100 32G", "V100-32GB"), ("a100-80gb", "A100-80GB"), ("t4", "T4"),
])
def test_aliases_and_case(alias, name):
    assert get_profile(alias).name == name


def test_flops_dtype_names_and_tf_dtypes():
    import tensorflow as tf
    t4 = get_profile("T4")
    assert t4.flops(tf.float16) == t4.flops("fp16") == t4.flops("half")
    with pytest.raises(ConfigError, match="no peak FLOP/s for dtype 'int8'"):
        t4.flops("int8")


def test_profiles_are_hashable_and_compare_by_value():
    a = get_profile("T4")
    b = get_profile("T4").with_overrides()
    assert a == b and hash(a) == hash(b)
    assert len({a, b, get_profile("A10")}) == 2


def test_unknown_name_error_lists_profiles_and_how_to_add():
    with pytest.raises(ClusterError) as info:
        get_profile("K80")
    text = str(info.value)
    assert text.startswith("unknown device profile 'K80'. Known profiles: ")
    for name in ("P100-16GB", "V100-32GB", "H200-141GB", "CPU"):
        assert name in text
    assert "cluster.device_profiles" in text
    assert "{'MyGPU': {'base': 'A100-40GB'" in text


def test_override_new_profile_from_base():
    overrides = {"MyGPU": {"base": "A100-40GB", "memory_bytes": "24GiB",
                           "inter_node_bandwidth": "200Gb/s"}}
    profile = get_profile("mygpu", overrides)
    assert profile.name == "MyGPU"
    assert profile.memory_bytes == 24 * GiB
    assert profile.inter_node_bandwidth == 25e9
    assert profile.peak_flops == get_profile("A100-40GB").peak_flops


def test_override_existing_profile_changes_only_given_fields():
    overrides = {"V100-32GB": {"inter_node_bandwidth": 25e9,
                               "peak_flops": {"fp16": "100TFLOPS"}}}
    profile = get_profile("v100-32gb", overrides)
    assert profile.inter_node_bandwidth == 25e9
    assert profile.flops("float16") == 100e12
    assert profile.flops("float32") == 15.7e12
    assert profile.memory_bytes == 32 * GiB


def test_override_full_profile_and_string_alias():
    fields = {"peak_flops": 1e13, "memory_bytes": 1e10,
              "memory_bandwidth": "500 GB/s", "intra_node_bandwidth": 1e10,
              "inter_node_bandwidth": 1e9}
    overrides = {"Mine": fields, "Big": "mine"}
    mine = get_profile("Mine", overrides)
    assert mine.peak_flops == {d: 1e13 for d in profiles.STANDARD_DTYPES}
    assert mine.memory_bandwidth == 500e9
    assert get_profile("Big", overrides).memory_bytes == 1e10
    assert get_profile("Big", overrides).name == "Big"


def test_override_unknown_field_lists_valid_fields():
    with pytest.raises(ConfigError) as info:
        get_profile("X", {"X": {"base": "T4", "memory": 3}})
    assert str(info.value) == (
        "cluster.device_profiles['X']: unknown device profile field(s) "
        "['memory']; valid fields are ['peak_flops', 'memory_bytes', "
        "'memory_bandwidth', 'intra_node_bandwidth', 'inter_node_bandwidth', "
        "'op_overhead_s', 'collective_latency_s', 'op_type_overhead_s', "
        "'optimizer_bandwidth', 'replica_sync_s', 'input_read_s', "
        "'input_example_s', 'replica_concurrency', 'host_cores', 'step_overhead_s', "
        "'shared_by'] (and 'base' in cluster.device_profiles, naming a profile to start from)")


def test_override_new_profile_needs_all_fields_or_a_base():
    with pytest.raises(ConfigError, match=r"lacks field\(s\) \['intra_node"):
        get_profile("X", {"X": {"peak_flops": 1e12, "memory_bytes": 1e9,
                                "memory_bandwidth": 1e11}})


def test_override_bad_values_and_cycles():
    with pytest.raises(ConfigError, match="cannot read '3 parsecs'"):
        get_profile("X", {"X": {"base": "T4", "memory_bytes": "3 parsecs"}})
    with pytest.raises(ConfigError, match="expected a positive number"):
        get_profile("X", {"X": {"base": "T4", "memory_bytes": -1}})
    with pytest.raises(ConfigError, match="cycle: A -> B -> A"):
        get_profile("A", {"A": {"base": "B"}, "B": {"base": "A"}})
    with pytest.raises(ClusterError, match="unknown device profile 'Nope'"):
        get_profile("X", {"X": {"base": "Nope"}})


def test_with_overrides():
    t4 = get_profile("T4")
    changed = t4.with_overrides(name="T4-slow", memory_bandwidth="300GB/s",
                                peak_flops={"float32": 4e12})
    assert changed.name == "T4-slow"
    assert changed.memory_bandwidth == 300e9
    assert changed.flops("float32") == 4e12
    assert changed.flops("float16") == t4.flops("float16")
    assert t4.flops("float32") == 8.1e12  # the original is unchanged
    with pytest.raises(ConfigError, match="unknown device profile field"):
        t4.with_overrides(bandwidth=1)


def test_parse_quantity_units():
    parse = profiles.parse_quantity
    assert parse("16GiB", "bytes", "x") == 16 * GiB
    assert parse("16 GB", "bytes", "x") == 16e9
    assert parse("900GB/s", "rate", "x") == 900e9
    assert parse("100Gb/s", "rate", "x") == 12.5e9
    assert parse("100Gbps", "rate", "x") == 12.5e9
    assert parse("15.7TFLOPS", "flops", "x") == pytest.approx(15.7e12)
    assert parse("1.5e10", "bytes", "x") == 1.5e10


def test_parse_cluster_happy_paths():
    hosts = parse_cluster("2x8xV100-32GB,2x8xT4")
    assert [(h.profile.name, h.devices) for h in hosts] == [
        ("V100-32GB", 8), ("V100-32GB", 8), ("T4", 8), ("T4", 8)]
    assert parse_cluster("8xA100") == [HostSpec(get_profile("A100-40GB"), 8)]
    assert parse_cluster("V100") == [HostSpec(get_profile("V100-16GB"), 1)]
    assert parse_cluster(" 1 x 4 x a10 , 2*T4") == [
        HostSpec(get_profile("A10"), 4), HostSpec(get_profile("T4"), 2)]


def test_parse_cluster_uses_overrides():
    overrides = {"MyGPU": {"base": "T4", "memory_bytes": 1e9}}
    (host,) = parse_cluster("4xMyGPU", overrides)
    assert host.profile.name == "MyGPU" and host.devices == 4


FORM = ("expected comma-separated tokens of the form [HOSTS x] "
        "[DEVICES_PER_HOST x] PROFILE [@ [NICS x] RATE], e.g. "
        "'2x8xV100-32GB,2x8xT4', '8xA100', 'V100' or "
        "'2x8xA100-80GB@8x200Gbps,2x8xT4@1x100Gbps'; RATE is one NIC's "
        "rate in Gbps or Gb/s (bits) or GBps or GB/s (bytes), NICS "
        "defaults to 1")
NETWORK_FORM = ("a host network is [NICS x] RATE after '@', e.g. "
                "'@8x200Gbps', '@4x100Gb/s', '@25GB/s'")


def test_parse_cluster_bad_token_caret():
    with pytest.raises(ClusterError) as info:
        parse_cluster("2x8xV100-32GB,2x8xV1OO")
    lines = str(info.value).split("\n")
    assert lines[:3] == [
        "cannot parse cluster spec '2x8xV100-32GB,2x8xV1OO':",
        "  2x8xV100-32GB,2x8xV1OO",
        "                    ^^^^"]
    assert lines[3].startswith("unknown device profile 'V1OO'. Known")
    assert lines[4] == FORM


@pytest.mark.parametrize("spec, carets, why", [
    ("2x0xT4", "  ^^^^", "counts must be at least 1 in '2x0xT4'"),
    ("T4,2x8x", "     ^^^^",
     "token '2x8x' is not [HOSTS x] [DEVICES_PER_HOST x] PROFILE"),
    ("1x2x3xT4", "  ^^^^^^^^",
     "token '1x2x3xT4' is not [HOSTS x] [DEVICES_PER_HOST x] PROFILE"),
    ("T4,,T4", "     ^", "empty token"),
])
def test_parse_cluster_bad_tokens_exact_message(spec, carets, why):
    _assert_caret_error(spec, carets, why)


def _assert_caret_error(spec, carets, why):
    """parse_cluster(spec) fails with the spec, `carets` under the bad part, and `why`."""
    with pytest.raises(ClusterError) as info:
        parse_cluster(spec)
    assert str(info.value) == (f"cannot parse cluster spec {spec!r}:\n"
                               f"  {spec}\n{carets}\n{why}\n{FORM}")


def test_parse_cluster_empty():
    with pytest.raises(ClusterError, match="empty cluster spec ''"):
        parse_cluster("")


def test_host_spec_needs_a_device():
    with pytest.raises(ClusterError, match="at least one device"):
        HostSpec(get_profile("T4"), 0)


# ------------------------------------------------------------ host networks --

def test_host_network_defaults_to_one_nic_at_the_profile_rate():
    t4 = get_profile("T4")
    (host,) = parse_cluster("8xT4")
    assert host.network == HostNetwork(1, t4.inter_node_bandwidth)
    assert host.network_bandwidth == profiles.DEFAULT_INTER_NODE_BANDWIDTH
    assert HostSpec(t4, 8) == HostSpec(t4, 8, HostNetwork(1, 12.5e9))
    overrides = {"T4": {"inter_node_bandwidth": "25Gb/s"}}
    (host,) = parse_cluster("8xT4", overrides)
    assert host.network == HostNetwork(1, 25e9 / 8)


@pytest.mark.parametrize("spec, nics, nic_bytes_per_s", [
    ("2x8xA100-80GB@8x200Gbps", 8, 25e9),
    ("8xV100@4x100Gb/s", 4, 12.5e9),
    ("8xV100 @ 4 X 100 gbps", 4, 12.5e9),
    ("8xV100@4*100GB/S", 4, 100e9),
    ("T4@100Gbps", 1, 12.5e9),
    ("T4@25GBps", 1, 25e9),
    ("T4@1x12.5GB/s", 1, 12.5e9),
])
def test_parse_cluster_reads_host_networks(spec, nics, nic_bytes_per_s):
    hosts = parse_cluster(spec)
    for host in hosts:
        assert host.network.nics == nics
        assert host.network.nic_bandwidth == pytest.approx(nic_bytes_per_s)
        assert host.network_bandwidth == pytest.approx(nics * nic_bytes_per_s)


def test_parse_cluster_networks_apply_per_token():
    hosts = parse_cluster("2x8xA100-80GB@8x200Gbps,2x8xT4@1x100Gbps,1xV100")
    assert [(h.profile.name, h.devices, h.network_bandwidth) for h in hosts] \
        == [("A100-80GB", 8, 200e9), ("A100-80GB", 8, 200e9),
            ("T4", 8, 12.5e9), ("T4", 8, 12.5e9), ("V100-16GB", 1, 12.5e9)]
    assert str(hosts[0].network) == "8 x 200 Gb/s (200.0 GB/s)"


@pytest.mark.parametrize("spec, carets, why", [
    ("2x8xA100@", "          ^", f"no network after '@'; {NETWORK_FORM}"),
    ("T4,2x8xA100@8x", "              ^^",
     f"cannot read the host network '8x'; {NETWORK_FORM}"),
    ("2x8xA100@200", "           ^^^",
     f"cannot read the host network '200'; {NETWORK_FORM}"),
    ("2x8xA100@8x200Mbps", "           ^^^^^^^^^",
     f"cannot read the host network '8x200Mbps'; {NETWORK_FORM}"),
    ("2x8xA100@0x200Gbps", "           ^^",
     "a host needs at least one NIC, got 0 in '0x200Gbps'"),
    ("T4@0Gbps", "     ^^^^^", "a NIC's rate must be positive, got '0Gbps'"),
    ("T4@100Gbps@2", "            ^",
     f"a token has at most one '@' (before its hosts' network); "
     f"{NETWORK_FORM}"),
    ("T4, @100Gbps", "      ^^^^^^^^",
     "token '@100Gbps' names no profile before '@'"),
])
def test_parse_cluster_bad_network_exact_message(spec, carets, why):
    _assert_caret_error(spec, carets, why)


def test_host_network_checks_its_values():
    with pytest.raises(ClusterError, match="at least one NIC"):
        HostNetwork(0, 12.5e9)
    with pytest.raises(ClusterError, match="positive number of bytes/s"):
        HostNetwork(1, 0.0)
    with pytest.raises(ClusterError, match="must be a HostNetwork"):
        HostSpec(get_profile("T4"), 1, 12.5e9)


@pytest.mark.parametrize("description, name", [
    ("device: 0, name: Tesla V100-SXM2-32GB, pci bus id: 0000:00:04.0, "
     "compute capability: 7.0", "V100-32GB"),
    ("device: 1, name: Tesla V100-SXM2-16GB, pci bus id: 0000:00:05.0",
     "V100-16GB"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("device: 0, name: NVIDIA A100-SXM4-40GB, pci bus id: x", "A100-40GB"),
    ("device: 0, name: Tesla T4, pci bus id: 0000:00:1e.0", "T4"),
    ("device: 0, name: NVIDIA A10G, pci bus id: x", "A10"),
    ("device: 0, name: NVIDIA H100 80GB HBM3, pci bus id: x", "H100-80GB"),
    ("device: 0, name: NVIDIA H200, pci bus id: x", "H200-141GB"),
    ("device: 0, name: Tesla P100-PCIE-16GB, pci bus id: x", "P100-16GB"),
])
def test_detect_gpu_profiles(description, name):
    assert detect_profile("/device:GPU:0", description).name == name
    full = "/job:worker/replica:0/task:1/device:GPU:3"
    assert detect_profile(full, description).name == name


def test_detect_cpu_and_overrides():
    assert detect_profile("/device:CPU:0", "", FIXED_CPU).flops() == 1e11
    gpu = {"NVIDIA GeForce RTX 4090": {"base": "A10", "memory_bytes": 1e9}}
    profile = detect_profile(
        "/device:GPU:0", "device: 0, name: NVIDIA GeForce RTX 4090, pci", gpu)
    assert profile.name == "NVIDIA GeForce RTX 4090"
    assert profile.memory_bytes == 1e9


def test_detect_unknown_gpu_and_device_type():
    with pytest.raises(ClusterError) as info:
        detect_profile("/device:GPU:0", "device: 0, name: Tesla K80, pci x")
    assert str(info.value).startswith(
        "cannot tell which profile GPU '/device:GPU:0' ('Tesla K80') has")
    assert "{'Tesla K80': {'base': 'A100-40GB'" in str(info.value)
    with pytest.raises(ClusterError, match="has type 'TPU'"):
        detect_profile("/device:TPU:0")


def test_virtual_cpu_profiles_stand_for_a_mixed_cluster():
    overrides = {"CPU:0": "V100-32GB", "CPU:1": "V100-32GB", "CPU:2": "T4",
                 "/device:CPU:3": {"base": "T4", "memory_bytes": "8GiB"},
                 **FIXED_CPU}
    devices = virtual_cpu_profiles(5, overrides)
    assert [d.name for d in devices] == [
        "V100-32GB", "V100-32GB", "T4", "CPU:3", "CPU/5"]
    assert devices[3].memory_bytes == 8 * GiB
    assert devices[3].flops("float16") == 65e12
    # The configured "CPU" is the whole machine; the 5 devices share it.
    assert devices[4].flops() == pytest.approx(1e11 / 5)
    assert devices[4].memory_bytes == pytest.approx(8 * GiB / 5)


def test_virtual_cpu_profiles_default_share_the_measured_cpu():
    devices = virtual_cpu_profiles(2)
    cpu = profiles.cpu_profile()
    assert [d.name for d in devices] == ["CPU/2", "CPU/2"]
    assert devices[0].flops() == pytest.approx(
        cpu.flops() * profiles.replica_speedup(cpu, 2) / 2)
    assert devices[0].memory_bytes == pytest.approx(cpu.memory_bytes / 2)
    assert virtual_cpu_profiles(1) == [cpu]
    with pytest.raises(ClusterError, match="at least one virtual CPU"):
        virtual_cpu_profiles(0)


def test_cpu_profile_is_measured_once():
    cpu = profiles.cpu_profile()
    assert cpu is profiles.cpu_profile()
    assert get_profile("cpu") is cpu
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert cpu.memory_bytes == ram
    assert cpu.flops("float32") > 1e8  # at least 0.1 GFLOP/s
    assert cpu.memory_bandwidth > 1e8
    assert cpu.flops("float64") == cpu.flops("float32") / 2


def test_device_profile_to_dict_round_trips_through_overrides():
    a10 = get_profile("A10")
    fields = {k: v for k, v in a10.to_dict().items() if k != "name"}
    assert get_profile("Copy", {"Copy": fields}) == DeviceProfile(
        **{**a10.to_dict(), "name": "Copy"})


# ------------------------------------------------------------ calibration --

def test_cpu_share_divides_rates_and_multiplies_op_overhead():
    cpu = {"CPU": {**FIXED_CPU["CPU"], "op_overhead_s": "2us",
                   "collective_latency_s": 3e-5}}
    one, = virtual_cpu_profiles(1, cpu)
    four = virtual_cpu_profiles(4, cpu)[0]
    assert one.op_overhead_s == pytest.approx(2e-6)
    assert four.name == "CPU/4"
    assert four.op_overhead_s == pytest.approx(8e-6)
    assert four.intra_node_bandwidth == pytest.approx(2e10 / 4)
    assert four.memory_bandwidth == pytest.approx(2e10 / 4)
    assert four.collective_latency_s == pytest.approx(3e-5)


def test_cpu_share_keeps_the_step_cost_and_counts_the_sharers():
    cpu = {"CPU": {**FIXED_CPU["CPU"], "step_overhead_s": "300us"}}
    one, = virtual_cpu_profiles(1, cpu)
    four = virtual_cpu_profiles(4, cpu)[0]
    assert one.shared_by == 1 and four.shared_by == 4
    # one session run per step, whatever the devices
    assert four.step_overhead_s == one.step_overhead_s == pytest.approx(3e-4)


def test_step_overhead_and_shared_by_refuse_bad_values():
    with pytest.raises(ConfigError) as info:
        get_profile("CPU", {"CPU": {"base": "A10", "shared_by": 1.5}})
    assert str(info.value) == ("cluster.device_profiles['CPU'], field 'shared_by': "
                               "expected a positive whole number, got 1.5")
    with pytest.raises(ConfigError) as info:
        get_profile("CPU", {"CPU": {"base": "A10", "step_overhead_s": "fast"}})
    assert str(info.value) == (
        "cluster.device_profiles['CPU'], field 'step_overhead_s': expected a non-negative "
        "number of seconds or a string such as '3.5us', got 'fast'")


def test_fit_nonnegative_recovers_costs_and_holds_floors():
    rows = [[1.0, x, y] for x, y in [(1, 0), (2, 1), (5, 3), (9, 2), (4, 7)]]
    times = [0.5 + 2.0 * x + 3.0 * y for _, x, y in rows]
    assert calibration._fit_nonnegative(rows, times, (0.0, 0.0, 0.0)) == \
        pytest.approx([0.5, 2.0, 3.0])
    # a cost the data make negative is held at its floor, the others are
    # the least-squares fit of what is left
    times = [1.0 + 2.0 * x - 0.5 * y for _, x, y in rows]
    fit = calibration._fit_nonnegative(rows, times, (0.0, 0.0, 1e-3))
    import numpy as np
    a = np.asarray(rows)
    rest = np.asarray(times) - 1e-3 * a[:, 2]
    expected = np.linalg.lstsq(a[:, :2], rest, rcond=None)[0]
    assert min(expected) > 0
    assert fit == pytest.approx([*expected, 1e-3])


def test_step_terms_count_what_the_reference_steps_hold():
    import tensorflow as tf
    small, deep, block, blocks, einsum = (calibration._step_terms(tf, step) for step in (
        ("mlp", 16, 2, 8), ("mlp", 16, 10, 8), ("transformer", 1, False),
        ("transformer", 4, False), ("transformer", 1, True)))
    assert [len(t) for t in (small, block)] == [4 + len(profiles.KERNEL_CLASSES)] * 2
    for terms in (small, deep, block, blocks, einsum):
        assert terms[0] == 1.0 and all(t > 0 for t in terms[1:4])
    attention, einsums = (profiles.KERNEL_CLASSES.index(c) + 4 for c in (
        ("BatchMatMulV2", "Transpose", "Softmax"), ("Einsum",)))
    assert deep[1] > small[1] and deep[2] > small[2]   # more layers: more ops, FLOPs
    assert small[attention] == deep[attention] == 0.0  # an MLP has no attention
    # a transformer block's batched matmuls, transposes and softmax, forward
    # and backward; 4 blocks hold 4 times as many
    assert block[attention] > 0 and blocks[attention] == 4 * block[attention]
    # dense layers as einsums: the same attention, and einsums instead of matmuls
    assert block[einsums] == 0 and einsum[einsums] > 0
    assert einsum[attention] == block[attention]
    # Adam's bytes: 7 x the parameters, 2 layers of 16 x 16 + 16
    assert small[3] == pytest.approx(7 * 4 * 2 * (16 * 16 + 16))


def test_step_costs_from_the_fit():
    classes = len(profiles.KERNEL_CLASSES)
    rng = __import__("random").Random(0)
    terms = [[1.0, rng.uniform(100, 900), rng.uniform(1e6, 2e8), rng.uniform(1e4, 6e6),
              *(rng.choice([0, rng.uniform(1, 60)]) for _ in range(classes))]
             for _ in range(12)]
    kernel = [4e-5, 2e-5, 1e-5][:classes]
    seconds = [3e-4 + t[1] * 1e-7 + t[2] / 1.5e11 + t[3] / 3e10 +
               sum(k * n for k, n in zip(kernel, t[4:])) for t in terms]
    costs = calibration._step_costs(terms, seconds)
    assert costs.fixed_s == pytest.approx(3e-4)
    assert costs.op_s == pytest.approx(1e-7)
    assert costs.flop_rate == pytest.approx(1.5e11)
    assert costs.optimizer_bandwidth == pytest.approx(3e10)
    assert costs.kernel_s == pytest.approx(
        {t: k for types, k in zip(profiles.KERNEL_CLASSES, kernel) for t in types})


def test_cpu_share_follows_the_measured_replica_concurrency():
    # Measured: 4 replicas on a 2-core host reach 1.6 x one replica alone.
    cpu = {"CPU": {**FIXED_CPU["CPU"], "op_overhead_s": "2us",
                   "replica_concurrency": 1.6, "host_cores": 2}}
    two, four = (virtual_cpu_profiles(n, cpu)[0] for n in (2, 4))
    base = get_profile("CPU", cpu)
    assert two.flops() == pytest.approx(base.flops() * 1.6 / 2)
    assert four.flops() == pytest.approx(base.flops() * 1.6 / 4)
    assert four.op_overhead_s == pytest.approx(2e-6 * 4 / 1.6)
    assert four.memory_bandwidth == pytest.approx(base.memory_bandwidth * 0.4)
    # On 8 cores, measured with 4 replicas at 3 x: 2 replicas use 2 cores,
    # linear from 1 (one core) through 3 (four cores), held past the cores.
    wide = get_profile("CPU", {"CPU": {**FIXED_CPU["CPU"],
                                       "replica_concurrency": 3.0,
                                       "host_cores": 8}})
    assert profiles.replica_speedup(wide, 1) == 1.0
    assert profiles.replica_speedup(wide, 2) == pytest.approx(1 + 2 / 3)
    assert profiles.replica_speedup(wide, 4) == pytest.approx(3.0)
    assert profiles.replica_speedup(wide, 8) == pytest.approx(1 + 2 * 7 / 3)
    assert profiles.replica_speedup(wide, 16) == pytest.approx(1 + 2 * 7 / 3)
    with pytest.raises(ConfigError, match="whole number"):
        get_profile("CPU", {"CPU": {**FIXED_CPU["CPU"], "host_cores": 1.5}})


def test_gpu_profiles_have_no_overhead_terms():
    for name in profiles.known_profiles():
        if name != profiles.CPU_PROFILE_NAME:
            assert get_profile(name).op_overhead_s == 0.0
            assert get_profile(name).collective_latency_s == 0.0
            assert get_profile(name).op_type_overhead_s == {}
            assert get_profile(name).optimizer_bandwidth == 0.0
            assert get_profile(name).replica_sync_s == 0.0
            assert get_profile(name).input_read_s == 0.0
            assert get_profile(name).input_example_s == 0.0
            assert get_profile(name).step_overhead_s == 0.0
            assert get_profile(name).shared_by == 1


def test_new_profile_may_leave_out_the_overhead_fields():
    profile = get_profile("Mine", {"Mine": dict(FIXED_CPU["CPU"])})
    assert profile.op_overhead_s == 0.0
    assert profile.collective_latency_s == 0.0


@pytest.mark.parametrize("value,seconds", [
    (0, 0.0), (2e-6, 2e-6), ("3.5us", 3.5e-6), ("0.2 ms", 2e-4),
    ("1s", 1.0), ("40ns", 4e-8)])
def test_parse_seconds(value, seconds):
    assert profiles.parse_seconds(value, "here") == pytest.approx(seconds)


@pytest.mark.parametrize("value", [-1, "3 parsecs", True, None, "abc"])
def test_parse_seconds_rejects(value):
    with pytest.raises(ConfigError) as info:
        profiles.parse_seconds(value, "here")
    assert str(info.value) == (
        f"here: expected a non-negative number of seconds or a string such "
        f"as '3.5us', got {value!r}")


def test_overhead_field_error_names_the_profile_and_field():
    with pytest.raises(ConfigError) as info:
        get_profile("A100", {"A100": {"op_overhead_s": "fast"}})
    assert str(info.value) == (
        "cluster.device_profiles['A100'], field 'op_overhead_s': expected a "
        "non-negative number of seconds or a string such as '3.5us', got "
        "'fast'")


def test_measured_cpu_profile_has_overhead_terms_and_round_trips():
    cpu = profiles.cpu_profile()
    assert cpu.op_overhead_s >= calibration._FIT_FLOORS[1]
    assert cpu.step_overhead_s > 0
    assert set(cpu.op_type_overhead_s) == {t for types in profiles.KERNEL_CLASSES
                                           for t in types}
    assert cpu.collective_latency_s > 0
    assert cpu.intra_node_bandwidth > 1e8
    written = profiles.profile_file(cpu)
    assert list(written) == ["CPU"]
    again = virtual_cpu_profiles(1, written)[0]
    assert again == cpu


def test_op_type_overhead_must_be_a_mapping():
    with pytest.raises(ConfigError) as info:
        get_profile("A100", {"A100": {"op_type_overhead_s": 3}})
    assert str(info.value) == (
        "cluster.device_profiles['A100'], field 'op_type_overhead_s': "
        "expected a mapping of op type to seconds, got 3")
