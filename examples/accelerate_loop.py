"""A custom accelerate training loop over a tpcompile model.

    accelerate launch --config_file examples/accelerate_config.yaml examples/accelerate_loop.py  # GPUs
    ACCELERATE_USE_CPU=true accelerate launch --config_file examples/accelerate_config.yaml \
        examples/accelerate_loop.py                                                   # CPU, gloo

(``num_processes: 4`` in the config: dp 2 x tp 2, same losses.)

``Accelerator()`` starts the process group (gloo on CPU, NCCL on GPUs); the model is
transformed after it. ``accelerator.prepare(model, ...)`` itself would wrap the model in
DDP over every rank (accelerate has no switch for a model that distributes itself,
except its own GPU-only ``ParallelismConfig`` for transformers-sharded models), so the
model goes through ``tpcompile.integrations.prepare``: registered with the accelerator
unwrapped, the loader sharded over data-parallel ranks only, the optimizer prepared as
usual. ``accelerator.backward``, ``clip_grad_norm_`` and ``accumulate`` then work on the
DTensor parameters unchanged. With more processes than ``--tp`` the model is
``parallelize``-d (FSDP2 over the data-parallel ranks).
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile.integrations import prepare
from tpcompile.tools.presets import tiny_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8, help="global batch")
    p.add_argument("--accumulate", type=int, default=2, help="gradient accumulation steps")
    args = p.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=args.accumulate)
    torch.manual_seed(0)  # same full weights everywhere before sharding
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    world = torch.distributed.get_world_size()  # accelerate started the group
    model = tpcompile.transform(model, tp=args.tp) if world == args.tp else \
        tpcompile.parallelize(model, tp=args.tp)
    dp = world // args.tp

    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, model.config.vocab_size, (args.batch * args.steps * args.accumulate, 32), generator=g)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch // dp)  # per data-parallel rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = prepare(accelerator, model, opt, loader)

    model.train()
    for i, ids in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            mean = accelerator.reduce(loss.detach(), reduction="mean")  # TP ranks agree; dp mean
            accelerator.print(f"step {(i + 1) // args.accumulate} | loss {mean.item():.4f} | grad norm "
                              f"{float(norm):.4f}")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
