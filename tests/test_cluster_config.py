"""The typed cluster config (cluster/config.py) and the YAML files of configs/."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from actors.engine.config import EngineConfig
from cluster.config import (
    CLUSTER_OWNED_ENGINE_FIELDS,
    SERVER_OWNED_ENGINE_FIELDS,
    ClusterConfig,
    ConfigError,
    EngineOverrides,
    ServerConfig,
    TransferConfig,
    load_config,
    parse_config,
)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RAY_CLUSTER_YAML = CONFIGS / "ray_cluster.yaml"
LAYOUTS = sorted(p for p in CONFIGS.glob("*.yaml") if p != RAY_CLUSTER_YAML)


def _base() -> dict:
    return yaml.safe_load((CONFIGS / "local_cpu.yaml").read_text())


def _load_errors(tmp_path, data) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    return str(info.value)


# --- configs/ -----------------------------------------------------------------------------


def test_the_layouts_are_there():
    assert {p.name for p in LAYOUTS} >= {"local_cpu.yaml", "local_cpu_features.yaml", "cpu_2p2d_tp2.yaml",
                                        "gpu_example.yaml"}


@pytest.mark.parametrize("path", LAYOUTS, ids=lambda p: p.name)
def test_every_layout_loads_and_yields_engine_configs(path):
    config = load_config(path)
    assert isinstance(config, ClusterConfig)
    for role in ("prefill", "decode"):
        engine = config.engine_config(role, model_path="/unused")
        assert isinstance(engine, EngineConfig)
        assert engine.device == config.group(role).device
    assert config.prefill.engine.page_size == config.decode.engine.page_size


def test_the_layout_example_of_configs_readme_loads():
    """The annotated example in configs/README.md is a file one can start from: its sections whose
    keys are all comments (YAML: null) keep their defaults, as an empty engine section does."""
    text = (CONFIGS / "README.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    data = yaml.safe_load(example)
    assert data["transfer"] is None and data["placement"] is None  # (what makes this test bite)
    config = parse_config(data, source="configs/README.md")
    assert config.transfer == TransferConfig() and config.server.port == 8000
    assert config.decode.engine.page_size == config.prefill.engine.page_size == 16
    assert parse_config({**data, "decode": {"engine": None}, "prefill": None}).prefill.engine.page_size == 1
    assert "server: Input should be a valid dictionary" in _load_errors_of({**data, "server": "8000"})


def _load_errors_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


def test_local_cpu_layout():
    config = load_config(CONFIGS / "local_cpu.yaml")
    assert config.model.builtin == "llama" and config.model.model_path is None
    for group in (config.prefill, config.decode):
        assert (group.num_workers, group.tp_size, group.device, group.gpus_per_rank) == (1, 1, "cpu", 0.0)
    assert config.transfer.backend == "shm"
    assert config.server.host == "127.0.0.1"


SPECULATIVE_FIELDS = ("speculative_algorithm", "speculative_num_draft_tokens", "speculative_ngram_min",
                      "speculative_ngram_max")


def test_local_cpu_features_layout():
    """local_cpu.yaml's layout with the serving features switched on, and nothing else changed: the
    parsers on the server, n-gram speculation on the decode side only (a prefill worker refuses it)."""
    config, base = load_config(CONFIGS / "local_cpu_features.yaml"), load_config(CONFIGS / "local_cpu.yaml")
    assert (config.server.reasoning_parser, config.server.tool_call_parser) == ("qwen3", "hermes")
    decode = config.engine_config("decode", model_path="/unused")
    assert (decode.speculative_algorithm, decode.speculative_num_draft_tokens) == ("ngram", 4)
    assert config.engine_config("prefill", model_path="/unused").speculative_algorithm is None
    assert config.model.builtin == "qwen3"
    assert config.prefill == base.prefill
    assert config.decode.model_dump(exclude={"engine": set(SPECULATIVE_FIELDS)}) == \
        base.decode.model_dump(exclude={"engine": set(SPECULATIVE_FIELDS)})
    assert config.server.model_dump(exclude={"reasoning_parser", "tool_call_parser"}) == \
        base.server.model_dump(exclude={"reasoning_parser", "tool_call_parser"})
    assert (config.transfer, config.router, config.placement) == (base.transfer, base.router, base.placement)


def test_cpu_2p2d_tp2_layout():
    config = load_config(CONFIGS / "cpu_2p2d_tp2.yaml")
    assert (config.prefill.num_workers, config.prefill.tp_size) == (2, 1)
    assert (config.decode.num_workers, config.decode.tp_size) == (2, 2)
    assert config.prefill.num_ranks + config.decode.num_ranks == 6
    assert {config.prefill.device, config.decode.device} == {"cpu"}
    assert config.model.builtin is not None


def test_each_side_takes_its_own_pipeline_stages():
    """Prefill PP 2 × TP 2, decode PP 1: a worker's ranks are every stage's (its placement group's bundles)."""
    config = load_config(CONFIGS / "cpu_2p2d_tp2.yaml").with_updates(
        {"prefill.tp_size": 2, "prefill.engine.pp_size": 2, "prefill.engine.pp_layer_partition": [1, 1]})
    assert (config.prefill.ranks_per_worker, config.decode.ranks_per_worker) == (4, 2)
    assert config.prefill.num_ranks + config.decode.num_ranks == 12
    assert config.engine_config("prefill", model_path="/unused").num_ranks == 4


def test_gpu_example_layout():
    config = load_config(CONFIGS / "gpu_example.yaml")
    assert config.model.model_path and config.model.builtin is None
    assert {config.prefill.device, config.decode.device} == {"cuda"}
    assert config.decode.tp_size == 2 and config.decode.gpus_per_rank == 1.0  # a decode worker takes 2 GPUs
    assert config.transfer.backend in ("auto", "cuda_ipc")
    assert config.placement.use_node_resources


# --- errors name the field -------------------------------------------------------------------


def _set(data: dict, dotted: str, value) -> dict:
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


@pytest.mark.parametrize("dotted, value, expected", [
    ("prefill.tp_size", 0, "prefill.tp_size: Input should be greater than or equal to 1 (got 0)"),
    ("decode.num_workers", 0, "decode.num_workers: Input should be greater than or equal to 1"),
    ("decode.engine.page_sise", 16, "decode.engine.page_sise: unknown field; known: "),
    ("prefill.engine.model_path", "/x", "prefill.engine.model_path: unknown field"),  # the cluster sets it
    ("prefill.engine.mem_fraction_static", 1.5, "prefill.engine.mem_fraction_static: Input should be less than 1"),
    ("decode.engine.attention_backend", "flash", "decode.engine.attention_backend: Input should be 'auto', 'torch' or"),
    ("decode.engine.page_size", 32, "decode.engine.page_size: 32 differs from prefill.engine.page_size 16"),
    ("decode.engine.quantization", "fp8", "decode.engine.quantization: 'fp8' differs from prefill.engine.quantization "
     "None; the decode side goes on from the KV the prefill side's weights computed"),
    ("prefill.engine.speculative_algorithm", "ngram",
     "prefill.engine.speculative_algorithm 'ngram': a prefill worker never decodes"),
    ("decode.engine.speculative_algorithm", "draft_model",
     "decode.engine.speculative_draft_model_path: speculative_draft_model_path is needed"),
    ("decode.engine.pp_size", 0, "decode.engine.pp_size: Input should be greater than or equal to 1"),
    ("prefill.engine.pp_layer_partition", [1, 1],
     "prefill.engine.pp_size: pp_layer_partition has 2 counts for pp_size=1 stages"),
    ("transfer.backend", "nccl",
     "transfer.backend: Input should be 'auto', 'shm', 'cuda_ipc', 'torch_dist' or 'fake' (got 'nccl')"),
    ("transfer.backend", "cuda_ipc", "transfer.backend: cuda_ipc needs device cuda on both sides"),
    ("transfer.data_transport", "rdma", "transfer.data_transport: Input should be 'auto', 'gloo' or 'nccl' (got 'rdma')"),
    ("transfer.data_transport", "nccl", "transfer.data_transport: nccl needs device cuda on both sides"),
    ("transfer.heartbeat_interval_s", 0, "transfer.heartbeat_interval_s: Input should be greater than 0"),
    ("colocate", True, "colocate: unknown field; known: model, prefill, decode, transfer"),
    ("server.port", 70000, "server.port: Input should be less than or equal to 65535"),
    ("router.decode_policy", "least_load", "router.decode_policy: Input should be 'cache_aware'"),
    ("server.tool_call_parser", "qwen3", "server.tool_call_parser: Input should be 'hermes', 'llama3_json', "
     "'mistral', 'pythonic', 'llama4_pythonic', 'qwen3_coder', 'deepseek_v3', 'deepseek_v31' or 'gpt_oss' "
     "(got 'qwen3')"),
    ("decode.num_gpus_per_rank", 1, "decode.num_gpus_per_rank: must be 0 when device is cpu"),
    ("model.model_path", "/ckpt", "model: set exactly one of model_path and builtin"),
    ("model.builtin", "gpt2", "model.builtin: unknown family 'gpt2'; known: llama"),
])
def test_errors_name_the_field(tmp_path, dotted, value, expected):
    assert expected in _load_errors(tmp_path, _set(_base(), dotted, value))


def test_the_builtin_model_may_be_the_tiny_qwen2_5_vl():
    assert parse_config(_set(_base(), "model.builtin", "qwen2_5_vl")).model.name == "tiny-qwen2_5_vl"


def test_data_transport_and_keepalives_reach_the_torch_dist_agents():
    from transfer.backends.dist_data import DATA_TRANSPORTS

    defaults = {"data_transport": "auto", "keepalive_s": 5.0, "keepalive_misses": 3}
    assert parse_config(_base()).transfer.agent_options() == {"torch_dist": defaults}
    config = parse_config(_set(_set(_base(), "transfer.data_transport", "gloo"), "transfer.heartbeat_interval_s", 2))
    assert config.transfer.agent_options() == {"torch_dist": dict(defaults, data_transport="gloo", keepalive_s=2)}
    assert TransferConfig.model_fields["data_transport"].annotation.__args__ == DATA_TRANSPORTS


def test_every_error_is_reported(tmp_path):
    data = _set(_set(_base(), "prefill.tp_size", 0), "server.port", 0)
    message = _load_errors(tmp_path, data)
    assert "prefill.tp_size:" in message and "server.port:" in message


def test_missing_section_and_bad_files(tmp_path):
    data = _base()
    del data["decode"]
    assert "decode: Field required" in _load_errors(tmp_path, data)
    assert "top level must be a mapping" in _load_errors(tmp_path, ["not", "a", "mapping"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefill: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_config(tmp_path / "absent.yaml")


def test_cuda_group_takes_one_gpu_per_rank():
    data = _set(_base(), "decode.device", "cuda")
    _set(data, "decode.tp_size", 4)
    config = parse_config(data)
    assert config.decode.gpus_per_rank == 1.0 and config.prefill.gpus_per_rank == 0.0
    with pytest.raises(ConfigError, match="decode.num_gpus_per_rank: must be > 0 when device is cuda"):
        parse_config(_set(data, "decode.num_gpus_per_rank", 0))


def test_ranks_sharing_a_gpu_need_an_explicit_kv_pool():
    """A fraction of a GPU per rank lets Ray put two ranks on one GPU; each sizes its KV pool from
    the device's free memory (mem_fraction_static of the whole GPU), so the second finds none left
    and fails to start. Refused at load, naming the field that makes sharing work."""
    data = _set(_set(_base(), "decode.device", "cuda"), "decode.num_gpus_per_rank", 0.5)
    _set(data, "decode.engine", {"page_size": 16})
    with pytest.raises(ConfigError, match=r"decode.engine.max_total_tokens: must be set when "
                                          r"decode.num_gpus_per_rank < 1 \(got 0.5\)"):
        parse_config(data)
    _set(data, "decode.engine.max_total_tokens", 4096)
    assert parse_config(data).decode.gpus_per_rank == 0.5
    whole = parse_config(_set(_set(_base(), "prefill.device", "cuda"), "prefill.engine", {"page_size": 16}))
    assert whole.prefill.gpus_per_rank == 1.0 and whole.prefill.engine.max_total_tokens is None


def test_a_mamba_track_interval_that_is_not_a_page_multiple_is_refused_at_load():
    """EngineConfig refuses extra_buffer with a mamba_track_interval that is not a multiple of
    page_size; the YAML's engine section must too, naming the field, rather than pass and have
    every worker actor fail to build its engine once the cluster starts."""
    data = _set(_base(), "decode.engine.mamba_scheduler_strategy", "extra_buffer")
    _set(data, "decode.engine.mamba_track_interval", 24)  # page_size 16 in local_cpu.yaml
    with pytest.raises(ConfigError, match=r"decode.engine.mamba_track_interval: .*multiple of page_size"):
        parse_config(data)
    _set(data, "decode.engine.mamba_track_interval", 32)
    assert parse_config(data).decode.engine.mamba_track_interval == 32


def test_lora_target_modules_agree_and_come_with_a_rank():
    """The layers that take adapters must be the same on both sides (a runtime load fits both or
    neither); with no lora_paths, nothing gives the slots' rank: EngineConfig refuses it, and the
    YAML's engine section too, naming the field."""
    data = _set(_base(), "prefill.engine.lora_target_modules", "all")
    with pytest.raises(ConfigError, match=r"decode.engine.lora_target_modules: None differs from prefill"):
        parse_config(data)
    _set(data, "decode.engine.lora_target_modules", ["all"])
    with pytest.raises(ConfigError, match=r"prefill.engine.max_lora_rank: .*no lora_paths"):
        parse_config(data)
    for side in ("prefill", "decode"):
        _set(data, f"{side}.engine.max_lora_rank", 8)
    assert parse_config(data).decode.engine.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj", "qkv_proj",
                                                                    "gate_up_proj", "q_a_proj", "q_b_proj",
                                                                    "kv_a_proj_with_mqa", "kv_b_proj",
                                                                    "in_proj_qkvz", "in_proj_ba", "out_proj", "w1",
                                                                    "w2", "w3"]


def test_a_cache_aware_policy_without_the_radix_cache_is_refused_at_load():
    """As EngineConfig refuses it, naming the field."""
    data = _set(_set(_base(), "prefill.engine.schedule_policy", "dfs-weight"), "prefill.engine.disable_radix_cache",
                True)
    with pytest.raises(ConfigError, match=r"prefill.engine.schedule_policy: .*disable_radix_cache"):
        parse_config(data)


@pytest.mark.parametrize("field, value", [("enable_priority_scheduling", True),
                                          ("constrained_json_disable_any_whitespace", True),
                                          ("lora_paths", {"sql": "/adapters/sql"}), ("max_lora_rank", 16),
                                          ("max_loaded_loras", 16)])
def test_settings_both_sides_read_a_request_by_must_agree(field, value):
    """A request's priority orders both sides' queues (the server checks it once); a structured-output
    request's first token is sampled on the prefill side under its grammar and the decode side's
    matcher must accept it; a LoRA request's KV is computed under its adapter on the prefill side and
    its tokens on the decode side (and an adapter loaded at runtime must fit both sides' slots). Set on
    one side only, the config is refused naming the field."""
    data = _set(_base(), f"decode.engine.{field}", value)
    with pytest.raises(ConfigError, match=re.escape(f"decode.engine.{field}: {value!r} differs from prefill")):
        parse_config(data)
    _set(data, f"prefill.engine.{field}", value)
    assert getattr(parse_config(data).prefill.engine, field) == value


def test_expert_parallel_may_differ_between_the_sides():
    """Expert parallelism shards a MoE layer's experts, not the KV (the attention stays TP), so a
    prefill side with TP experts and a decode side with EP ones move pages alike."""
    data = _set(_set(_base(), "decode.engine.enable_expert_parallel", True), "decode.tp_size", 2)
    config = parse_config(data)
    assert (config.prefill.engine.enable_expert_parallel, config.decode.engine.enable_expert_parallel) == (False, True)
    assert config.engine_config("decode", model_path="/ckpt").enable_expert_parallel


# --- engine settings ----------------------------------------------------------------------


def test_engine_overrides_mirror_engine_config():
    """Every EngineConfig field but the cluster's and the server's (the engine's own image URL fetching: the server
    fetches a PD worker's, by ServerConfig's fields of the same names)."""
    expected = set(EngineConfig.model_fields) - set(CLUSTER_OWNED_ENGINE_FIELDS) - set(SERVER_OWNED_ENGINE_FIELDS)
    assert set(EngineOverrides.model_fields) == expected
    assert set(SERVER_OWNED_ENGINE_FIELDS) < set(ServerConfig.model_fields)


def test_engine_config_keeps_engine_defaults_for_unset_fields():
    config = load_config(CONFIGS / "local_cpu.yaml")
    assert config.decode.engine_overrides() == {
        "page_size": 16, "max_total_tokens": 8192, "max_running_requests": 32, "attention_backend": "torch",
    }
    engine = config.engine_config("decode", model_path="/ckpt")
    default = EngineConfig(model_path="/ckpt")
    assert (engine.model_path, engine.page_size, engine.max_running_requests) == ("/ckpt", 16, 32)
    assert engine.max_prefill_tokens == default.max_prefill_tokens


def test_with_updates_revalidates():
    config = load_config(CONFIGS / "local_cpu.yaml")
    updated = config.with_updates({"server.port": "9001", "transfer.waiting_timeout_s": 30})
    assert (updated.server.port, updated.transfer.waiting_timeout_s) == (9001, 30.0)
    assert updated.decode.engine_overrides() == config.decode.engine_overrides()
    assert config.server.port == 8000  # the original is frozen and unchanged
    with pytest.raises(ConfigError, match="prefill.tp_size: Input should be greater than or equal to 1"):
        config.with_updates({"prefill.tp_size": 0})


def test_set_overrides_take_null_as_in_the_yaml():
    """``--set key=value`` means ``key: value`` in the file: ``null`` (or ``~``, or nothing) clears an
    optional field, so the model source can switch and a pool sized in the file can go back to
    being sized from memory; other values stay strings for the field's own type to parse."""
    from cluster.launch import parse_overrides

    config = load_config(CONFIGS / "local_cpu.yaml")
    updated = config.with_updates(parse_overrides(
        ["model.builtin=null", "model.model_path=/ckpt", "decode.engine.max_total_tokens=~",
         "prefill.engine.max_total_tokens=", "server.port=9000", "decode.num_cpus_per_rank=0.25",
         "prefill.engine.disable_radix_cache=true", "model.served_model_name=123", "server.api_key=a=b"]))
    assert (updated.model.builtin, updated.model.model_path, updated.model.name) == (None, "/ckpt", "123")
    assert updated.decode.engine.max_total_tokens is None and updated.prefill.engine.max_total_tokens is None
    assert (updated.server.port, updated.decode.num_cpus_per_rank) == (9000, 0.25)
    assert updated.prefill.engine.disable_radix_cache is True
    assert updated.server.api_key.get_secret_value() == "a=b"


def test_api_key_is_not_printed():
    config = parse_config(_set(_base(), "server.api_key", "s3cret"))
    assert config.server.api_key.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(config) and "s3cret" not in str(config.server)


# --- the built-in model ----------------------------------------------------------------------


def test_builtin_model_resolves_to_a_cached_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYDIX_HOME", str(tmp_path))
    config = load_config(CONFIGS / "local_cpu.yaml")
    path = Path(config.model.resolve_model_path())
    assert path.is_relative_to(tmp_path) and (path / "config.json").is_file()
    assert list(path.glob("*.safetensors"))
    built_at = (path / "config.json").stat().st_mtime_ns
    assert Path(config.model.resolve_model_path()) == path  # second call reuses the cache
    assert (path / "config.json").stat().st_mtime_ns == built_at
    assert config.engine_config("prefill").model_path == str(path)
    assert config.model.name == "tiny-llama"


def test_an_interrupted_build_of_the_builtin_model_is_not_taken_for_a_checkpoint(tmp_path, monkeypatch):
    """The first run is stopped (Ctrl-C, a full disk) while it writes the tiny checkpoint: the
    next run builds it again instead of serving a directory with a config.json and no weights."""
    import actors.engine.tiny as tiny
    from cluster.cli import builtin_model

    monkeypatch.setenv("RAYDIX_HOME", str(tmp_path))

    def build(family, out_dir, seed=0, stop=False):
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")  # save_pretrained writes the config first
        if stop:
            raise KeyboardInterrupt
        (out / "model.safetensors").write_text("weights")
        return out

    monkeypatch.setattr(tiny, "build_tiny_checkpoint", lambda *a, **kw: build(*a, stop=True, **kw))
    with pytest.raises(KeyboardInterrupt):
        builtin_model("llama")
    monkeypatch.setattr(tiny, "build_tiny_checkpoint", build)
    path = Path(builtin_model("llama"))
    assert (path / "model.safetensors").is_file()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # nothing half-built left beside it


def test_model_path_resolves_as_given():
    config = parse_config(_set(_set(_base(), "model", {}), "model.model_path", "~/ckpt"))
    assert config.model.resolve_model_path() == str(Path("~/ckpt").expanduser())
    assert config.model.name == "ckpt"


# --- configs/ray_cluster.yaml ---------------------------------------------------------------


def _ray_cluster() -> dict:
    return yaml.safe_load(RAY_CLUSTER_YAML.read_text())


def _prepared(raw: dict) -> dict:
    """What `ray up` checks: the config merged with the provider's defaults, then Ray's validation."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    return config


def test_ray_cluster_yaml_passes_ray_validation():
    config = _prepared(_ray_cluster())
    node_types = config["available_node_types"]
    assert config["head_node_type"] in node_types
    assert node_types["prefill_gpu"]["resources"]["prefill"] >= 1
    assert node_types["decode_gpu"]["resources"]["decode"] >= 1
    for name in ("prefill_gpu", "decode_gpu"):
        assert node_types[name]["resources"]["GPU"] >= 1
    assert "prefill" not in node_types[config["head_node_type"]]["resources"]
    assert any("pip install" in cmd and "raydix" in cmd for cmd in config["setup_commands"])
    assert any("--dashboard-host" in cmd for cmd in config["head_start_ray_commands"])


def test_ray_validation_is_not_vacuous():
    import jsonschema

    raw = _ray_cluster()
    raw["available_node_types"]["prefill_gpu"]["resourcez"] = {"prefill": 1}
    with pytest.raises(jsonschema.ValidationError, match="resourcez"):
        _prepared(raw)


def test_ray_cluster_uses_one_auth_mode_on_every_node():
    config = _ray_cluster()
    start = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    modes = [[part for part in cmd.split() if part.startswith("RAY_AUTH_MODE=")] for cmd in start if "ray start" in cmd]
    assert len(modes) == 2 and all(len(found) == 1 for found in modes)  # head and workers, set once each
    assert len({found[0] for found in modes}) == 1


def test_gpu_example_fits_the_ray_cluster():
    layout = load_config(CONFIGS / "gpu_example.yaml")
    node_types = _ray_cluster()["available_node_types"]
    for role, node_type in (("prefill", "prefill_gpu"), ("decode", "decode_gpu")):
        group, node = layout.group(role), node_types[node_type]
        resource = getattr(layout.placement, f"{role}_resource")
        assert node["resources"][resource] >= layout.placement.resource_per_rank
        gpus_per_worker = group.tp_size * group.gpus_per_rank
        assert gpus_per_worker <= node["resources"]["GPU"]  # one TP group packs on one node
        assert group.num_workers * gpus_per_worker <= node["max_workers"] * node["resources"]["GPU"]


def test_cuda_ranks_see_every_gpu_of_their_node_and_pick_their_own(monkeypatch):
    """CUDA rank actors start with Ray's NOSET flag (every GPU of the node visible, numbered
    alike in every process, so a decode rank's CUDA IPC handles open in a prefill rank on
    another GPU) and take the GPU Ray assigned them by its position among the visible ones."""
    from actors.rank import NOSET_CUDA_VISIBLE_DEVICES, assigned_gpu_index
    from cluster.pd import _actor_options

    gpu = load_config(CONFIGS / "gpu_example.yaml")
    for role in ("prefill", "decode"):
        assert _actor_options(gpu, role)["runtime_env"] == {"env_vars": {NOSET_CUDA_VISIBLE_DEVICES: "1"}}
    assert "runtime_env" not in _actor_options(load_config(CONFIGS / "local_cpu.yaml"), "decode")

    monkeypatch.delenv(NOSET_CUDA_VISIBLE_DEVICES, raising=False)
    assert assigned_gpu_index(["3"]) is None  # Ray isolated the process: its GPU is cuda:0
    monkeypatch.setenv(NOSET_CUDA_VISIBLE_DEVICES, "1")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert assigned_gpu_index(["3"]) == 3 and assigned_gpu_index([]) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the node itself shows a subset
    assert assigned_gpu_index(["6"]) == 2
    with pytest.raises(RuntimeError, match="Ray assigned GPU 1, which CUDA_VISIBLE_DEVICES='4,5,6,7' does not show"):
        assigned_gpu_index(["1"])


# --- starting workers: what a failed start leaves behind (Ray faked, nothing started) ---------


class _FakeRay:
    """The Ray calls ``cluster.pd`` makes to start workers, recorded: ``pg_ready`` False makes a
    placement group never ready (``ray.get`` of it times out); ``fail_class`` makes creating that
    actor class raise."""

    def __init__(self):
        self.pg_ready, self.fail_class = True, None
        self.resources = {"CPU": 64.0, "memory": 1e11}  # ray.cluster_resources()
        self.pgs, self.removed, self.actors, self.killed = [], [], [], []

    def placement_group(self, bundles, strategy):
        pg = ("pg", len(self.pgs))
        self.pgs.append(pg)
        return _Ready(pg)

    def get(self, ref, timeout=None):
        import ray

        if isinstance(ref, tuple) and ref[0] == "ready":
            if not self.pg_ready:
                raise ray.exceptions.GetTimeoutError("placement group not ready")
            return True
        return [None] * len(ref) if isinstance(ref, list) else "tcp://127.0.0.1:1"

    def remote(self, cls):
        fake = self

        class Options:
            def options(self, **options):
                return self

            def remote(self, *args, **kwargs):
                if cls is None:  # the rendezvous task
                    return ("rendezvous",)
                if cls is fake.fail_class:
                    raise RuntimeError(f"cannot create {cls.__name__}")
                handle = _FakeHandle(cls.__name__)
                fake.actors.append(handle)
                return handle

        return Options()


class _Ready:
    def __init__(self, pg):
        self.pg = pg

    def ready(self):
        return ("ready", self.pg)


class _FakeHandle:
    def __init__(self, name):
        self.name = name

    def __getattr__(self, method):
        class Method:
            @staticmethod
            def remote(*args):
                return (method, args)

        return Method()


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    import cluster.pd as pd

    fake = _FakeRay()
    monkeypatch.setattr(pd, "placement_group", fake.placement_group)
    monkeypatch.setattr(pd, "remove_placement_group", lambda pg: fake.removed.append(pg.pg))
    monkeypatch.setattr(pd, "check_tp_shardable", lambda config: None)
    monkeypatch.setattr(pd, "_in_bundle", lambda pg, index: None)
    monkeypatch.setattr(pd, "_rendezvous", fake.remote(None))
    monkeypatch.setattr(ray, "get", fake.get)
    monkeypatch.setattr(ray, "remote", fake.remote)
    monkeypatch.setattr(ray, "kill", lambda handle: fake.killed.append(handle))
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(fake.resources))
    return fake


def _tp2_cluster():
    from cluster.pd import PDCluster

    config = parse_config(_set(_set(_base(), "prefill.tp_size", 2), "decode.tp_size", 2))
    return PDCluster(config, model_path="/nonexistent")


def test_a_placement_group_that_never_fits_is_removed(fake_ray, caplog):
    """Asking for more than the cluster has (say GPUs it lacks): the TP group's placement group
    never becomes ready; start fails, and the pending group goes (left, it would take those
    resources the moment they appear, for no actor). What the cluster lacks is warned of at
    once (the start waits it out, for an autoscaler) and named in the error; the wait used
    to be silent for 300 s and end in a bare GetTimeoutError."""
    from cluster.pd import WorkerStartError

    fake_ray.pg_ready = False
    fake_ray.resources = {"CPU": 1.0}
    cluster = _tp2_cluster()
    with caplog.at_level("WARNING", logger="cluster.pd"):
        with pytest.raises(WorkerStartError, match=r"prefill-0-\w+: no room for its 2 ranks .*the cluster lacks CPU"):
            cluster.start(timeout_s=5)
    assert "waiting up to 5s" in caplog.text and "(the cluster has 1)" in caplog.text
    assert fake_ray.pgs and sorted(fake_ray.removed) == sorted(fake_ray.pgs)
    with pytest.raises(WorkerStartError):
        cluster.add_worker("decode")
    assert sorted(fake_ray.removed) == sorted(fake_ray.pgs)
    assert (cluster.prefill, cluster.decode) == ([], [])


def test_a_tp_size_that_cannot_shard_the_model_fails_before_any_actor_starts(fake_ray, monkeypatch):
    """Both sides' TP sizes are checked first: a decode TP size that does not divide the model's
    heads used to be found only once every prefill worker had started."""
    import cluster.pd as pd
    from cluster.pd import PDCluster

    def shardable(config):
        if config.tp_size == 4:
            raise ValueError("tp_size 4 must divide num_key_value_heads 2")

    monkeypatch.setattr(pd, "check_tp_shardable", shardable)
    config = parse_config(_set(_set(_base(), "prefill.tp_size", 2), "decode.tp_size", 4))
    with pytest.raises(ValueError, match="must divide"):
        PDCluster(config, model_path="/nonexistent").start()
    assert (fake_ray.actors, fake_ray.pgs) == ([], [])


def test_a_worker_whose_follower_cannot_be_created_leaves_nothing(fake_ray):
    """Rank 0 is created, creating rank 1 raises: rank 0's actor is killed and the group removed."""
    from cluster.pd import PDCluster

    fake_ray.fail_class = PDCluster.follower_cls
    cluster = _tp2_cluster()
    with pytest.raises(RuntimeError, match="cannot create"):
        cluster.start()
    assert fake_ray.actors and fake_ray.killed == fake_ray.actors
    assert fake_ray.pgs and fake_ray.removed == fake_ray.pgs


def test_an_interrupted_start_stops_every_worker_started(fake_ray, monkeypatch):
    """Ctrl-C (or any BaseException) while waiting for the workers: they are stopped all the same."""
    import cluster.pd as pd

    def interrupted(workers, timeout_s, lacks=""):
        raise KeyboardInterrupt

    monkeypatch.setattr(pd, "_await_started", interrupted)
    cluster = _tp2_cluster()
    with pytest.raises(KeyboardInterrupt):
        cluster.start()
    assert len(fake_ray.actors) == 4 and sorted(fake_ray.killed, key=id) == sorted(fake_ray.actors, key=id)
    assert len(fake_ray.pgs) == 2 and sorted(fake_ray.removed) == sorted(fake_ray.pgs)
    assert (cluster.prefill, cluster.decode) == ([], [])
    with pytest.raises(KeyboardInterrupt):
        cluster.add_worker("prefill")
    assert len(fake_ray.actors) == 6 and len(fake_ray.killed) == 6 and len(fake_ray.removed) == 3


def test_removing_a_worker_twice_at_once_is_a_missing_worker_the_second_time(fake_ray):
    """DELETE /workers/{id} retried while the first call drains the worker (drains take up to two
    minutes; clients time out and retry): the second call finds no such worker (KeyError: a 404)
    instead of draining it again and failing on the list (a 500), and an unknown id is a KeyError
    too (StopIteration cannot cross asyncio.to_thread: it became a TypeError)."""
    from cluster.backend import UnknownWorkerError
    from cluster.pd import PDCluster, WorkerRef

    cluster = PDCluster(parse_config(_base()), model_path="/nonexistent")
    worker = WorkerRef("decode-0-abc", "decode", _FakeHandle("DecodeWorker"), node_id="n")
    cluster.decode.append(worker)
    again = []
    drain = fake_ray.get

    def get(ref, timeout=None):
        if isinstance(ref, tuple) and ref[0] == "drain" and not again:
            with pytest.raises(UnknownWorkerError):
                again.append(cluster.remove_worker("decode-0-abc"))
        return drain(ref, timeout)

    import ray

    ray.get = get  # (fake_ray restores the real one)
    assert cluster.remove_worker("decode-0-abc") is worker
    assert cluster.decode == [] and fake_ray.killed == [worker.handle]
    with pytest.raises(UnknownWorkerError):
        cluster.remove_worker("decode-0-abc")


def test_router_max_retries_reaches_the_client_and_the_router_settings():
    from cluster.pd import PDCluster, router_settings

    data = _base()
    data["router"] = dict(data.get("router") or {}, max_retries=0)
    config = parse_config(data)
    assert PDCluster(config, model_path="/nonexistent").client().max_retries == 0
    assert router_settings(config).max_retries == 0
    assert PDCluster(parse_config(_base()), model_path="/nonexistent").client().max_retries == 2
    with pytest.raises(ConfigError):
        parse_config(dict(data, router={"max_retries": -1}))
