"""Train a Hugging Face causal LM with tensor parallelism + FSDP2 through tpcompile.

Out of the box, on CPU (gloo, a tiny Llama built in, synthetic data)::

    torchrun --nproc-per-node 2 examples/train.py

The same script, unchanged, on GPUs (NCCL, one GPU per process, picked automatically
when CUDA is available), e.g. 8 GPUs as (dp_shard 4 × tp 2) from an HF checkpoint::

    torchrun --nproc-per-node 8 examples/train.py --tp 2 --model-dir /path/to/Llama-3-8B \\
        --mixed-precision bf16 --activation-checkpointing --steps 1000 --save-every 100

What it shows, in order:

1. The model is built on the meta device on every rank: no rank ever holds it whole.
2. ``tpcompile.parallelize(model, tp=..., dp_shard=..., ...)`` shards it (TP, then
   activation checkpointing, then FSDP2) and materializes only this rank's shards: from
   ``--model-dir`` (an HF directory; each rank reads only its own rows of each tensor,
   ``load_from=``), or else by delayed init seeded with ``--seed``.
3. If ``--ckpt-dir`` holds a checkpoint (its ``latest`` pointer), training resumes from
   it: weights, AdamW state and the step. The data of step ``n`` depends only on
   ``--seed`` and ``n``, so a resumed run computes exactly the losses an uninterrupted run
   would.
4. An AdamW loop; rank 0 logs the global loss every step (``step N | loss L | ...``).
5. Every ``--save-every`` steps and at the last step, an asynchronous sharded checkpoint
   (``tpcompile.checkpoint.save(..., kind="sharded", async_=True)``): training goes on
   while it is written; it reloads at any tp/dp/world size.
6. At the end, ``tpcompile.save_pretrained`` writes ``--out-dir``, a plain HF directory
   that ``transformers.AutoModelForCausalLM.from_pretrained`` loads without tpcompile.

Resume: run the same command again with a larger ``--steps``. Under torchrun's restarts
the script resumes by itself, so a rank that dies (a crash, the OOM killer, a lost node)
costs one restart of the group, not the run::

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train.py

torchrun sees the dead rank, stops the others and starts the group again; the new
processes resume from ``latest``, the newest complete checkpoint (a save a rank died in
never becomes ``latest``), so at most ``--save-every`` steps are recomputed and the run
ends with the losses and weights of an uninterrupted one. On several nodes, launch with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (see :func:`init_process_group`).

Fault injection (for the restart tests; off unless set): ``TPCOMPILE_TEST_KILL_AT=step:N``
SIGKILLs the last rank in the middle of step ``N`` (after its backward, before the
optimizer step; the checkpoint in flight is first waited for, so the restart's resume
point is known), and ``save:N`` SIGKILLs it in the middle of the asynchronous save of
step ``N`` (its files written, the directory not yet published). Only torchrun's first
attempt (``TORCHELASTIC_RESTART_COUNT`` 0) is killed, so the restarted group runs through.

The synthetic task (arithmetic progressions of token ids modulo the vocabulary) is
learnable, so the loss falls. For real data, replace :func:`global_batch` with your loader
and give each data-parallel rank its slice (``tpcompile.data_parallel_rank``).
Dropout RNG state is not checkpointed (the tiny Llama has none); exact resumption of a
model with dropout would also need each rank's RNG state.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import tpcompile
import tpcompile.checkpoint as ckpt
from tpcompile import data_parallel_rank

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
KILL_ENV = "TPCOMPILE_TEST_KILL_AT"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model = p.add_argument_group("model")
    model.add_argument("--model-dir", default=None,
                       help="HF checkpoint directory to start from (default: a tiny config, "
                            "initialized from --seed)")
    model.add_argument("--preset", default="llama",
                       help="family of the tiny built-in config when no --model-dir is given")
    par = p.add_argument_group("parallelism")
    par.add_argument("--tp", type=int, default=None,
                     help="tensor-parallel degree (default: 2 if the world size is even, else 1)")
    par.add_argument("--dp-shard", type=int, default=-1, help="FSDP2 shard degree (-1: the rest)")
    par.add_argument("--dp-replicate", type=int, default=1, help="HSDP replicas")
    par.add_argument("--strategy", default="FULL_SHARD", choices=STRATEGIES,
                     help="accelerate's sharding strategy names")
    par.add_argument("--activation-checkpointing", action="store_true",
                     help="recompute each transformer block in backward")
    par.add_argument("--mixed-precision", default="none", choices=("none", "bf16"),
                     help="FSDP2 param dtype for compute (gradients reduced in fp32)")
    train = p.add_argument_group("training")
    train.add_argument("--steps", type=int, default=40, help="train until this global step")
    train.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    train.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--warmup", type=int, default=5,
                       help="linear warmup steps (the schedule depends on the step only, so "
                            "a resumed run follows it exactly)")
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="0: no clipping")
    train.add_argument("--seed", type=int, default=0, help="init and data seed")
    io = p.add_argument_group("checkpoints")
    io.add_argument("--ckpt-dir", default="checkpoints/train",
                    help="training checkpoints (step-N/ + latest); resumed from if present")
    io.add_argument("--save-every", type=int, default=10, help="0: only at the last step")
    io.add_argument("--sync-save", action="store_true",
                    help="save checkpoints synchronously (default: asynchronously)")
    io.add_argument("--out-dir", default="checkpoints/final", help="final HF export")
    io.add_argument("--log-json", default=None,
                    help="rank 0 writes the per-step losses and a probe's logits here")
    return p.parse_args(argv)


def restart_count() -> int:
    """How many times torchrun has restarted this group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_process_group(backend: str) -> None:
    """``dist.init_process_group(backend)``, each torchrun restart under its own store keys.

    torchrun's rendezvous (c10d, and static with ``--master-port``) lends its TCPStore to
    the workers and keeps it across restarts, so a restarted group would read the dead
    group's addresses under the same keys and fail to connect (gloo: "Connection
    refused"). A prefix per restart keeps the attempts apart. The restart count is the same on every rank of one node; across
    nodes it can differ, so there launch with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
    (a fresh store per restart; the workers then see ``TORCHELASTIC_USE_AGENT_STORE=False``).
    """
    if restart_count() == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend)
        return
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group(backend, store=dist.PrefixStore(f"restart-{restart_count()}", agent),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def setup() -> torch.device:
    """Process group and device: NCCL + this process's GPU when CUDA is available, else
    gloo on CPU. torchrun provides RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous; run
    without torchrun (``python examples/train.py``), the script is a 1-process job."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        init_process_group("nccl")
        return torch.device("cuda", local_rank)
    init_process_group("gloo")
    return torch.device("cpu")


def log(*args: Any) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def kill_point() -> tuple[str, int] | None:
    """``("step" | "save", N)`` from ``TPCOMPILE_TEST_KILL_AT`` on torchrun's first attempt;
    ``None`` on a restart or when it is unset (the default)."""
    spec = os.environ.get(KILL_ENV, "")
    if not spec:
        return None
    where, _, step = spec.partition(":")
    if where not in ("step", "save") or not step.isdigit():
        raise SystemExit(f"{KILL_ENV}={spec!r}: expected step:N or save:N")
    return None if restart_count() > 0 else (where, int(step))


def die(where: str) -> None:
    """SIGKILL the last rank, as the OOM killer or a lost node would: nothing is cleaned
    up. The other ranks return and run into the collectives it never joins."""
    if dist.get_rank() != dist.get_world_size() - 1:
        return
    print(f"{KILL_ENV}: SIGKILL rank {dist.get_rank()} {where}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def die_in_next_write(step: int) -> None:
    """Make the last rank die inside the next sharded write, once its files are on disk
    and before the directory is published (an async save writes on a background thread).
    It wraps the same internal step the checkpoint tests stall to kill a save."""
    from tpcompile.checkpoint import training

    write = training._write_sharded

    def write_then_die(*args: Any) -> None:
        write(*args)
        die(f"in the middle of the async save of step {step}")

    training._write_sharded = write_then_die


def build_meta_model(args: argparse.Namespace) -> nn.Module:
    """The model's structure only: every parameter on the meta device, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.model_dir:
        config = AutoConfig.from_pretrained(args.model_dir)
    else:
        from tpcompile.tools.presets import tiny_config

        config = tiny_config(args.preset)
    with torch.device("meta"):
        # fp32 master weights whatever the checkpoint's dtype; --mixed-precision sets the
        # compute dtype
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> torch.Tensor:
    """Step ``step``'s global batch, identical on every rank and in every run: rows are
    arithmetic progressions ``(start + stride * t) % vocab`` (learnable in context)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, min(vocab, 17), (batch, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Learning rate of (1-based) ``step``: linear warmup, then constant."""
    return args.lr * min(1.0, step / args.warmup) if args.warmup > 0 else args.lr


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = setup()
    world = dist.get_world_size()
    tp = args.tp if args.tp is not None else (2 if world % 2 == 0 else 1)
    ckpt_dir, out_dir = Path(args.ckpt_dir), Path(args.out_dir)
    kill = kill_point()
    if restart_count():
        log(f"torchrun restart {restart_count()} of at most "
            f"{os.environ.get('TORCHELASTIC_MAX_RESTARTS', '?')}")

    # 1-2. meta model -> TP + activation checkpointing + FSDP2 -> this rank's shards only
    model = build_meta_model(args)
    resume = ckpt.latest(ckpt_dir)
    layout: dict[str, Any] = dict(
        tp=tp, dp_shard=args.dp_shard, dp_replicate=args.dp_replicate,
        sharding_strategy=args.strategy, activation_checkpointing=args.activation_checkpointing,
        mixed_precision=None if args.mixed_precision == "none" else args.mixed_precision,
        seed=args.seed)  # seed: delayed init (without --model-dir), then each process's RNG
    if args.model_dir:
        # every rank reads only its rows of each tensor; no random init. (When resuming,
        # the checkpoint overwrites these weights below: any materialization would do.)
        layout["load_from"] = args.model_dir
    t0 = time.perf_counter()
    tpcompile.parallelize(model, **layout)
    vocab = model.config.vocab_size
    dp_rank, dp_size = data_parallel_rank(model)
    if args.batch % dp_size:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {dp_size} data-parallel ranks")
    local_params = sum(p.to_local().numel() for p in model.parameters())
    log(f"mesh (dp_replicate, dp_shard, tp) = {tuple(model.tpcompile_mesh.shape)} on {device.type}; "
        f"{sum(p.numel() for p in model.parameters()):,} parameters, {local_params:,} on rank 0; "
        f"parallelize took {time.perf_counter() - t0:.1f} s"
        + (f"; read {model.tpcompile_load_stats['bytes_read']:,} bytes" if args.model_dir else ""))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    # 3. resume: weights, optimizer state and the step from the newest complete checkpoint
    start = 0
    if resume is not None:
        extra = ckpt.load(resume, model, opt)
        start = int(extra["step"])
        log(f"resumed from {resume} at step {start}")

    # 4-5. train; checkpoint asynchronously
    async_save = not args.sync_save
    losses: dict[int, float] = {}
    handle = None
    model.train()
    for step in range(start + 1, args.steps + 1):
        t = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        ids = global_batch(step, args.batch, args.seq, vocab, args.seed).chunk(dp_size)[dp_rank]
        ids = ids.to(device)
        if kill == ("step", step) and handle is not None:
            # every rank, so `latest` names it before the step's collectives let the kill
            # happen: the restart's resume point is known
            handle.wait()
        loss = model(ids, labels=ids).loss
        loss.backward()
        if kill == ("step", step):
            die(f"in the middle of step {step}")
        grad_norm = float("nan")
        if args.max_grad_norm > 0:
            # parameters are DTensors on one (dp..., tp) mesh: torch's clipping works as is
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        # the global loss: TP ranks hold the same value, dp ranks the means of equal slices
        total = loss.detach().float().clone()
        dist.all_reduce(total)
        losses[step] = total.item() / world
        tokens = args.batch * args.seq / (time.perf_counter() - t)
        log(f"step {step:6d} | loss {losses[step]:.8f} | grad norm {grad_norm:.4f} | "
            f"lr {lr_at(step, args):.3e} | {tokens:,.0f} tok/s")
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            # returns after staging; the files are written on a background thread (and
            # process group) while training goes on; `latest` moves once they are complete
            if kill == ("save", step):
                die_in_next_write(step)
            handle = ckpt.save(ckpt_dir, model, opt, kind="sharded", step=step, async_=async_save,
                               extra={"step": step})
    if handle is not None:
        handle.wait()  # re-raises a failed write; the process must not exit mid-write
        log(f"checkpoint {handle.path} complete")

    # 6. a plain HF directory; every rank writes the rows it holds
    probe = global_batch(0, 2, min(args.seq, 16), vocab, args.seed).to(device)
    model.eval()
    with torch.no_grad():
        probe_logits = model(probe).logits[:, -1, :1024].float().cpu()
    tpcompile.save_pretrained(model, out_dir)
    if args.log_json and dist.get_rank() == 0:
        Path(args.log_json).write_text(json.dumps({
            "resumed_from": start, "losses": losses, "probe_ids": probe.cpu().tolist(),
            "probe_logits": probe_logits.tolist()}) + "\n")
    log(f"saved the trained model to {out_dir}; load it with plain transformers:\n"
        f"    from transformers import AutoModelForCausalLM\n"
        f"    model = AutoModelForCausalLM.from_pretrained({str(out_dir)!r})")
    dist.barrier()  # no rank tears gloo down while a peer still has traffic in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
