"""Train a tpcompile model with the Hugging Face ``Trainer``: checkpoints, resume, export.

Out of the box, on CPU (gloo, a tiny Llama built in, synthetic data)::

    torchrun --nproc-per-node 2 examples/trainer.py            # tp=2 (transform)
    torchrun --nproc-per-node 4 examples/trainer.py            # dp_shard 2 x tp 2 (parallelize)
    torchrun --nproc-per-node 2 examples/trainer.py --steps 12  # resumes from the last checkpoint

On GPUs the same script runs unchanged (the Trainer picks CUDA/NCCL); pass
``--model-dir`` to start from an HF checkpoint instead of the tiny config.

What it shows:

1. ``tpcompile.transform(model, tp=N)`` when the world is one TP group, else
   ``tpcompile.parallelize(model, tp=N)`` (FSDP2 over the data-parallel ranks). Either
   marks the model so the Trainer leaves its parallelism alone (no DDP wrapper).
2. A plain ``Trainer(...)``, no tpcompile lines: the training data is sharded over the
   data-parallel ranks only (the ranks of a TP group see the same batch), and every
   checkpoint gets the optimizer, scheduler and RNG state (tpcompile's Trainer support,
   added to every Trainer once a model is transformed). ``save_only_model=True`` is what
   transformers asks of models that shard themselves; tpcompile adds the rest.
3. ``trainer.train(resume_from_checkpoint=True)`` when ``--output-dir`` holds a
   checkpoint: weights, AdamW state, LR schedule and data position are restored.
4. ``trainer.save_model(<output-dir>/final)``: a plain HF directory that
   ``AutoModelForCausalLM.from_pretrained`` loads without tpcompile.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import tpcompile
from tpcompile.tools.presets import tiny_config

DATASET_SIZE = 10_000  # fixed, so a resumed run with more --steps sees the same shuffled order


class Progressions(torch.utils.data.Dataset):
    """Arithmetic progressions of token ids modulo the vocabulary: learnable, so the loss
    falls. Item ``i`` depends only on ``i``."""

    def __init__(self, size: int, seq: int, vocab: int) -> None:
        self.size, self.seq, self.vocab = size, seq, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        start, step = torch.randint(0, self.vocab, (2,), generator=g).tolist()
        ids = (start + step * torch.arange(self.seq)) % self.vocab
        return {"input_ids": ids, "labels": ids}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--model-dir", default=None, help="HF checkpoint to start from (default: tiny Llama)")
    p.add_argument("--output-dir", default="trainer_out", help="checkpoints and the final export")
    p.add_argument("--steps", type=int, default=8, help="total optimizer steps")
    p.add_argument("--save-steps", type=int, default=4, help="checkpoint every this many steps")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq", type=int, default=32, help="sequence length")
    p.add_argument("--lr", type=float, default=1e-2)
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)  # same full weights on every rank before sharding
    if args.model_dir:
        return AutoModelForCausalLM.from_pretrained(args.model_dir)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not dist.is_initialized():  # torchrun sets the environment; CUDA gets NCCL
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    model = build_model(args)
    if world == args.tp:
        model = tpcompile.transform(model, tp=args.tp)
    else:  # data parallelism comes from FSDP2; the Trainer must not add DDP
        model = tpcompile.parallelize(model, tp=args.tp)
    dp = world // args.tp
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} must be divisible by the data-parallel degree {dp}")

    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch // dp, max_steps=args.steps,
        learning_rate=args.lr, lr_scheduler_type="constant", max_grad_norm=1.0,
        logging_steps=1, save_strategy="steps", save_steps=args.save_steps, save_only_model=True,
        report_to=[], use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=0)
    vocab = model.config.vocab_size
    trainer = Trainer(model=model, args=training_args,
                      train_dataset=Progressions(DATASET_SIZE, args.seq, vocab))
    resume = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    if dist.get_rank() == 0:
        print(f"saved {os.path.join(args.output_dir, 'final')} (plain transformers loads it)", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
