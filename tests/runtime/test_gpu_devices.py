"""GPU device handling that runs on CPU: profile detection from real GPU model
names, the local collectives' communication hint, and the GPU session config."""
import pytest
import tensorflow as tf

from epl.planner import profiles
from epl.runtime.cluster import Cluster
from epl.errors import ClusterError
from epl.planner.profiles import GiB, detect_profile, get_profile
from epl.runtime.communicators import LocalCommunicator, local_communication_hint


# Model names as TensorFlow's device details ("device_name") and nvidia-smi give them.
@pytest.mark.parametrize("model, name", [
    ("NVIDIA H200", "H200-141GB"),
    ("NVIDIA H200 NVL", "H200-NVL"),
    ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ("NVIDIA H100 PCIe", "H100-PCIe"),
    ("NVIDIA H100 NVL", "H100-NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"),
    ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
    ("NVIDIA A10G", "A10"),
    ("NVIDIA A10", "A10"),
    ("Tesla V100-SXM2-32GB", "V100-32GB"),
    ("Tesla V100S-PCIE-32GB", "V100-32GB"),
    ("Tesla V100-PCIE-16GB", "V100-16GB"),
    ("Tesla T4", "T4"),
    ("Tesla P100-PCIE-16GB", "P100-16GB"),
])
def test_real_gpu_names_map_to_profiles(model, name):
    assert profiles.gpu_profile_name(model) == name
    assert detect_profile("/device:GPU:0", model).name == name
    description = f"device: 0, name: {model}, pci bus id: 0000:00:04.0, compute capability: 9.0"
    assert detect_profile("/job:worker/replica:0/task:1/device:GPU:3", description).name == name


def test_hopper_figures_follow_the_datasheets():
    h200, nvl = get_profile("H200-141GB"), get_profile("H200-NVL")
    assert (h200.memory_bytes, h200.memory_bandwidth) == (141 * GiB, 4.8e12)
    assert h200.flops("bf16") == pytest.approx(989.5e12)    # 1,979 with sparsity
    assert h200.flops("tf32") == pytest.approx(494.5e12)    # 989 with sparsity
    assert h200.flops("float32") == pytest.approx(67e12)
    assert h200.intra_node_bandwidth == 450e9                # NVLink 900 GB/s both ways
    assert (nvl.memory_bytes, nvl.flops("fp16")) == (141 * GiB, pytest.approx(835.5e12))
    h100_nvl, h100_pcie = get_profile("H100-NVL"), get_profile("H100-PCIe")
    assert (h100_nvl.memory_bytes, h100_nvl.memory_bandwidth) == (94 * GiB, 3.9e12)
    assert h100_nvl.intra_node_bandwidth == 300e9            # bridge 600 GB/s both ways
    assert (h100_pcie.flops("float32"), h100_pcie.memory_bandwidth) == (
        pytest.approx(51e12), 2.0e12)
    assert h100_pcie.flops("float16") == pytest.approx(756.5e12)


def _unknown_gpu_message(model: str, why: str) -> str:
    return (f"cannot tell which profile GPU '/device:GPU:0' ({model!r}) has: {why}; known "
            f"profiles: {profiles.known_profiles()}. To plan for it, add one under the "
            f"config key cluster.device_profiles, either from a known profile, e.g. "
            f"{{{(model or 'MyGPU')!r}: {{'base': 'A100-40GB', 'memory_bytes': '24GiB'}}}}, or "
            f"with every field: {{{(model or 'MyGPU')!r}: {{'peak_flops': {{'float32': 2e13, "
            f"'float16': 1.5e14}}, 'memory_bytes': 2.4e10, 'memory_bandwidth': 9e11, "
            f"'intra_node_bandwidth': 3.2e10, 'inter_node_bandwidth': 1.25e10}}}}")


@pytest.mark.parametrize("model, why", [
    # Grace Hopper, an RTX A1000 and a T400 are not H200, A100 and T4 cards.
    ("NVIDIA GH200 480GB", "no built-in profile matches the GPU model 'NVIDIA GH200 480GB'"),
    ("NVIDIA RTX A1000", "no built-in profile matches the GPU model 'NVIDIA RTX A1000'"),
    ("NVIDIA T400", "no built-in profile matches the GPU model 'NVIDIA T400'"),
    ("Tesla K80", "no built-in profile matches the GPU model 'Tesla K80'"),
    # A name stating another memory size than the profile it matches.
    ("Tesla P100-PCIE-12GB", "GPU model 'Tesla P100-PCIE-12GB' states 12 GB of memory, but the "
                             "profile its name matches, 'P100-16GB', has 16 GiB"),
    ("", "TensorFlow gave no model name for it"),
])
def test_unknown_gpu_exact_message(model, why):
    with pytest.raises(ClusterError) as info:
        detect_profile("/device:GPU:0", model)
    assert str(info.value) == _unknown_gpu_message(model, why)


def test_unknown_gpu_planned_through_an_override():
    overrides = {"NVIDIA GH200 480GB": {"base": "H100-80GB", "memory_bytes": "96GiB"}}
    profile = detect_profile("/device:GPU:0", "NVIDIA GH200 480GB", overrides)
    assert (profile.name, profile.memory_bytes) == ("NVIDIA GH200 480GB", 96 * GiB)


# ------------------------------------------------------- local collectives --

@pytest.mark.parametrize("device_type, devices, physical, hint", [
    ("GPU", 8, 8, "nccl"),   # one device per GPU
    ("GPU", 1, 8, "nccl"),   # one process per GPU (Horovod habit)
    ("GPU", 2, 1, "ring"),   # two logical GPUs on one: NCCL refuses a GPU twice
    ("CPU", 4, 0, "auto"),   # virtual CPU devices: TensorFlow's default, as before
])
def test_local_communication_hint(device_type, devices, physical, hint):
    assert local_communication_hint(device_type, devices, physical) == hint


@pytest.mark.parametrize("hint", ["auto", "ring", "nccl"])
def test_every_local_collective_carries_the_hint(hint):
    devices = ["/device:CPU:0", "/device:CPU:1"]
    communicator = LocalCommunicator(timeout_s=30, communication_hint=hint)
    with tf.Graph().as_default() as graph:
        tensors = [tf.constant([1.0, 2.0]) for _ in devices]
        communicator.all_reduce(tensors, devices)
        communicator.all_gather(tensors, devices)
        communicator.broadcast(tensors[0], devices)
    collectives = [op for op in graph.get_operations() if op.type.startswith("Collective")]
    assert sorted({op.type for op in collectives}) == [
        "CollectiveBcastRecv", "CollectiveBcastSend", "CollectiveGather", "CollectiveReduce"]
    assert {op.get_attr("communication_hint").decode() for op in collectives} == {hint}


def test_bad_hint_is_refused():
    with pytest.raises(ValueError, match=r"communication_hint must be one of \('auto', 'ring', "
                                         r"'nccl'\), got 'NCCL2'"):
        LocalCommunicator(communication_hint="NCCL2")


def test_epl_picks_the_default_hint_on_cpu(models, epl_env):
    """With TensorFlow's collectives among CPU devices (communication.local_reduction
    "collective"; the CPU default sums on one device) the hint is TensorFlow's default."""
    epl_env({"cluster.virtual_devices": 2, "communication.local_reduction": "collective"})
    import epl
    with tf.Graph().as_default() as graph:
        models.build("mlp", "sgd")
        epl.parallelize(graph)
    reduces = [op for op in graph.get_operations() if op.type == "CollectiveReduce"]
    assert reduces
    assert {op.get_attr("communication_hint").decode() for op in reduces} == {"auto"}


@pytest.mark.parametrize("device_type,choice,expected", [
    ("CPU", "auto", True), ("GPU", "auto", False), ("GPU", "one_device", True),
    ("CPU", "collective", False)])
def test_local_reduction_sums_on_one_device_among_cpus_by_default(device_type, choice,
                                                                   expected):
    from epl.config import Config
    from epl.runtime.communicators import reduces_to_one_device
    config = Config({"communication.local_reduction": choice})
    assert reduces_to_one_device(Cluster(device_type, 2), config) is expected


# ----------------------------------------------------------- session config --

def test_cpu_session_config_is_unchanged():
    config = Cluster("CPU", 4).session_config(None)
    assert config == tf.compat.v1.ConfigProto(device_count={"CPU": 4})


def test_gpu_session_config_without_base_is_tensorflows_default():
    from tensorflow.python.eager import context
    assert Cluster("GPU", 2).session_config(None) == context.context().config
    base = tf.compat.v1.ConfigProto(log_device_placement=True)
    assert Cluster("GPU", 2).session_config(base) == base
