"""``python -m tpcompile demo``: the whole story on local CPU processes.

A tiny Llama is transformed on ``--tp`` gloo processes, then its logits, training
losses and greedy generations are compared against a single-process copy of the same
model.  Exit code 0 when everything matches, 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from ..plan import Plan
from .launch import WorkerFailed, spawn_local

__all__ = ["run_demo"]

_EXIT_OK = 0
_EXIT_MISMATCH = 1
# Demo acceptance thresholds (float32 CPU; only the reduction order differs).
_LOGITS_ATOL = 1e-5
_LOSS_RTOL = 1e-4
_DEMO_SEED = 0
_DEMO_BATCH = (2, 16)
_DEMO_NEW_TOKENS = 8


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the process exit code."""
    t0 = time.perf_counter()
    try:
        verdicts = spawn_local(_demo_checks, args.tp, args.steps)
    except WorkerFailed as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return _EXIT_MISMATCH
    ok = all(verdicts)
    status = "OK: the TP model matches the single-process reference" if ok else "FAILED"
    print(f"demo: {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return _EXIT_OK if ok else _EXIT_MISMATCH


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def _global_max(value: float) -> float:
    """Max over ranks, so every rank reaches the same verdict."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _demo_checks(rank: int, tp: int, steps: int) -> bool:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..api import transform
    from . import presets

    hf_logging.set_verbosity_error()  # keep the demo's output to what it measures
    torch.manual_seed(_DEMO_SEED)  # same seed on every rank: identical full weights
    config = presets.tiny_config("llama")
    model = AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(model)
    transform(model, tp=tp)
    _say(rank, _role_summary(model.tpcompile_plan))

    ids = torch.randint(0, config.vocab_size, _DEMO_BATCH,
                        generator=torch.Generator().manual_seed(_DEMO_SEED + 1))
    logits_ok = _check_logits(rank, model, reference, ids)
    losses_ok = _check_training(rank, model, reference, ids, steps)
    tokens_ok = _check_generate(rank, model, reference, ids[:1, :6], config)
    return logits_ok and losses_ok and tokens_ok


def _role_summary(plan: Plan) -> str:
    roles = Counter(p.role.value for p in plan.params.values())
    layouts = Counter(p.layout for p in plan.params.values())
    role_text = ", ".join(f"{n} {r}" for r, n in sorted(roles.items()))
    layout_text = ", ".join(f"{n} {k}" for k, n in sorted(layouts.items()))
    return f"plan (tp={plan.tp}, {plan.model_class}): {role_text}\n  layouts: {layout_text}"


def _check_logits(rank: int, model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> bool:
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    diff = _global_max(diff)
    ok = diff < _LOGITS_ATOL
    _say(rank, f"logits: max abs diff {diff:.2e} -> {'match' if ok else 'MISMATCH'}")
    return ok


def _check_training(rank: int, model: nn.Module, reference: nn.Module, ids: torch.Tensor,
                    steps: int) -> bool:
    # Every rank trains its own identical reference copy, so no reference traffic.
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    model.train()
    reference.train()
    ok = True
    _say(rank, f"training {steps} steps of AdamW(lr=1e-3):")
    for step in range(1, steps + 1):
        tp_loss, ref_loss = (_train_step(m, opt, ids) for m, opt in zip((model, reference), opts,
                                                                            strict=True))
        rel = _global_max(abs(tp_loss - ref_loss) / max(abs(ref_loss), 1e-12))
        ok = ok and rel < _LOSS_RTOL
        _say(rank, f"  step {step}: tp loss {tp_loss:.6f}  reference {ref_loss:.6f}  "
                   f"rel diff {rel:.1e}")
    _say(rank, f"losses: {'match' if ok else 'MISMATCH'} (rel tol {_LOSS_RTOL:g})")
    return ok


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def _check_generate(rank: int, model: PreTrainedModel, reference: PreTrainedModel,
                    prompt: torch.Tensor, config: PreTrainedConfig) -> bool:
    model.eval()
    reference.eval()
    kwargs = {"max_new_tokens": _DEMO_NEW_TOKENS, "do_sample": False,
              "pad_token_id": config.eos_token_id}
    with torch.no_grad():
        got = model.generate(prompt, **kwargs)
        want = reference.generate(prompt, **kwargs)
    same = got.shape == want.shape and bool(torch.equal(got, want))
    ok = _global_max(0.0 if same else 1.0) == 0.0
    _say(rank, f"generate (greedy, {_DEMO_NEW_TOKENS} new tokens):\n"
               f"  tp        {got[0].tolist()}\n  reference {want[0].tolist()}")
    _say(rank, f"tokens: {'match' if ok else 'MISMATCH'}")
    return ok
