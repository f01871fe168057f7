"""Tests of epl.config: schema, defaults, coercion, errors, environment, assignment, freezing."""

from __future__ import annotations

import copy
import logging
import os
import pickle

import pytest

from epl.config import Config, ConfigSection, KeySpec, env_var_name, format_schema, schema
from epl.errors import ConfigError

EXPECTED_DEFAULTS = {
    "pipeline.num_micro_batch": 1,
    "pipeline.num_stages": None,
    "pipeline.strategy": "PreferBackward",
    "pipeline.unit_functions": True,
    "gradient_checkpoint.type": "",
    "gradient_checkpoint.end_taskgraph": -1,
    "gradient_checkpoint.check_gradients": False,
    "zero.level": "",
    "offload.level": "",
    "amp.level": "",
    "amp.debug_log": False,
    "amp.loss_scale": "dynamic",
    "amp.dtype": "float16",
    "optimizer.num_apply_group": 1,
    "cluster.device_place_prefer_intra_node": True,
    "cluster.run_visible_devices": "",
    "cluster.colocate_split_and_replicate": False,
    "cluster.virtual_devices": 4,
    "cluster.device_profiles": {},
    "split.moe_chunks": 1,
    "communication.num_communicators": 2,
    "communication.sparse_as_dense": False,
    "communication.max_splits": 5,
    "communication.fusion_threshold_mb": 128,
    "communication.fp16": False,
    "communication.fp16_scale": 128,
    "communication.clip_after_allreduce": False,
    "communication.gradients_reduce_method": "mean",
    "communication.collective_timeout_s": 300,
    "communication.local_reduction": "auto",
    "io.slicing": False,
    "io.unbalanced_io_slicing": False,
    "io.drop_last_files": False,
    "io.batch_mode": "replica",
    "batch_norm.moving_statistics": "replica0",
    "auto.auto_parallel": False,
    "debug.dump_dir": "",
    "debug.check_invariants": False,
    "debug.disabled_passes": [],
    "debug.log_level": "",
    "debug.log_all_ranks": False,
    "debug.whole_graph_sessions": False,
    "debug.trace_dir": "",
    "debug.trace_steps": [2],
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove any EPL_* variables of the developer's shell from every test."""
    for name in list(os.environ):
        if name.startswith("EPL_"):
            monkeypatch.delenv(name)


def error_text(param_dict: dict) -> str:
    """Return the message of the ConfigError that Config(param_dict) raises."""
    with pytest.raises(ConfigError) as info:
        Config(param_dict)
    return str(info.value)


# Defaults and schema ------------------------------------------------------

def test_defaults_cover_exactly_the_documented_keys() -> None:
    assert Config().to_dict() == EXPECTED_DEFAULTS
    assert set(Config.keys()) == set(EXPECTED_DEFAULTS)


def test_default_types() -> None:
    config = Config()
    assert type(config.communication.fusion_threshold_mb) is float
    assert type(config.pipeline.num_micro_batch) is int
    assert config.pipeline.num_micro_batch == 1


def test_schema_entries_describe_each_key() -> None:
    specs = schema()
    assert [spec.key for spec in specs] == list(Config.keys())
    assert Config.schema() == specs
    strategy = next(spec for spec in specs if spec.key == "pipeline.strategy")
    assert isinstance(strategy, KeySpec)
    assert (strategy.section, strategy.name, strategy.type) == ("pipeline", "strategy", "str")
    assert strategy.allowed == ("PreferBackward", "PreferForward")
    assert strategy.env_var == "EPL_PIPELINE_STRATEGY"
    assert all(spec.doc for spec in specs)
    table = format_schema()
    assert "pipeline.num_micro_batch" in table and "an int >= 1" in table


def test_sections() -> None:
    assert Config.sections() == (
        "pipeline", "gradient_checkpoint", "zero", "offload", "amp", "optimizer",
        "cluster", "split", "communication", "io", "batch_norm", "auto", "debug")


# Input and access ------------------------------------------------------------

def test_dotted_dict_input_and_access() -> None:
    config = Config({"pipeline.num_micro_batch": 4, "gradient_checkpoint.type": "auto",
                     "cluster.colocate_split_and_replicate": True})
    assert config.pipeline.num_micro_batch == 4
    assert config.get("pipeline.num_micro_batch") == 4
    assert config.gradient_checkpoint.type == "auto"
    assert config.cluster.colocate_split_and_replicate is True
    assert config.to_dict()["pipeline.num_micro_batch"] == 4
    assert config.pipeline.to_dict() == {
        "num_micro_batch": 4, "num_stages": None, "strategy": "PreferBackward",
        "unit_functions": True}
    assert isinstance(config.pipeline, ConfigSection)


def test_none_and_empty_dict_give_defaults() -> None:
    assert Config(None) == Config({}) == Config()


def test_param_dict_must_be_a_dict() -> None:
    with pytest.raises(ConfigError, match="dict of"):
        Config([("pipeline.num_micro_batch", 4)])


# Coercion ------------------------------------------------------------------------

def test_int_accepted_for_float_key() -> None:
    config = Config({"communication.fusion_threshold_mb": 64})
    assert config.communication.fusion_threshold_mb == 64.0
    assert type(config.communication.fusion_threshold_mb) is float


def test_float_rejected_for_int_key() -> None:
    text = error_text({"pipeline.num_micro_batch": 2.0})
    assert "'pipeline.num_micro_batch'" in text and "2.0 (float)" in text
    assert "expected an int >= 1" in text


def test_bool_is_not_a_number_and_numbers_are_not_bools() -> None:
    text = error_text({"pipeline.num_micro_batch": True})
    assert "True (bool)" in text
    text = error_text({"communication.fp16": 1})
    assert "'communication.fp16'" in text and "1 (int)" in text
    assert "expected a bool (True or False)" in text


def test_strings_are_not_parsed_from_param_dict() -> None:
    text = error_text({"pipeline.num_micro_batch": "4"})
    assert "Invalid value '4'" in text and "expected an int >= 1" in text
    assert "'true'" in error_text({"io.slicing": "true"})


def test_str_enum_is_case_insensitive_and_canonical() -> None:
    config = Config({"amp.level": "o1", "pipeline.strategy": "preferforward"})
    assert config.amp.level == "O1"
    assert config.pipeline.strategy == "PreferForward"


def test_str_key_rejects_non_string() -> None:
    text = error_text({"debug.dump_dir": 3})
    assert "'debug.dump_dir'" in text and "3 (int)" in text and "expected a str" in text


def test_loss_scale_dynamic_or_positive_number() -> None:
    assert Config({"amp.loss_scale": "Dynamic"}).amp.loss_scale == "dynamic"
    assert Config({"amp.loss_scale": 1024}).amp.loss_scale == 1024.0
    text = error_text({"amp.loss_scale": "static"})
    assert "'static'" in text and "expected 'dynamic' or a number > 0" in text
    assert "expected 'dynamic' or a number > 0" in error_text({"amp.loss_scale": 0})


def test_dict_value_is_copied_and_frozen() -> None:
    profiles = {"cpu:1": {"flops": 1e12, "tags": ["slow"]}}
    config = Config({"cluster.device_profiles": profiles})
    profiles["cpu:1"]["flops"] = 0
    assert config.cluster.device_profiles["cpu:1"]["flops"] == 1e12
    with pytest.raises(TypeError):
        config.cluster.device_profiles["cpu:2"] = {}
    assert config.to_dict()["cluster.device_profiles"] == {
        "cpu:1": {"flops": 1e12, "tags": ["slow"]}}
    text = error_text({"cluster.device_profiles": ["cpu:1"]})
    assert "['cpu:1'] (list)" in text and "expected a dict" in text


# Unknown keys ------------------------------------------------------------------

def test_unknown_key_lists_section_keys_and_suggests() -> None:
    text = error_text({"pipeline.num_micro_batches": 4})
    assert "Unknown config key 'pipeline.num_micro_batches'" in text
    assert "Did you mean 'pipeline.num_micro_batch'?" in text
    assert "Valid keys of section 'pipeline': num_micro_batch, num_stages, strategy, unit_functions." in text


def test_unknown_key_without_close_match_has_no_suggestion() -> None:
    text = error_text({"zero.stage": 2})
    assert "Unknown config key 'zero.stage'" in text
    assert "Did you mean" not in text
    assert "Valid keys of section 'zero': level." in text


def test_unknown_section_lists_sections_and_suggests() -> None:
    text = error_text({"pipline.num_micro_batch": 4})
    assert "Unknown config section 'pipline'" in text
    assert "Did you mean 'pipeline.num_micro_batch'?" in text
    assert ("Valid sections: pipeline, gradient_checkpoint, zero, offload, amp, optimizer, "
            "cluster, split, communication, io, batch_norm, auto, debug.") in text


def test_unknown_section_far_from_any() -> None:
    text = error_text({"horovod.enabled": True})
    assert "Unknown config section 'horovod'" in text
    assert "Did you mean" not in text
    assert "Valid sections: pipeline" in text


def test_bare_key_name_suggests_dotted_key() -> None:
    text = error_text({"num_micro_batch": 4})
    assert "not of the form 'section.key'" in text
    assert "Did you mean 'pipeline.num_micro_batch'?" in text


def test_section_name_alone_lists_its_keys() -> None:
    text = error_text({"zero": "v1"})
    assert "names a section" in text and "Valid keys of section 'zero': level." in text


def test_get_unknown_key() -> None:
    with pytest.raises(ConfigError, match="Did you mean 'amp.level'"):
        Config().get("amp.levle")


def test_unknown_attribute() -> None:
    config = Config()
    with pytest.raises(ConfigError, match="Did you mean 'pipeline'"):
        config.pipelin
    with pytest.raises(AttributeError, match="Did you mean 'pipeline.strategy'"):
        config.pipeline.strategi
    assert not hasattr(config, "nothing")
    assert not hasattr(config.pipeline, "nothing")


# Bad values ------------------------------------------------------------------------

def test_bad_enum_lists_valid_values() -> None:
    text = error_text({"pipeline.strategy": "GPipe"})
    assert text == ("Invalid value 'GPipe' for config key 'pipeline.strategy': "
                    "expected one of ['PreferBackward', 'PreferForward'].")
    text = error_text({"gradient_checkpoint.type": "manual"})
    assert "'manual'" in text and "['', 'collection', 'auto']" in text
    assert "['mean', 'sum']" in error_text({"communication.gradients_reduce_method": "avg"})
    assert "['', 'v0', 'v1']" in error_text({"zero.level": "v2"})
    assert "['', 'v0']" in error_text({"offload.level": "v1"})
    assert "['float16', 'bfloat16']" in error_text({"amp.dtype": "float32"})


def test_bad_range() -> None:
    text = error_text({"pipeline.num_micro_batch": 0})
    assert text == ("Invalid value 0 (int) for config key 'pipeline.num_micro_batch': "
                    "expected an int >= 1.")
    assert "expected an int >= 1" in error_text({"cluster.virtual_devices": 0})
    assert "expected an int >= 0" in error_text({"communication.max_splits": -1})
    assert "expected a number > 0" in error_text({"communication.fusion_threshold_mb": 0})
    assert "expected a number > 0" in error_text({"communication.collective_timeout_s": -5})
    assert "nan" in error_text({"communication.fp16_scale": float("nan")})
    assert Config({"communication.max_splits": 0}).communication.max_splits == 0
    assert Config({"gradient_checkpoint.end_taskgraph": 3}).gradient_checkpoint.end_taskgraph == 3


# Environment ----------------------------------------------------------------------

def test_env_var_names() -> None:
    assert env_var_name("pipeline.num_micro_batch") == "EPL_PIPELINE_NUM_MICRO_BATCH"
    assert env_var_name("gradient_checkpoint.type") == "EPL_GRADIENT_CHECKPOINT_TYPE"


def test_env_overrides_default_and_param_dict_wins(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """EPL's precedence: default < environment < param_dict (EPL's config_env_test)."""
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "4")
    monkeypatch.setenv("EPL_COMMUNICATION_MAX_SPLITS", "24")
    assert Config().pipeline.num_micro_batch == 4
    with caplog.at_level(logging.WARNING, logger="epl.config"):
        config = Config({"pipeline.num_micro_batch": 2, "communication.max_splits": 24})
    assert config.pipeline.num_micro_batch == 2
    assert config.communication.max_splits == 24
    # one warning, for the variable the dict overrides with another value
    assert caplog.messages == [
        "Config key 'pipeline.num_micro_batch' is 2 in the config dict, which wins over the "
        "environment variable EPL_PIPELINE_NUM_MICRO_BATCH='4' (EPL's precedence)."]


def test_bad_env_value_is_an_error_even_where_the_dict_sets_the_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "four")
    with pytest.raises(ConfigError, match="EPL_PIPELINE_NUM_MICRO_BATCH"):
        Config({"pipeline.num_micro_batch": 2})


def test_env_keys_with_underscores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_GRADIENT_CHECKPOINT_TYPE", "auto")
    monkeypatch.setenv("EPL_GRADIENT_CHECKPOINT_END_TASKGRAPH", "2")
    monkeypatch.setenv("EPL_DEBUG_DUMP_DIR", "/tmp/x")
    monkeypatch.setenv("EPL_CLUSTER_DEVICE_PLACE_PREFER_INTRA_NODE", "false")
    monkeypatch.setenv("EPL_COMMUNICATION_GRADIENTS_REDUCE_METHOD", "SUM")
    config = Config()
    assert config.gradient_checkpoint.type == "auto"
    assert config.gradient_checkpoint.end_taskgraph == 2
    assert config.debug.dump_dir == "/tmp/x"
    assert config.cluster.device_place_prefer_intra_node is False
    assert config.communication.gradients_reduce_method == "sum"


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("TRUE", True), ("1", True), ("false", False), ("False", False), ("0", False)])
def test_env_bool_strings(monkeypatch: pytest.MonkeyPatch, text: str, expected: bool) -> None:
    monkeypatch.setenv("EPL_COMMUNICATION_FP16", text)
    assert Config().communication.fp16 is expected


def test_env_numbers_dicts_and_loss_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_COMMUNICATION_FUSION_THRESHOLD_MB", "32.5")
    monkeypatch.setenv("EPL_AMP_LOSS_SCALE", "256")
    monkeypatch.setenv("EPL_CLUSTER_DEVICE_PROFILES", '{"cpu:1": {"flops": 2e12}}')
    config = Config()
    assert config.communication.fusion_threshold_mb == 32.5
    assert config.amp.loss_scale == 256.0
    assert config.cluster.device_profiles == {"cpu:1": {"flops": 2e12}}
    monkeypatch.setenv("EPL_AMP_LOSS_SCALE", "dynamic")
    assert Config().amp.loss_scale == "dynamic"


def test_bad_env_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "four")
    with pytest.raises(ConfigError) as info:
        Config()
    assert str(info.value) == (
        "Invalid value 'four' for environment variable EPL_PIPELINE_NUM_MICRO_BATCH "
        "(config key 'pipeline.num_micro_batch'): expected an int >= 1.")


def test_bad_env_bool_and_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_IO_SLICING", "yes")
    with pytest.raises(ConfigError, match="EPL_IO_SLICING.*'true', 'false', '1', '0'"):
        Config()
    monkeypatch.delenv("EPL_IO_SLICING")
    monkeypatch.setenv("EPL_CLUSTER_VIRTUAL_DEVICES", "0")
    with pytest.raises(ConfigError, match="EPL_CLUSTER_VIRTUAL_DEVICES.*an int >= 1"):
        Config()


def test_bad_env_enum_and_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_ZERO_LEVEL", "v3")
    with pytest.raises(ConfigError, match=r"EPL_ZERO_LEVEL.*one of \['', 'v0', 'v1'\]"):
        Config()
    monkeypatch.delenv("EPL_ZERO_LEVEL")
    monkeypatch.setenv("EPL_CLUSTER_DEVICE_PROFILES", "{not json")
    with pytest.raises(ConfigError, match="EPL_CLUSTER_DEVICE_PROFILES.*JSON"):
        Config()


def test_env_read_once_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    config = Config()
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICRO_BATCH", "8")
    assert config.pipeline.num_micro_batch == 1
    assert Config().pipeline.num_micro_batch == 8


def test_explicit_environ_mapping() -> None:
    config = Config(environ={"EPL_ZERO_LEVEL": "v1"})
    assert config.zero.level == "v1"


def test_unknown_env_var_in_a_section_is_logged(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("EPL_PIPELINE_NUM_MICROBATCH", "4")
    with caplog.at_level(logging.WARNING, logger="epl.config"):
        config = Config()
    assert config.pipeline.num_micro_batch == 1
    assert "EPL_PIPELINE_NUM_MICROBATCH" in caplog.text
    assert "Did you mean 'EPL_PIPELINE_NUM_MICRO_BATCH'?" in caplog.text


# Assignment, freezing, equality, representation ----------------------------------

def test_assignment_as_in_epl() -> None:
    """EPL's tests set keys as attributes: config.zero.level = "v1"."""
    config = Config()
    config.zero.level = "V0"
    config.pipeline.num_micro_batch = 4
    config.communication.fusion_threshold_mb = 64
    assert config.zero.level == "v0"
    assert config.get("pipeline.num_micro_batch") == 4
    assert type(config.communication.fusion_threshold_mb) is float
    assert config.non_default() == {"pipeline.num_micro_batch": 4, "zero.level": "v0",
                                    "communication.fusion_threshold_mb": 64.0}
    section = config.pipeline
    config.pipeline.strategy = "preferforward"
    assert section.strategy == "PreferForward"   # a section is a view of its Config


def test_assignment_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPL_ZERO_LEVEL", "v1")
    config = Config()
    assert config.zero.level == "v1"
    config.zero.level = ""
    assert config.zero.level == ""


def test_assignment_is_validated() -> None:
    config = Config()
    with pytest.raises(ConfigError) as info:
        config.pipeline.num_micro_batch = 0
    assert str(info.value) == ("Invalid value 0 (int) for config key 'pipeline.num_micro_batch': "
                               "expected an int >= 1.")
    with pytest.raises(ConfigError) as info:
        config.zero.level = None
    assert str(info.value) == ("Invalid value None (NoneType) for config key 'zero.level': "
                               "expected one of ['', 'v0', 'v1'].")
    with pytest.raises(AttributeError) as info:
        config.zero.levle = "v1"
    assert isinstance(info.value, ConfigError)
    assert str(info.value) == ("Unknown config key 'zero.levle'. Did you mean 'zero.level'? "
                               "Valid keys of section 'zero': level.")
    assert config == Config()


def test_sections_are_not_replaced_or_deleted() -> None:
    config = Config()
    with pytest.raises(ConfigError) as info:
        config.pipeline = None
    assert str(info.value) == ("Cannot replace config section 'pipeline'; assign its keys "
                               "instead, e.g. config.pipeline.num_micro_batch = ...")
    with pytest.raises(ConfigError) as info:
        del config.pipeline.strategy
    assert str(info.value) == ("Cannot delete config key 'pipeline.strategy': every key has a "
                               "value; assign its default instead.")
    with pytest.raises(AttributeError, match="Config has no section 'pipelin'. Did you mean"):
        config.pipelin = 3


def test_frozen_config_refuses_assignment() -> None:
    config = Config({"pipeline.num_micro_batch": 2})
    assert not config.frozen
    assert config.freeze() is config and config.frozen
    with pytest.raises(ConfigError) as info:
        config.pipeline.num_micro_batch = 4
    assert str(info.value) == (
        "Cannot set pipeline.num_micro_batch = 4: this Config is in use by epl.init, which "
        "froze it (the graphs built since are annotated and rewritten under its values). Set "
        "keys before calling epl.init, or build a new Config and call epl.init with it: graphs "
        "built after that use the new values.")
    assert config.pipeline.num_micro_batch == 2
    newer = config.updated({"pipeline.num_micro_batch": 4})
    assert not newer.frozen and newer.pipeline.num_micro_batch == 4


def test_only_frozen_configs_hash() -> None:
    config = Config()
    with pytest.raises(TypeError, match="unhashable Config: it can change until epl.init"):
        hash(config)
    with pytest.raises(TypeError, match="unhashable Config"):
        hash(config.zero)
    assert hash(config.freeze()) == hash(Config().freeze())


def test_updated_returns_new_config() -> None:
    config = Config({"pipeline.num_micro_batch": 2})
    newer = config.updated({"pipeline.num_micro_batch": 4, "zero.level": "v1"})
    assert config.pipeline.num_micro_batch == 2
    assert newer.pipeline.num_micro_batch == 4 and newer.zero.level == "v1"
    with pytest.raises(ConfigError, match="Did you mean 'zero.level'"):
        config.updated({"zero.levl": "v1"})


def test_equality_and_hash() -> None:
    first = Config({"pipeline.num_micro_batch": 4, "cluster.device_profiles": {"a": [1]}})
    second = Config({"cluster.device_profiles": {"a": [1]}, "pipeline.num_micro_batch": 4})
    assert first == second and hash(first.freeze()) == hash(second.freeze())
    assert first != Config()
    assert first != first.to_dict()
    assert Config({"communication.fp16_scale": 128}) == Config()


def test_round_trips() -> None:
    config = Config({"amp.level": "O1", "cluster.device_profiles": {"cpu:0": {"memory": 1}}})
    assert Config(config.to_dict()) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert copy.deepcopy(config) == config
    assert not pickle.loads(pickle.dumps(config)).frozen
    assert pickle.loads(pickle.dumps(config.freeze())).frozen
    section = pickle.loads(pickle.dumps(config.amp))
    assert section == config.amp and section.level == "O1"


def test_pickle_does_not_read_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    data = pickle.dumps(Config())
    monkeypatch.setenv("EPL_ZERO_LEVEL", "v1")
    assert pickle.loads(data).zero.level == ""


def test_repr_and_str() -> None:
    assert repr(Config()) == "Config()"
    config = Config({"pipeline.num_micro_batch": 4, "amp.level": "O1"})
    assert repr(config) == "Config({'pipeline.num_micro_batch': 4, 'amp.level': 'O1'})"
    assert config.non_default() == {"pipeline.num_micro_batch": 4, "amp.level": "O1"}
    assert "num_micro_batch = 4" in str(config)
    assert repr(config.zero) == "ConfigSection('zero', level='')"
