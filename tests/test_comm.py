"""Multi-process (gloo, CPU) tests of the tensor-parallel collectives and the
vocab-parallel cross entropy against their single-process math.

Every rank builds the same global tensors from fixed seeds, so each can compute the
single-process reference locally and compare its own shard.  Workers are
module-level functions so spawned processes can unpickle them; all cases of one world
size run in one launch (module fixtures ``world2`` / ``world4``).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist import CaseResults, run_cases, run_distributed
from torch import Tensor

from tpcompile.runtime.comm import (
    all_reduce_grad,
    copy_to_tp,
    gather_from_tp,
    on_first_rank,
    reduce_from_tp,
    scatter_to_tp,
    sum_over_tp,
)
from tpcompile.runtime.loss import loss_parallel_causal_lm_loss, vocab_parallel_cross_entropy

__all__: list[str] = []

# Float32 loss tolerances: 1e-6 absolute plus torch's default float32 relative slack,
# because summing ~log(V) per-token losses in a different order moves the last bits.
LOSS_TOL = {"atol": 1e-6, "rtol": 1.3e-6}
GRAD_TOL = {"atol": 1e-6, "rtol": 0.0}


def _randn(seed: int, *shape: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Deterministic normal tensor; the same seed gives the same values on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _shard(full: Tensor, rank: int, world: int, dim: int = -1) -> Tensor:
    return full.chunk(world, dim=dim)[rank]


# --------------------------------------------------------------------------- collectives


def _check_copy_to_tp(rank: int, world: int) -> None:
    # y = x on every rank; dL/dx = sum_r dL_r/dy.
    x = _randn(0, 3, 4).requires_grad_()
    y = copy_to_tp(x, None)
    assert torch.equal(y, x)
    upstream = [_randn(100 + r, 3, 4) for r in range(world)]
    y.backward(upstream[rank])
    torch.testing.assert_close(x.grad, torch.stack(upstream).sum(0))


def _check_reduce_from_tp(rank: int, world: int) -> None:
    # y = sum_r x_r; dL/dx_r = dL/dy (replicated upstream).  A transposed input checks
    # that non-contiguous tensors are handled and the input is left untouched.
    parts = [_randn(10 + r, 4, 3).t() for r in range(world)]
    x = parts[rank].clone().requires_grad_()
    before = x.detach().clone()
    y = reduce_from_tp(x, None)
    torch.testing.assert_close(y, torch.stack(parts).sum(0))
    assert torch.equal(x.detach(), before), "reduce_from_tp modified its input"
    upstream = _randn(200, 3, 4)
    y.backward(upstream)
    torch.testing.assert_close(x.grad, upstream)


def _check_gather_from_tp(rank: int, world: int) -> None:
    # y = cat_r(x_r, dim); dL/dx_r = chunk r of the replicated upstream.
    for dim in (-1, 0, 1):
        parts = [_randn(20 + r, 2, 3, 4) for r in range(world)]
        x = parts[rank].clone().requires_grad_()
        y = gather_from_tp(x, None, dim=dim)
        full = torch.cat(parts, dim=dim)
        torch.testing.assert_close(y, full)
        upstream = _randn(300, *full.shape)
        y.backward(upstream)
        torch.testing.assert_close(x.grad, _shard(upstream, rank, world, dim))


def _check_scatter_to_tp(rank: int, world: int) -> None:
    # y = chunk r of the replicated x; dL/dx = cat_r(dL_r/dy_r, dim).
    for dim in (-1, 0):
        x = _randn(30, 2 * world, 3 * world).requires_grad_()
        y = scatter_to_tp(x, None, dim=dim)
        assert y.is_contiguous()
        torch.testing.assert_close(y, _shard(x.detach(), rank, world, dim))
        upstream = [_randn(400 + r, *y.shape) for r in range(world)]
        y.backward(upstream[rank])
        torch.testing.assert_close(x.grad, torch.cat(upstream, dim=dim))
    with pytest.raises(ValueError, match=rf"size {world + 1} into {world} equal chunks"):
        scatter_to_tp(torch.zeros(2, world + 1), None, dim=-1)


def _check_all_reduce_grad(rank: int, world: int) -> None:
    # A replicated weight applied to a sharded activation: y_r = h_r * w, so
    # dL/dw = sum_r h_r * g_r even though each rank only sees its own shard.
    assert all_reduce_grad is copy_to_tp
    w = _randn(40, 5).requires_grad_()
    h = [_randn(50 + r, 2, 5) for r in range(world)]
    g = [_randn(60 + r, 2, 5) for r in range(world)]
    (h[rank] * all_reduce_grad(w, None)).backward(g[rank])
    expected = sum((h_r * g_r).sum(0) for h_r, g_r in zip(h, g, strict=True))
    torch.testing.assert_close(w.grad, expected)


def _check_megatron_mlp(rank: int, world: int) -> None:
    # Column-parallel A then row-parallel B: Y = sum_r relu(X A_r) B_r must equal
    # relu(X A) B, with gradients of X, A_r and B_r matching the dense ones.
    x_full = _randn(70, 4, 6).requires_grad_()
    a_full = _randn(71, 6, 4 * world).requires_grad_()
    b_full = _randn(72, 4 * world, 6).requires_grad_()
    upstream = _randn(73, 4, 6)
    (torch.relu(x_full @ a_full) @ b_full).backward(upstream)

    x = x_full.detach().clone().requires_grad_()
    a = _shard(a_full.detach(), rank, world, dim=1).clone().requires_grad_()
    b = _shard(b_full.detach(), rank, world, dim=0).clone().requires_grad_()
    y = reduce_from_tp(torch.relu(copy_to_tp(x, None) @ a) @ b, None)
    torch.testing.assert_close(y, torch.relu(x_full @ a_full) @ b_full)
    y.backward(upstream)
    torch.testing.assert_close(x.grad, x_full.grad)
    torch.testing.assert_close(a.grad, _shard(a_full.grad, rank, world, dim=1))
    torch.testing.assert_close(b.grad, _shard(b_full.grad, rank, world, dim=0))


def _check_sum_over_tp(rank: int, world: int) -> None:
    # y = sum_r x_r on every rank, and split code reads y: dL/dx_r = sum_r dL_r/dy.
    parts = [_randn(75 + r, 3, 1) for r in range(world)]
    x = parts[rank].clone().requires_grad_()
    y = sum_over_tp(x, None)
    torch.testing.assert_close(y, torch.stack(parts).sum(0))
    upstream = [_randn(76 + r, 3, 1) for r in range(world)]
    y.backward(upstream[rank])
    torch.testing.assert_close(x.grad, torch.stack(upstream).sum(0))


def _check_on_first_rank(rank: int, world: int) -> None:
    # b added to each rank's partial sum, then summed: b counted once; its gradient is the
    # sum's (whole on every rank), on every rank
    b = _randn(77, 4).requires_grad_()
    parts = [_randn(78 + r, 2, 4) for r in range(world)]
    y = reduce_from_tp(parts[rank] + on_first_rank(b, None), None)
    torch.testing.assert_close(y, torch.stack(parts).sum(0) + b.detach())
    upstream = _randn(79, 2, 4)
    y.backward(upstream)
    torch.testing.assert_close(b.grad, upstream.sum(0))


def _stat_norm(x: Tensor, w: Tensor) -> Tensor:
    """An RMSNorm, and every statistic form the split rewrite reads, over the last dim."""
    var = x.pow(2).mean(-1, keepdim=True)
    centred = x - x.mean(dim=-1, keepdim=True)
    spread = torch.var(x, -1, keepdim=True) + x.std(-1, correction=0, keepdim=True) + x.sum(-1, keepdim=True)
    return w * x * torch.rsqrt(var + 1e-5) + centred * spread


def _check_split_statistics(rank: int, world: int) -> None:
    # Statistics over features split across the ranks (OLMo-2's q_norm over all heads):
    # local partial sums all-reduced forward and backward give the dense norm's output
    # and every gradient; a forward computing other statistics than planned is refused.
    from tpcompile.errors import TPError
    from tpcompile.plan.modules import SplitStats
    from tpcompile.runtime.stats import SplitStatMode

    n = 4 * world
    x_full = _randn(80, 3, n).requires_grad_()
    w_full = _randn(81, n).requires_grad_()
    upstream = _randn(82, 3, n)
    want = _stat_norm(x_full, w_full)
    want.backward(upstream)
    x = _shard(x_full.detach(), rank, world).clone().requires_grad_()
    w = _shard(w_full.detach(), rank, world).clone().requires_grad_()
    op = SplitStats(dim=-1, size=n, local=4, ops=("mean", "mean", "var", "std", "sum"))
    with SplitStatMode(op, None) as mode:
        y = _stat_norm(x, w)
        assert torch.equal(x.amax(-1), x.amax(-1))  # not a statistic it splits: runs as written
    mode.check()
    torch.testing.assert_close(y, _shard(want.detach(), rank, world))
    y.backward(_shard(upstream, rank, world))
    torch.testing.assert_close(x.grad, _shard(x_full.grad, rank, world))
    torch.testing.assert_close(w.grad, _shard(w_full.grad, rank, world))
    with SplitStatMode(SplitStats(dim=-1, size=n, local=4, ops=("mean",)), None) as mode:
        _stat_norm(x, w)
    with pytest.raises(TPError, match="rewrote"):
        mode.check()


def _collectives_worker(rank: int, world: int) -> None:
    _check_copy_to_tp(rank, world)
    _check_reduce_from_tp(rank, world)
    _check_gather_from_tp(rank, world)
    _check_scatter_to_tp(rank, world)
    _check_all_reduce_grad(rank, world)
    _check_megatron_mlp(rank, world)
    _check_sum_over_tp(rank, world)
    _check_on_first_rank(rank, world)
    _check_split_statistics(rank, world)


def _failing_worker(rank: int, world: int) -> None:
    assert rank == 0, f"deliberate failure on rank {rank}"


def _cases(world: int) -> dict[str, tuple]:
    cases: dict[str, tuple] = {"collectives": (_collectives_worker,), "loss": (_loss_worker,)}
    if world == 2:  # the failing case first: the cases after it must still run
        cases = {"deliberate failure": (_failing_worker,), **cases,
                 "size one": (_size_one_worker,), "loss extras": (_loss_extras_worker,)}
    return cases


@pytest.fixture(scope="module")
def world2() -> CaseResults:
    return run_cases(2, _cases(2))


@pytest.fixture(scope="module")
def world4() -> CaseResults:
    return run_cases(4, _cases(4))


@pytest.mark.slow  # spawns processes
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_single_process_math(world: int, request: pytest.FixtureRequest) -> None:
    assert request.getfixturevalue(f"world{world}")["collectives"] == [None] * world


def _size_one_worker(rank: int, world: int) -> None:
    # Every rank must take part in creating every group, member or not.
    groups = [dist.new_group([r]) for r in range(world)]
    solo = groups[rank]
    assert dist.get_world_size(solo) == 1
    x = _randn(80, 4, 6).requires_grad_()
    labels = torch.tensor([1, 5, -100, 0])
    no_collective = mock.Mock(side_effect=AssertionError("collective called on size-1 group"))
    with (
        mock.patch.object(dist, "all_reduce", no_collective),
        mock.patch.object(dist, "all_gather", no_collective),
    ):
        for fn in (copy_to_tp, reduce_from_tp, gather_from_tp, scatter_to_tp, all_reduce_grad):
            assert fn(x, solo) is x, f"{fn.__name__} is not a no-op on a size-1 group"
        loss = vocab_parallel_cross_entropy(x, labels, group=solo, vocab_start=0)
        loss.backward()
    logits = x.detach().clone().requires_grad_()
    expected = F.cross_entropy(logits, labels)
    expected.backward()
    torch.testing.assert_close(loss, expected.float())
    torch.testing.assert_close(x.grad, logits.grad)


@pytest.mark.slow  # spawns processes
def test_size_one_group_is_a_no_op(world2: CaseResults) -> None:
    assert world2["size one"] == [None, None]


# --------------------------------------------------------------------------- loss


def _reference_ce(
    full: Tensor, labels: Tensor, vocab_size: int, reduction: str, upstream: Tensor | None
) -> tuple[Tensor, Tensor]:
    """F.cross_entropy on the unpadded logits; gradient zero-padded back to ``full``."""
    logits = full.detach().clone().requires_grad_()
    flat = logits[..., :vocab_size].float().reshape(-1, vocab_size)
    loss = F.cross_entropy(flat, labels.reshape(-1), ignore_index=-100, reduction=reduction)
    loss.backward(upstream.reshape(-1) if upstream is not None else None)
    return loss.detach(), logits.grad


def _check_vocab_parallel_ce(
    rank: int, world: int, vocab_size: int, padded: int, reduction: str, seed: int
) -> None:
    full = _randn(seed, 3, 7, padded, dtype=torch.float32) * 3
    # Padding columns hold large junk that must not leak into the loss.
    full[..., vocab_size:] = 50.0
    labels = torch.randint(0, vocab_size, (3, 7), generator=torch.Generator().manual_seed(seed))
    labels[0, :3] = -100
    labels[2, 6] = -100
    labels[1, 0] = vocab_size - 1  # target in the last shard, next to the padding
    upstream = _randn(seed + 1, 3, 7, dtype=torch.float32) if reduction == "none" else None
    ref_loss, ref_grad = _reference_ce(full, labels, vocab_size, reduction, upstream)

    local = padded // world
    logits = _shard(full, rank, world).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        logits,
        labels,
        group=None,
        vocab_start=rank * local,
        vocab_size=vocab_size,
        reduction=reduction,
    )
    assert loss.dtype == torch.float32
    assert loss.shape == (labels.shape if reduction == "none" else ())
    torch.testing.assert_close(loss.reshape(ref_loss.shape), ref_loss, **LOSS_TOL)
    loss.backward(upstream)
    torch.testing.assert_close(logits.grad, _shard(ref_grad, rank, world), **GRAD_TOL)
    if reduction == "none":
        assert torch.all(loss[labels == -100] == 0)


def _loss_worker(rank: int, world: int) -> None:
    seed = 1000
    for vocab_size, padded in ((250, 256), (256, 256)):
        for reduction in ("mean", "sum", "none"):
            seed += 10
            _check_vocab_parallel_ce(rank, world, vocab_size, padded, reduction, seed)


@pytest.mark.slow  # spawns processes
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_cross_entropy_matches_full_cross_entropy(
    world: int, request: pytest.FixtureRequest
) -> None:
    assert request.getfixturevalue(f"world{world}")["loss"] == [None] * world


def _check_causal_lm_loss(rank: int, world: int) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    vocab_size, padded = 250, 256
    full = _randn(5, 2, 9, padded, dtype=torch.float32)
    labels = torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))
    labels[1, :4] = -100
    local = padded // world
    for num_items in (None, torch.tensor(11)):
        ref_logits = full[..., :vocab_size].clone().requires_grad_()
        ref = ForCausalLMLoss(ref_logits, labels, vocab_size, num_items_in_batch=num_items)
        ref.backward()
        ref_grad = F.pad(ref_logits.grad, (0, padded - vocab_size))

        logits = _shard(full, rank, world).clone().requires_grad_()
        loss = loss_parallel_causal_lm_loss(
            logits,
            labels,
            group=None,
            vocab_start=rank * local,
            vocab_size=vocab_size,
            num_items_in_batch=num_items,
        )
        torch.testing.assert_close(loss, ref, **LOSS_TOL)
        loss.backward()
        torch.testing.assert_close(logits.grad, _shard(ref_grad, rank, world), **GRAD_TOL)


def _check_bfloat16_logits(rank: int, world: int) -> None:
    # Low-precision logits are upcast: the loss is float32, the grad keeps bf16.
    full = (_randn(6, 5, 64, dtype=torch.float32) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 64, (5,), generator=torch.Generator().manual_seed(6))
    ref_loss, ref_grad = _reference_ce(full, labels, 64, "mean", None)
    logits = _shard(full, rank, world).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        logits, labels, group=None, vocab_start=rank * (64 // world)
    )
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, **LOSS_TOL)
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad, _shard(ref_grad, rank, world))


def _check_bad_labels(rank: int, world: int) -> None:
    # A label in the vocab padding belongs to no shard: every rank must raise, so
    # none is left blocked in a later collective.
    logits = _randn(7, 4, 128 // world, dtype=torch.float32)
    labels = torch.tensor([3, 125, -100, 7])
    # (a TPError, which is a ValueError, named before any collective)
    with pytest.raises(ValueError, match=r"label 125 at position \[1\] is outside the vocabulary \[0, 120\)"):
        vocab_parallel_cross_entropy(
            logits, labels, group=None, vocab_start=rank * (128 // world), vocab_size=120
        )
    dist.barrier()


def _loss_extras_worker(rank: int, world: int) -> None:
    _check_causal_lm_loss(rank, world)
    _check_bfloat16_logits(rank, world)
    _check_bad_labels(rank, world)


@pytest.mark.slow  # spawns processes
def test_causal_lm_loss_bf16_and_label_checks(world2: CaseResults) -> None:
    assert world2["loss extras"] == [None, None]


# --------------------------------------------------------------------------- in-process


@pytest.mark.parametrize(
    ("logits_shape", "labels_shape", "kwargs", "message"),
    [
        ((2, 3, 8), (2, 4), {}, r"labels shape \(2, 4\) must equal"),
        ((2, 8), (2,), {"reduction": "avg"}, "reduction must be one of"),
        ((2, 8), (2,), {"vocab_start": -1}, "vocab_start must be >= 0"),
        ((2, 8), (2,), {"vocab_size": 0}, "vocab_size must be positive"),
    ],
)
def test_loss_argument_validation(
    logits_shape: tuple[int, ...],
    labels_shape: tuple[int, ...],
    kwargs: dict[str, object],
    message: str,
) -> None:
    # Validation runs before any collective, so no process group is needed.
    call = {"group": None, "vocab_start": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        vocab_parallel_cross_entropy(
            torch.zeros(logits_shape), torch.zeros(labels_shape, dtype=torch.long), **call
        )


def test_loss_rejects_float_labels() -> None:
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        vocab_parallel_cross_entropy(torch.zeros(2, 8), torch.zeros(2), group=None, vocab_start=0)


@pytest.mark.slow  # spawns processes
def test_run_distributed_propagates_child_failures() -> None:
    with pytest.raises(AssertionError, match="deliberate failure on rank 1"):
        run_distributed(_failing_worker, 2)


@pytest.mark.slow  # spawns processes
def test_run_cases_fails_only_the_failing_case(world2: CaseResults) -> None:
    # the launch of every other world-2 case here: they ran after the failure (and pass)
    with pytest.raises(AssertionError, match=r"case 'deliberate failure' failed on rank 1:(.|\n)*"
                                             r"deliberate failure on rank 1"):
        world2["deliberate failure"]  # noqa: B018 - reading the case raises its failure
    assert world2["collectives"] == [None, None]
