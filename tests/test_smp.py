"""tpcompile.smp: an SMP v2 training script with only its imports changed, over real gloo
process groups (world 4 = dp 2 x tp 2, then world 2 = dp 1 x tp 2).

The script follows SMP v2's documentation: rank 0 loads the weights, the other ranks
build under ``accelerate.init_empty_weights()``, ``tsm.transform(...,
load_state_dict_from_rank0=True)``, delayed init, PyTorch FSDP1, AdamW; SM_LOCAL async
checkpoints over replication groups, FSDP SHARDED_STATE_DICT checkpoints reloaded at
another dp degree, and a Hugging Face export with translate_on_save.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist import global_step, run_distributed

from tpcompile.tools.presets import tiny_config

REL = 1e-4
RESUME_REL = 1e-5  # the losses after a resume, where a lost optimizer moment shows
LR = 1e-2


def _build(real: bool, seed: int = 0) -> torch.nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if real:
        return AutoModelForCausalLM.from_config(tiny_config("llama"))
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(tiny_config("llama"))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 9), generator=g) for _ in range(5)]


PROBE = torch.arange(18).reshape(2, 9) * 7 % 256


@functools.cache
def _uninterrupted(forget_momentum_at: int = -1) -> tuple[float, ...]:
    """One process's losses; ``forget_momentum_at``: zero AdamW's exp_avg before that step
    (what a resume that lost the optimizer's first moment would do)."""
    model = _build(True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = []
    for i, ids in enumerate(_batches()):
        if i == forget_momentum_at:
            for s in opt.state.values():
                s["exp_avg"].zero_()
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return tuple(out)


# ---- the SMP v2 script; only the imports differ from torch.sagemaker --------------


def _smp_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import tpcompile.smp as tsm
    from tpcompile.smp.delayed_param import DelayedParamIniter

    model = _build(dist.get_rank() == 0, seed)  # rank 0 holds the weights, others are empty
    model = tsm.transform(model, load_state_dict_from_rank0=True)
    initer = DelayedParamIniter(model) if dist.get_rank() != 0 else None
    with initer.validate_params_and_buffers_inited() if initer else contextlib.nullcontext():
        model = FSDP(
            model,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                               transformer_layer_cls={LlamaDecoderLayer}),
            sync_module_states=True,
            param_init_fn=initer.get_param_init_fn() if initer else None,
            use_orig_params=True,
            device_id=torch.device("cpu"),                  # GPU scripts: the current device
            process_group=tsm.state.fsdp_process_group,      # the one line SMP does not need
        )
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    import tpcompile.smp as tsm

    local = ids.chunk(tsm.state.dp_size)[tsm.state.dp_rank]
    loss = model(local, labels=local).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # TP ranks agree; the mean over dp ranks is the global loss
    return mean.item() / dist.get_world_size()


def _rep_group() -> tuple[object, int]:
    import tpcompile.smp as tsm

    mine = None
    for ranks in tsm.state.ranker.get_rep_groups():  # as SMP's docs do it
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine, coordinator = group, min(ranks)
    return mine, coordinator


def _local_dir(root: Path, model: torch.nn.Module) -> Path:
    import tpcompile.smp as tsm

    return root / "local" / f"tp{tsm.state.tp_rank}_ep{tsm.state.ep_rank}_fsdp{model.rank}"


def _lift_cpu_sync_guard() -> None:
    # FSDP1 refuses sync_module_states=True for CPU tensors (it assumes NCCL); the broadcast
    # itself runs on gloo, so the test lifts that one device check and runs it for real
    import torch.distributed.fsdp._init_utils as init_utils

    init_utils._check_module_states_for_sync_module_states = lambda states: None


def _world4(rank: int, world: int, root: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from transformers import AutoModelForCausalLM

    import tpcompile.smp as tsm
    from tpcompile.smp.distributed.checkpoint.filesystem import DistributedFileSystemReader
    from tpcompile.smp.distributed.checkpoint.state_dict_loader import load
    from tpcompile.smp.distributed.checkpoint.state_dict_saver import (
        async_save,
        maybe_finalize_async_calls,
    )
    from tpcompile.smp.distributed.checkpoint.state_dict_utils import (
        FullStateDictConfig,
        SMStateDictType,
        init_optim_state,
        sm_state_dict_type,
    )
    from tpcompile.smp.utils.process_group_utils import get_global_ranks

    _lift_cpu_sync_guard()
    root = Path(root)
    tsm.init({"tensor_parallel_degree": 2, "hybrid_shard_degree": 0})
    out: dict = {"state": (tsm.state.rank, tsm.state.world_size, tsm.state.tp_rank, tsm.state.tp_size,
                           tsm.state.ep_rank, tsm.state.dp_rank, tsm.state.dp_size),
                 "rep_groups": tsm.state.ranker.get_rep_groups()}
    model, opt = _smp_model(seed=0)
    batches = _batches()
    out["losses"] = [_step(model, opt, b) for b in batches[:3]]

    # SM_LOCAL async checkpoint over the replication group
    group, coordinator = _rep_group()
    maybe_finalize_async_calls(blocking=True, process_group=group)
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        async_save(state_dict, checkpoint_id=_local_dir(root, model), process_group=group,
                   coordinator_rank=coordinator)
    saved_optim = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    # FSDP SHARDED_STATE_DICT over this TP rank's data-parallel group, one directory per TP rank
    dp_group = tsm.state.dp_process_group
    with sm_state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt)}
        async_save(state_dict, checkpoint_id=root / "sharded" / f"tp{tsm.state.tp_rank}",
                   process_group=dp_group, coordinator_rank=min(get_global_ranks(dp_group)))
    # full model, translated back to Hugging Face names and layouts
    with sm_state_dict_type(model, StateDictType.FULL_STATE_DICT,
                            FullStateDictConfig(rank0_only=True, offload_to_cpu=True, translate_on_save=True)):
        hf = model.state_dict()
    if rank == 0:
        AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(root / "hf", state_dict=hf)
    with torch.no_grad():
        out["logits"] = model(PROBE).logits
    out["after"] = [_step(model, opt, b) for b in batches[3:]]  # trains on while the saves write
    maybe_finalize_async_calls(blocking=True, process_group=group)

    # resume from the SM_LOCAL checkpoint into a fresh model (other weights on rank 0)
    model, opt = _smp_model(seed=1)
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        state_dict = {"model": model.state_dict()}
        init_optim_state(opt, skip_empty_param=True)
        state_dict["optimizer"] = opt.state_dict()
        load(state_dict, storage_reader=DistributedFileSystemReader(_local_dir(root, model)),
             process_group=group, coordinator_rank=coordinator)
    loaded = opt.state_dict()["state"]
    out["optim_equal"] = sorted(loaded) == sorted(saved_optim) and all(
        torch.equal(loaded[i][k], v) for i, s in saved_optim.items() for k, v in s.items())
    out["local_resumed"] = [_step(model, opt, b) for b in batches[3:]]
    return out


def _world2(rank: int, world: int, root: str) -> dict:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType

    import tpcompile.smp as tsm
    from tpcompile.errors import TPError
    from tpcompile.smp.distributed.checkpoint.state_dict_loader import load
    from tpcompile.smp.distributed.checkpoint.state_dict_utils import (
        SMStateDictType,
        init_optim_state,
        sm_state_dict_type,
    )
    from tpcompile.smp.utils.process_group_utils import get_global_ranks

    _lift_cpu_sync_guard()
    root = Path(root)
    tsm.init({"tensor_parallel_degree": 2})  # dp 1 x tp 2
    model, opt = _smp_model(seed=1)
    dp_group = tsm.state.dp_process_group
    init_optim_state(opt)
    with sm_state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, opt)}
        load(state_dict, checkpoint_id=root / "sharded" / f"tp{tsm.state.tp_rank}", process_group=dp_group,
             coordinator_rank=min(get_global_ranks(dp_group)))
        model.load_state_dict(state_dict["model"])
        opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, state_dict["optimizer"]))
    out = {"sharded_resumed": [_step(model, opt, b) for b in _batches()[3:]]}
    try:  # a local checkpoint of world 4 at world 2
        with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
            load({"model": model.state_dict()}, checkpoint_id=root / "local" / f"tp{tsm.state.tp_rank}_ep0_fsdp0")
        out["local_error"] = None
    except TPError as err:
        out["local_error"] = str(err)
    out["delayed_equal"] = _delayed_init_matches_parallelize()
    # the FSDP2 road: the untransformed model and the same SMP config to parallelize
    import tpcompile

    fsdp2 = tpcompile.parallelize(_build(True), config={"tensor_parallel_degree": 2})
    out["fsdp2_loss"] = global_step(fsdp2, torch.optim.AdamW(fsdp2.parameters(), lr=LR), _batches()[0])
    return out


def _delayed_init_matches_parallelize() -> bool:
    """Every rank builds on meta (no rank-0 weights): DelayedParamIniter fills the tensors
    as FSDP1 wraps them. Their HF values must be parallelize's delayed init (same seed)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import tpcompile
    import tpcompile.smp as tsm
    from tpcompile.smp.core import DEFAULT_SEED
    from tpcompile.smp.delayed_param import DelayedParamIniter
    from tpcompile.smp.distributed.checkpoint.state_dict_utils import sm_state_dict_type

    model = tsm.transform(_build(False))
    initer = DelayedParamIniter(model)
    with initer.validate_params_and_buffers_inited():
        model = FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                               transformer_layer_cls={LlamaDecoderLayer}),
                     param_init_fn=initer.get_param_init_fn(), use_orig_params=True,
                     device_id=torch.device("cpu"), process_group=tsm.state.fsdp_process_group)
    with sm_state_dict_type(model, StateDictType.FULL_STATE_DICT):  # translate_on_save by default
        got = model.state_dict()
    want = tpcompile.hf_state_dict(tpcompile.parallelize(_build(False), tp=2, seed=DEFAULT_SEED))
    if dist.get_rank() != 0:
        return True
    return len(want) > 10 and sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.slow
def test_smp_script_trains_checkpoints_and_exports(tmp_path: Path) -> None:
    want = _uninterrupted()
    results = run_distributed(_world4, 4, str(tmp_path), fresh=True)  # smp.init: once per process
    first = results[0]
    assert [r["state"] for r in results] == [(r, 4, r % 2, 2, 0, r // 2, 2) for r in range(4)]
    assert first["rep_groups"] == [[0], [1], [2], [3]]  # no replicas when every dp rank shards
    torch.testing.assert_close(torch.tensor(first["losses"]), torch.tensor(want[:3]), rtol=REL, atol=0)
    # two steps after the checkpoint: the second one's loss depends on the restored optimizer
    assert first["after"] == pytest.approx(want[3:], rel=REL)
    lost = _uninterrupted(forget_momentum_at=3)  # the test would see a lost first moment
    assert abs(lost[4] - want[4]) > 20 * RESUME_REL * want[4]
    for r in results:
        assert r["optim_equal"]
        assert r["local_resumed"] == pytest.approx(first["after"], rel=RESUME_REL)

    second = run_distributed(_world2, 2, str(tmp_path), fresh=True)
    for r in second:
        assert r["delayed_equal"]
        assert r["fsdp2_loss"] == pytest.approx(want[0], rel=REL)
        assert r["sharded_resumed"] == pytest.approx(first["after"], rel=RESUME_REL), (r, first["after"])
        assert "world=4" in r["local_error"] and "world=2" in r["local_error"], r["local_error"]

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(hf(PROBE).logits, first["logits"], rtol=1e-5, atol=1e-5)


SURFACE = {
    "tpcompile.smp": ["Ranker", "State", "init", "state", "transform"],
    "tpcompile.smp.delayed_param": ["DelayedParamIniter"],
    "tpcompile.smp.distributed.checkpoint.state_dict_utils": [
        "FullStateDictConfig", "LocalStateDict", "SMStateDictType", "init_optim_state", "sm_state_dict_type"],
    "tpcompile.smp.distributed.checkpoint.state_dict_saver": [
        "LAYOUT_FILE", "async_save", "maybe_finalize_async_calls", "save"],
    "tpcompile.smp.distributed.checkpoint.state_dict_loader": ["load"],
    "tpcompile.smp.distributed.checkpoint.filesystem": ["DistributedFileSystemReader", "DistributedFileSystemWriter"],
    "tpcompile.smp.utils.process_group_utils": ["get_global_ranks"],
}


def test_smp_surface_is_frozen() -> None:
    import importlib

    for name, names in SURFACE.items():
        module = importlib.import_module(name)
        assert sorted(module.__all__) == names, name
        assert all(hasattr(module, n) for n in names), name
    from tpcompile.smp.delayed_param import DelayedParamIniter
    from tpcompile.smp.distributed.checkpoint.state_dict_utils import SMStateDictType

    assert SMStateDictType.SM_LOCAL_STATE_DICT
    for method in ("get_param_init_fn", "get_post_param_init_fn", "validate_params_and_buffers_inited"):
        assert callable(getattr(DelayedParamIniter, method))


def test_smp_state_before_init_is_a_clear_error() -> None:
    from tpcompile.errors import TPError
    from tpcompile.smp import State

    with pytest.raises(TPError, match=r"call tsm.init\(config\) first"):
        _ = State().tp_rank


def test_smp_config_from_the_sagemaker_env(monkeypatch: pytest.MonkeyPatch) -> None:
    from tpcompile.config import resolve_config
    from tpcompile.errors import TPError
    from tpcompile.smp.core import SAGEMAKER_ENV, _read_config

    monkeypatch.setenv(SAGEMAKER_ENV, '{"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}')
    assert resolve_config(_read_config(None), world_size=8).mesh_shape == (2, 2, 2)
    assert _read_config({"tensor_parallel_degree": 4}) == {"tensor_parallel_degree": 4}  # explicit wins
    monkeypatch.setenv(SAGEMAKER_ENV, "{not json")
    with pytest.raises(TPError, match="SM_HP_MP_PARAMETERS is not valid JSON"):
        _read_config(None)
    monkeypatch.delenv(SAGEMAKER_ENV)
    assert _read_config(None) is None  # SMP's defaults
