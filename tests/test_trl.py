"""TRL's trainers on a transformed model, with no tpcompile lines in the training code.

Over gloo, against the same trainer in one process (fp32, same seeds, rel 1e-4):

* ``SFTTrainer`` on ``transform(model, tp=2)``: plain, and with ``peft_config`` (LoRA
  added by the trainer after transform, planned on the fly); the logged ``num_tokens``
  counts each sample once (not once per TP rank);
* ``SFTTrainer`` on ``parallelize(model, tp=2)`` in a world of 4 (dp_shard 2 x tp 2),
  plain and with ``peft_config``;
* ``DPOTrainer`` with a LoRA policy (the reference is the policy with its adapters
  disabled) at tp=2, 3 steps.

The data is a tiny word-level tokenizer built in memory and random token sequences.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
from dist import run_cases

pytest.importorskip("trl")
pytest.importorskip("peft")

REL = 1e-4
STEPS = 3


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(250)}
    vocab.update({"<pad>": 250, "<eos>": 251, "<bos>": 252, "<unk>": 253})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def _sequences() -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 12, (16,), generator=g)
    return Dataset.from_list([{"input_ids": torch.randint(0, 250, (int(n),), generator=g).tolist()}
                              for n in lengths])


def _preferences() -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(4)

    def text(n: int) -> str:
        return " ".join(f"t{int(i)}" for i in torch.randint(0, 250, (n,), generator=g))
    return Dataset.from_list([{"prompt": text(4), "chosen": " " + text(3), "rejected": " " + text(3)}
                              for _ in range(8)])


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tpcompile.tools.presets import tiny_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0, task_type="CAUSAL_LM")


def _common(out: str, batch: int) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=batch, max_steps=STEPS, learning_rate=1e-2,
                logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=0, save_strategy="no",
                bf16=False)  # fp32: exact comparisons (TRL's CPU default is bf16 autocast)


def _sft(model: torch.nn.Module, out: str, batch: int, lora: bool) -> list[tuple[float, float]]:
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(5)  # the adapters' initialisation
    trainer = SFTTrainer(model=model, args=SFTConfig(**_common(out, batch), packing=False),
                         train_dataset=_sequences(), processing_class=_tokenizer(),
                         peft_config=_lora() if lora else None)
    trainer.train()
    return [(h["loss"], h["num_tokens"]) for h in trainer.state.log_history if "loss" in h]


def _dpo(model: torch.nn.Module, out: str) -> list[float]:
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(5)
    trainer = DPOTrainer(model=model, args=DPOConfig(**_common(out, 4)), train_dataset=_preferences(),
                         processing_class=_tokenizer(), peft_config=_lora())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@functools.cache
def _single_process(tmp: str) -> dict:
    return {"sft": _sft(_model(), f"{tmp}/ref-sft", 4, False), "sft_lora": _sft(_model(), f"{tmp}/ref-lora", 4, True),
            "dpo": _dpo(_model(), f"{tmp}/ref-dpo")}


def _launched(rank: int, world: int) -> None:
    # what torchrun exports: the Trainer and accelerate read these to run distributed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def _tp(rank: int, world: int, out: str, what: str) -> Any:
    import tpcompile

    _launched(rank, world)
    model = tpcompile.transform(_model(), tp=2)
    if what == "dpo":
        return _dpo(model, f"{out}/dpo-{rank}")
    return _sft(model, f"{out}/{what}-{rank}", 4, what == "sft_lora")


def _fsdp(rank: int, world: int, out: str, lora: bool) -> Any:
    import tpcompile

    _launched(rank, world)
    return _sft(tpcompile.parallelize(_model(), tp=2), f"{out}/fsdp-{lora}-{rank}", 2, lora)  # 2 dp ranks x 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = str(tmp_path_factory.mktemp("trl"))
    world2 = run_cases(2, {w: (_tp, out, w) for w in ("sft", "sft_lora", "dpo")}, timeout=900)
    world4 = run_cases(4, {"sft": (_fsdp, out, False), "sft_lora": (_fsdp, out, True)}, timeout=900)
    return {"ref": _single_process(out), "world2": world2, "world4": world4}


def _close(got: list, want: list) -> None:
    assert len(got) == len(want) == STEPS, (got, want)
    for g, w in zip(got, want, strict=True):
        if isinstance(w, tuple):
            assert g[0] == pytest.approx(w[0], rel=REL), (got, want)
            assert g[1] == w[1], ("token counts", got, want)  # each sample counted once
        else:
            assert g == pytest.approx(w, rel=REL), (got, want)


@pytest.mark.slow
@pytest.mark.parametrize("what", ["sft", "sft_lora", "dpo"])
def test_trl_trainers_on_a_tp2_model_equal_one_process(runs: dict, what: str) -> None:
    for got in runs["world2"][what]:
        _close(got, runs["ref"][what])


@pytest.mark.slow
@pytest.mark.parametrize("what", ["sft", "sft_lora"])
def test_sft_trainer_on_a_dp2_tp2_model_equals_one_process(runs: dict, what: str) -> None:
    for got in runs["world4"][what]:
        _close(got, runs["ref"][what])
