"""resolve_config(): SMP v2 and accelerate configs resolve to the same ParallelConfig as the
equivalent keywords; bad keys, conflicts and unsupported values fail clearly. Single
process, no process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from tpcompile.config import (
    ACCELERATE_KEYS,
    SMP_KEYS,
    CheckpointKind,
    NoEffect,
    ParallelConfig,
    Sharding,
    resolve_config,
)
from tpcompile.errors import TPError

CONFIG_DOCS = Path(__file__).resolve().parent.parent / "docs" / "integrations.md"

ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_cpu_ram_efficient_loading: true
  fsdp_sync_module_states: true
  fsdp_offload_params: true
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_use_orig_params: true
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
parallelism_config:
  parallelism_config_dp_replicate_size: 2
  parallelism_config_dp_shard_size: 2
  parallelism_config_tp_size: 2
  parallelism_config_cp_size: 1
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_smp_config_equals_keywords() -> None:
    smp = {"tensor_parallel_degree": 2, "hybrid_shard_degree": 2, "sm_activation_offloading": True,
           "activation_loading_horizon": 3, "random_seed": 7, "expert_parallel_degree": 1,
           "context_parallel_degree": 1, "allow_empty_shards": True}
    got = resolve_config(smp, world_size=8)
    want = resolve_config(tp=2, dp_shard=2, dp_replicate=2, activation_offloading=True,
                          loading_horizon=3, seed=7, world_size=8)
    assert got == want
    assert got.mesh_shape == (2, 2, 2) and got.sharding_strategy is Sharding.HYBRID_SHARD
    assert got.source == "smp" and got.no_effect == ("allow_empty_shards",)
    nested = {"smdistributed": {"modelparallel": {"enabled": True, "parameters": smp}}}
    assert resolve_config(nested, world_size=8) == got


@pytest.mark.parametrize(("degree", "shape", "strategy"), [
    (0, (1, 4, 2), "FULL_SHARD"),  # the largest degree tp allows
    (1, (4, 1, 2), "NO_SHARD"),  # replicate only
    (4, (1, 4, 2), "FULL_SHARD"),  # all dp ranks: no replica left
    (2, (2, 2, 2), "HYBRID_SHARD"),
])
def test_smp_hybrid_shard_degree(degree: int, shape: tuple, strategy: str) -> None:
    cfg = resolve_config({"tensor_parallel_degree": 2, "hybrid_shard_degree": degree}, world_size=8)
    assert (cfg.mesh_shape, cfg.sharding_strategy.value) == (shape, strategy)


def test_smp_keeps_a_zero2_strategy() -> None:
    cfg = resolve_config({"hybrid_shard_degree": 2}, sharding_strategy="SHARD_GRAD_OP", world_size=8)
    assert cfg.sharding_strategy is Sharding.HYBRID_SHARD_ZERO2 and not cfg.reshard_after_forward


def test_accelerate_yaml_equals_keywords(tmp_path: Path) -> None:
    path = tmp_path / "accelerate.yaml"
    path.write_text(ACCELERATE_YAML)
    got = resolve_config(str(path), world_size=8)
    want = resolve_config(tp=2, dp_shard=2, dp_replicate=2, sharding_strategy="HYBRID_SHARD_ZERO2",
                          mixed_precision="bf16", cpu_offload=True, activation_checkpointing=True,
                          checkpoint="full", load_from_rank0=True, wrap_classes=("LlamaDecoderLayer",),
                          num_processes=8, world_size=8)
    assert got == want and got.source == "accelerate"
    assert got.mixed_precision == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert {"compute_environment", "fsdp_use_orig_params", "tpu_env"} <= set(got.no_effect)
    with pytest.raises(TPError, match="num_processes=8 but the world has 4"):
        resolve_config(str(path), world_size=4)


@pytest.mark.parametrize(("value", "strategy"), [
    (1, "FULL_SHARD"), (2, "SHARD_GRAD_OP"), ("3", "NO_SHARD"), (4, "HYBRID_SHARD"),
    ("5", "HYBRID_SHARD_ZERO2"), ("_HYBRID_SHARD_ZERO2", "HYBRID_SHARD_ZERO2"), ("shard_grad_op", "SHARD_GRAD_OP"),
])
def test_accelerate_sharding_strategy_names_and_legacy_ints(value: object, strategy: str) -> None:
    cfg = resolve_config({"fsdp_sharding_strategy": value}, dp_replicate=2, world_size=2)
    assert cfg.sharding_strategy.value == strategy.replace("FULL_SHARD", "HYBRID_SHARD").replace(
        "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2")  # a replicate dim makes sharded strategies hybrid


def test_accelerate_fsdp1_reshard_names_and_bools() -> None:
    assert resolve_config({"fsdp_reshard_after_forward": "SHARD_GRAD_OP"}).sharding_strategy is Sharding.SHARD_GRAD_OP
    assert resolve_config({"fsdp_reshard_after_forward": "false"}).sharding_strategy is Sharding.SHARD_GRAD_OP
    cfg = resolve_config({"fsdp_reshard_after_forward": True}, sharding_strategy="HYBRID_SHARD")
    assert cfg.sharding_strategy is Sharding.HYBRID_SHARD


def test_json_string_and_file(tmp_path: Path) -> None:
    text = json.dumps({"tensor_parallel_degree": 2})
    path = tmp_path / "smp.json"
    path.write_text(text)
    assert resolve_config(text, world_size=4) == resolve_config(path, world_size=4) == resolve_config(tp=2, world_size=4)


def test_native_dict_and_mixed_precision_forms() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert resolve_config({"tp": 2, "mixed_precision": "bf16"}) == resolve_config(tp=2, mixed_precision=torch.bfloat16)
    assert resolve_config(mixed_precision=policy).mixed_precision == policy
    assert resolve_config(mixed_precision="no").mixed_precision is None
    assert resolve_config({"fsdp_state_dict_type": "SHARDED_STATE_DICT"}).checkpoint is CheckpointKind.SHARDED


@pytest.mark.parametrize(("shape", "kwargs"), [
    ((1, 4, 1), {}),
    ((1, 2, 2), {"tp": 2}),
    ((2, 2, 1), {"dp_replicate": 2}),
    ((2, 2, 1), {"dp_shard": 2, "dp_replicate": -1}),
    ((4, 1, 1), {"sharding_strategy": "NO_SHARD"}),
])
def test_mesh_shapes(shape: tuple, kwargs: dict) -> None:
    assert resolve_config(world_size=4, **kwargs).mesh_shape == shape


def test_hybrid_shards_within_a_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(TPError, match="pass dp_replicate=N"):
        resolve_config(sharding_strategy="HYBRID_SHARD", world_size=8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    # a node of 4 ranks holds 2 TP groups: shard over those 2, replicate across the 2 nodes
    assert resolve_config(sharding_strategy="HYBRID_SHARD", tp=2, world_size=8).mesh_shape == (2, 2, 2)


@pytest.mark.parametrize(("config", "kwargs", "match"), [
    ({"tensor_paralel_degree": 2}, {}, r"tensor_paralel_degree.*did you mean \['tensor_parallel_degree'"),
    ({"tensor_parallel_degree": 2, "hybrid_shard_degre": 2}, {}, r"unknown smp config key 'hybrid_shard_degre'.*"
                                                                  r"did you mean \['hybrid_shard_degree'\].*Supported"),
    ({"fsdp_offload_param": True}, {}, r"did you mean \['fsdp_offload_params'"),
    ({"delayed_param_initialization": True}, {}, "DelayedParamIniter"),
    ({"tensor_parallel_degree": 2}, {"tp": 4}, "tp=4 conflicts with the config's 'tensor_parallel_degree'"),
    ({"fsdp_sharding_strategy": "NO_SHARD"}, {"sharding_strategy": "FULL_SHARD"}, "conflicts"),
    ({"tensor_parallel_degree": 2, "fsdp_offload_params": True}, {}, r"mixes smp keys with accelerate keys"),
    ({"fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": False}, {}, "disagree"),
    ({"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_reshard_after_forward": False}, {}, "contradicts"),
    ({"context_parallel_degree": 3}, {}, "not divisible by tp=1 x cp=3"),
    ({"parallelism_config": {"parallelism_config_cp_size": 3}}, {}, "cp=3"),
    ({"distributed_type": "FSDP", "mixed_precision": "fp8", "fp8_config": {"backend": "TE"}}, {},
     "backend 'TE' is not supported"),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, {}, "SIZE_BASED_WRAP are not supported"),
    ({"fsdp_state_dict_type": "NO_STATE_DICT"}, {}, r"expected one of \['FULL_STATE_DICT', 'LOCAL"),
    ({"fsdp_backward_prefetch_policy": "SOMETIMES"}, {}, "BACKWARD_PRE"),
    ({"tensor_parallel_seed": "zero"}, {}, "tensor_parallel_seed.*expected an integer"),
    ({"fsdp_sharding_strategy": 7}, {}, "unknown sharding strategy 7"),
    ({"fsdp_backward_prefetch": "SOMETIMES"}, {}, "BACKWARD_PRE"),
    ({"distributed_type": "DEEPSPEED"}, {}, "use distributed_type: FSDP"),
    ({"mixed_precision": "fp8"}, {}, "FP8 matmuls are fp8=True"),
    ({"fp8": "int8"}, {}, "fp8 must be True"),
    ({"deepspeed_config": {"zero_stage": 3}}, {}, "deepspeed_config is not supported"),
    ({"smdistributed": {"modelparallel": {"enabled": False}}}, {}, "turns SMP off"),
    ({"tensor_parallel_degree": 3}, {}, r"not divisible by tp=3; tp values that work: \[1, 2, 4\]"),
    (None, {"sharding_strategy": "NO_SHARD", "dp_shard": 2}, "dp_shard must be 1"),
    (None, {"dp_shard": 3}, "3 x cp=1 x tp=1 = 3 ranks, but the world has 4"),
    (None, {"dp_shard": -1, "dp_replicate": -1}, "only one of dp_shard and dp_replicate"),
    (None, {"tpp": 2}, r"unknown keyword 'tpp'; did you mean \['tp'"),
    (None, {"loading_horizon": 0}, "loading_horizon must be an integer >= 1"),
    ("not/a/file.yaml", {}, "does not exist"),
])
def test_clear_errors(config: object, kwargs: dict, match: str) -> None:
    with pytest.raises(TPError, match=match):
        resolve_config(config, world_size=4, **kwargs)


def test_no_effect_keys_are_explained_in_code_and_docs() -> None:
    docs = CONFIG_DOCS.read_text()
    section = docs[docs.index("## Configs"):]
    for table in (SMP_KEYS, ACCELERATE_KEYS):
        for key, rule in table.items():
            assert f"`{key}`" in section, f"docs/integrations.md's Configs section does not list {key}"
            if isinstance(rule, NoEffect):
                assert len(rule.reason) > 20, key


def test_parallel_config_is_frozen_and_validated() -> None:
    cfg = ParallelConfig(tp=2)
    with pytest.raises(AttributeError):
        cfg.tp = 4  # type: ignore[misc]
    with pytest.raises(TPError, match="tp must be an integer >= 1"):
        ParallelConfig(tp=0)
    with pytest.raises(TPError, match="mesh is not resolved"):
        _ = cfg.mesh_shape


# ---- the four configs as accelerate's and SMP v2's documentation publish them -------

# accelerate's FSDP guide, `accelerate config` output for FSDP1 (BERT), verbatim
ACCELERATE_DOCS_FSDP1 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch_policy: BACKWARD_PRE
  fsdp_forward_prefetch: false
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_sharding_strategy: FULL_SHARD
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: BertLayer
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# accelerate's FSDP2 example config (fsdp_version: 2, reshard as a bool)
ACCELERATE_DOCS_FSDP2 = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

# SMP v2's tensor-parallelism page: the HyperPod / flat JSON
SMP_DOCS_TP = {"tensor_parallel_degree": 8, "tensor_parallel_seed": 0}

# SMP v2's SageMaker Python SDK form: distribution= of a PyTorch estimator
SMP_DOCS_SDK = {
    "torch_distributed": {"enabled": True},
    "smdistributed": {"modelparallel": {"enabled": True, "parameters": {
        "hybrid_shard_degree": 16,
        "sm_activation_offloading": True,
        "activation_loading_horizon": 4,
        "fsdp_cache_flush_warnings": False,
        "allow_empty_shards": True,
        "tensor_parallel_degree": 8,
        "tensor_parallel_seed": 0,
        "expert_parallel_degree": 1,
        "context_parallel_degree": 1,
        "random_seed": 12345,
    }}},
}


def test_published_configs_resolve_to_their_layouts(tmp_path: Path) -> None:
    path = tmp_path / "fsdp1.yaml"
    path.write_text(ACCELERATE_DOCS_FSDP1)
    cfg = resolve_config(str(path), world_size=2)
    assert cfg == resolve_config(dp_shard=2, mixed_precision="bf16", checkpoint="sharded", load_from_rank0=True,
                                 wrap_classes=("BertLayer",), num_processes=2, world_size=2)
    assert cfg.mesh_shape == (1, 2, 1) and cfg.sharding_strategy is Sharding.FULL_SHARD
    assert {"fsdp_backward_prefetch_policy", "fsdp_use_orig_params", "fsdp_forward_prefetch"} <= set(cfg.no_effect)

    path = tmp_path / "fsdp2.yaml"
    path.write_text(ACCELERATE_DOCS_FSDP2)
    cfg = resolve_config(str(path), world_size=8)
    assert cfg.mesh_shape == (1, 8, 1) and cfg.sharding_strategy is Sharding.FULL_SHARD
    assert cfg.load_from_rank0 and cfg.checkpoint is CheckpointKind.SHARDED and not cfg.activation_checkpointing

    cfg = resolve_config(SMP_DOCS_TP, world_size=16)
    assert cfg.mesh_shape == (1, 2, 8) and cfg.source == "smp" and cfg.no_effect == ("tensor_parallel_seed",)

    cfg = resolve_config(SMP_DOCS_SDK, world_size=256)  # 32 nodes x 8 GPUs
    assert cfg.mesh_shape == (2, 16, 8) and cfg.sharding_strategy is Sharding.HYBRID_SHARD
    assert (cfg.activation_offloading, cfg.loading_horizon, cfg.seed) == (True, 4, 12345)
    flat = SMP_DOCS_SDK["smdistributed"]["modelparallel"]["parameters"]
    assert resolve_config(flat, world_size=256) == cfg


def test_context_and_fp8_keys() -> None:
    """SMP's context_parallel_degree and accelerate's cp_size are cp; accelerate's fp8 with
    the torchao backend is fp8=True."""
    assert resolve_config({"tensor_parallel_degree": 2, "context_parallel_degree": 2}, world_size=8).cp == 2
    cfg = resolve_config({"parallelism_config": {"parallelism_config_cp_size": 2}}, world_size=4)
    assert (cfg.cp, cfg.dp_shard) == (2, 2)
    acc = resolve_config({"distributed_type": "FSDP", "mixed_precision": "fp8", "fp8_config": {"backend": "AO"}},
                         world_size=2)
    assert acc.fp8 is True and acc.mixed_precision is None
    assert resolve_config({"fp8": "tensorwise"}, world_size=2).fp8 == "tensorwise"


def test_accelerate_old_and_new_prefetch_spellings() -> None:
    old = resolve_config({"fsdp_backward_prefetch_policy": "BACKWARD_POST"})
    new = resolve_config({"fsdp_backward_prefetch": "BACKWARD_POST"})
    assert old == new and old.no_effect == ("fsdp_backward_prefetch_policy",)
    assert resolve_config({"fsdp_state_dict_type": "LOCAL_STATE_DICT"}).checkpoint is CheckpointKind.LOCAL
