"""Settings: sources, precedence and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from cpd.ops.config import Settings, env_var_names, load_settings
from cpd.protocol import subjects
from cpd.protocol.errors import ConfigError, ForgedSender


def test_defaults() -> None:
    s = load_settings(environ={})
    assert s.cache.block_size == 256
    assert s.admission.max_inflight == 24
    assert s.bus.max_message_bytes == 900 * 1024
    subjects.check_token(s.node.node_id)


def test_precedence_file_then_env_then_overrides(tmp_path: Path) -> None:
    f = tmp_path / "cpd.toml"
    f.write_text('[cache]\nblock_size = 128\n[nats]\nservers = ["nats://file:1"]\n')
    s = load_settings(f, environ={"CPD_CACHE__BLOCK_SIZE": "512"},
                      overrides=["admission.max_inflight=3"])
    assert s.cache.block_size == 512          # env beats file
    assert s.nats.servers == ["nats://file:1"]  # file beats default
    assert s.admission.max_inflight == 3      # override
    s = load_settings(environ={"CPD_CONFIG": str(f)}, overrides=["cache.block_size=64"])
    assert s.cache.block_size == 64


def test_list_settings_are_comma_separated_in_env_and_overrides() -> None:
    seeds = "nats://a:4222, nats://b:4222,nats://c:4222"
    s = load_settings(environ={"CPD_NATS__SERVERS": seeds})
    assert s.nats.servers == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    s = load_settings(environ={}, overrides=["nats.servers=tls://a:4222"])
    assert s.nats.servers == ["tls://a:4222"]
    assert load_settings(environ={}).nats.servers == ["nats://127.0.0.1:4222"]


@pytest.mark.parametrize("value", ["", "a:4222", "http://a:4222", "nats://"])
def test_bad_nats_servers_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"nats\.servers"):
        load_settings(environ={"CPD_NATS__SERVERS": value})


def test_env_strings_are_converted() -> None:
    s = load_settings(environ={"CPD_TELEMETRY__LOG_JSON": "false",
                               "CPD_BUS__REQUEST_TIMEOUT_S": "2.5"})
    assert s.telemetry.log_json is False and s.bus.request_timeout_s == 2.5


@pytest.mark.parametrize("env, needle", [
    ({"CPD_CACHE__BLOCK_SIZE": "ten"}, "block_size"),
    ({"CPD_CACHE__BLOCK_SIZE": "0"}, "block_size"),
    ({"CPD_ADMISSION__MAX_INFLIGHT": "-1"}, "max_inflight"),
    ({"CPD_MODEL__PRESET": "huge"}, "preset"),
    ({"CPD_NODE__NODE_ID": "has.dot"}, "node_id"),
    ({"CPD_CACHE__NO_SUCH": "1"}, "no_such"),
    ({"CPD_NOSECTION__X": "1"}, "nosection"),
])
def test_bad_values_name_the_setting(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(environ=env)
    assert needle in str(e.value)


def test_bad_file_and_override(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.toml", environ={})
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml [")
    with pytest.raises(ConfigError):
        load_settings(bad, environ={})
    with pytest.raises(ConfigError, match=r"section\.field=value"):
        load_settings(environ={}, overrides=["nodot=1"])


def test_env_var_names_cover_every_field() -> None:
    names = env_var_names()
    assert "CPD_NATS__SERVERS" in names and "CPD_CACHE__BLOCK_SIZE" in names
    env = {n: "x" for n in names if n != "CPD_CONFIG"}
    # Every listed name is accepted as a key (values may still be invalid).
    with pytest.raises(ConfigError) as e:
        load_settings(environ=env)
    assert "unknown" not in str(e.value)
    assert isinstance(Settings(), Settings)


@pytest.mark.parametrize(("subject", "sender"), [
    (subjects.heartbeat("n7"), subjects.Sender("n7")),
    (subjects.kv_events("n1"), subjects.Sender("n1")),
    (subjects.kv_events(subjects.KVINDEX_EVENTS_NODE), subjects.Sender("_kvindex")),
    (subjects.load("prefill", "p0"), subjects.Sender("p0", "prefill")),
    ("cpd.v1.node.heartbeat.a.b", None),   # not one token: no node's subject
    ("cpd.v1.load.p0", None),
    (subjects.GENERATE, None),
    (subjects.pull_ack("p0"), None),       # addressed to p0, not published by it
])
def test_sender_is_whose_per_node_subject_a_message_came_on(
        subject: str, sender: subjects.Sender | None) -> None:
    assert subjects.sender(subject) == sender


@pytest.mark.parametrize(("subject", "node", "role", "forged"), [
    (subjects.heartbeat("n7"), "n7", "", False),
    (subjects.heartbeat("n7"), "n8", "", True),
    (subjects.load("prefill", "p0"), "p0", "prefill", False),
    (subjects.load("prefill", "p0"), "p0", "decode", True),
    (subjects.load("prefill", "p0"), "p1", "prefill", True),
    (subjects.GENERATE, "p0", "", True),
])
def test_check_sender_refuses_a_message_naming_another_node(
        subject: str, node: str, role: str, forged: bool) -> None:
    if forged:
        with pytest.raises(ForgedSender):
            subjects.check_sender(subject, node, role)
    else:
        subjects.check_sender(subject, node, role)


def test_subjects_validate_tokens() -> None:
    assert subjects.run("prefill", "node-1") == "cpd.v1.prefill.node-1.run"
    assert subjects.kv_events("n1") == "cpd.v1.kv.events.n1"
    for bad in ("a.b", "*", ">", "", "x" * 65, "sp ace"):
        with pytest.raises(ValueError):
            subjects.kv_events(bad)
    with pytest.raises(ValueError):
        subjects.run("router", "n1")


@pytest.mark.parametrize("environ, overrides, role, expected", [
    # [engine] for every role.
    ({}, ["engine.max_num_seqs=8"], "decode", {"max_num_seqs": 8}),
    # A role's section overrides one field, the others stay [engine]'s.
    ({"CPD_ENGINE_PREFILL__MAX_NUM_SEQS": "2"}, ["engine.max_num_seqs=8"], "prefill",
     {"max_num_seqs": 2}),
    ({"CPD_ENGINE_PREFILL__MAX_NUM_SEQS": "2"}, ["engine.max_num_seqs=8"], "preprefill",
     {"max_num_seqs": 8}),
    ({}, ["engine_decode.enforce_eager=true", "engine.gpu_memory_utilization=0.9"], "decode",
     {"enforce_eager": True, "gpu_memory_utilization": 0.9}),
    # Any other vLLM argument: a JSON object from the environment or --set.
    ({"CPD_ENGINE__EXTRA_ARGS": '{"swap_space": 2}'}, [], "prefill",
     {"extra_args": {"swap_space": 2}}),
    ({}, ['engine_decode.extra_args={"max_logprobs": 5}'], "decode",
     {"extra_args": {"max_logprobs": 5}}),
    ({}, [], "decode", {"gpu_memory_utilization": 0.15, "max_model_len": 0,
                         "quantization": "", "extra_args": {}, "tensor_parallel_size": 1,
                         "pipeline_parallel_size": 1, "kv_cache_dtype": "auto"}),
    # The paper's nodes: TP=4 prefill, a data-parallel (TP=1) decode.
    ({}, ["engine_prefill.tensor_parallel_size=4"], "prefill",
     {"tensor_parallel_size": 4, "ranks": 4}),
    ({}, ["engine_prefill.tensor_parallel_size=4"], "decode", {"tensor_parallel_size": 1}),
    ({}, ["engine.pipeline_parallel_size=2", "engine.tensor_parallel_size=2"], "decode",
     {"ranks": 4}),
])
def test_engine_settings_per_role(environ: dict[str, str], overrides: list[str], role: str,
                                  expected: dict[str, object]) -> None:
    engine = load_settings(environ=environ, overrides=overrides).engine_for(role)
    assert {k: getattr(engine, k) for k in expected} == expected


@pytest.mark.parametrize("overrides", [
    ['engine.extra_args={"block_size": 16}'],          # CPD sets the KV layout itself
    ['engine_prefill.extra_args={"kv_transfer_config": {}}'],
    ["engine.extra_args=[1, 2]"],                      # not an object
    ["engine.extra_args={bad json"],
    ["engine.gpu_memory_utilization=1.5"],
    ["engine_decode.no_such_field=1"],
    ['engine.extra_args={"tensor_parallel_size": 2}'],  # a field of [engine] itself
    ["engine.tensor_parallel_size=0"],
    ["engine.kv_cache_dtype=int3"],
    # One role's KV could not be loaded by another.
    ["engine_decode.kv_cache_dtype=fp8"],
])
def test_bad_engine_settings_are_config_errors(overrides: list[str]) -> None:
    with pytest.raises(ConfigError):
        s = load_settings(environ={}, overrides=overrides)
        s.engine_for("prefill")


@pytest.mark.parametrize("overrides, model_context, served", [
    ([], 8192, 8192),
    (["engine.max_model_len=4096"], 8192, 4096),
    (["engine_decode.max_model_len=2048"], 8192, 2048),   # the smallest of any role
    (["engine.max_model_len=4096"], 0, 4096),
    ([], 0, 0),
])
def test_the_served_context_is_the_engines(overrides: list[str], model_context: int,
                                           served: int) -> None:
    assert load_settings(environ={}, overrides=overrides).served_context(
        model_context) == served


@pytest.mark.parametrize("overrides, kv_dtype", [
    ([], "float32"),
    (["model.dtype=bfloat16"], "bfloat16"),
    (["engine.kv_cache_dtype=fp8"], "fp8"),
    (["engine.kv_cache_dtype=fp8", "engine_prefill.kv_cache_dtype=fp8"], "fp8"),
])
def test_the_kv_dtype_of_every_block(overrides: list[str], kv_dtype: str) -> None:
    assert load_settings(environ={}, overrides=overrides).kv_dtype == kv_dtype
