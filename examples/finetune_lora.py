"""LoRA fine-tuning of a tensor-parallel model with TRL, saved as a PEFT adapter.

Out of the box, on CPU (gloo, a tiny Llama and a word-level tokenizer built in)::

    torchrun --nproc-per-node 2 examples/finetune_lora.py

What it shows (no tpcompile lines in the training code):

1. ``tpcompile.transform(model, tp=2)``, then ``SFTTrainer(model, peft_config=LoraConfig(...))``:
   TRL adds the LoRA adapters *after* transform; tpcompile plans them from the adapted
   model's dataflow (LoRA ``B`` of a column-parallel projection split like its output,
   ``A`` of a row-parallel one like its input), so training is exactly the single-process
   run.
2. ``trainer.save_model(dir)``: PEFT's own adapter files (``adapter_config.json`` +
   ``adapter_model.safetensors``, full shapes, written once), which plain
   ``PeftModel.from_pretrained(base, dir)`` loads without tpcompile.
3. ``merge_and_unload()``: the merged tensor-parallel model; its ``save_pretrained`` is a
   plain Hugging Face directory.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import tpcompile
from tpcompile.tools.presets import tiny_config


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``t0 .. t249``, built in memory (no hub download)."""
    vocab = {f"t{i}": i for i in range(250)}
    vocab.update({"<pad>": 250, "<eos>": 251, "<bos>": 252, "<unk>": 253})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")


def progressions(n: int, seq: int) -> Dataset:
    """Arithmetic progressions of token words: learnable, so the loss falls."""
    rows = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        start, step = torch.randint(0, 250, (2,), generator=g).tolist()
        rows.append({"text": " ".join(f"t{(start + step * k) % 250}" for k in range(seq))})
    return Dataset.from_list(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--output-dir", default="lora_out")
    args = p.parse_args(argv)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    torch.manual_seed(0)  # the same base weights on every rank before sharding
    model = tpcompile.transform(AutoModelForCausalLM.from_config(tiny_config("llama")), tp=args.tp)

    config = SFTConfig(output_dir=args.output_dir, per_device_train_batch_size=8, max_steps=args.steps,
                       learning_rate=5e-3, logging_steps=1, save_strategy="no", report_to=[],
                       use_cpu=not torch.cuda.is_available(), bf16=False, disable_tqdm=True, seed=0)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], lora_dropout=0.0,
                      task_type="CAUSAL_LM")
    trainer = SFTTrainer(model=model, args=config, train_dataset=progressions(256, 16), processing_class=tokenizer(),
                         peft_config=lora)
    trainer.train()
    adapter = os.path.join(args.output_dir, "adapter")
    trainer.save_model(adapter)  # every rank; PEFT's format, written by rank 0
    merged = trainer.model.merge_and_unload()
    merged.save_pretrained(os.path.join(args.output_dir, "merged"))  # every rank, gather-free
    if dist.get_rank() == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"losses {losses[0]:.4f} -> {losses[-1]:.4f}; adapter in {adapter}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
