"""Roles come from the dataflow, never from names; bad input gets a clear error."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist import CaseResults, run_cases
from test_transform import grad_errors
from torch import nn

import tpcompile
from tpcompile import Role, TPError
from tpcompile.tools.presets import tiny_config

HEADS, HD, HIDDEN, VOCAB = 4, 16, 64, 256


class Zork(nn.Module):
    """A transformer block whose attribute names say nothing about what they are."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.LayerNorm(HIDDEN)
        self.a = nn.Linear(HIDDEN, 3 * HIDDEN)  # fused q|k|v, GPT-2 style
        self.b = nn.Linear(HIDDEN, HIDDEN)
        self.q = nn.LayerNorm(HIDDEN)
        self.c = nn.Linear(HIDDEN, 256, bias=False)  # fused gate|up
        self.d = nn.Linear(128, HIDDEN, bias=False)
        self.w = HIDDEN  # a hard-coded width, like GPT-2's split_size: fixed up per rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        u, v, w = self.a(self.p(x)).split(self.w, dim=-1)
        u, v, w = (t.view(bsz, seq, -1, HD).transpose(1, 2) for t in (u, v, w))
        y = F.scaled_dot_product_attention(u, v, w, is_causal=True)
        x = x + self.b(y.transpose(1, 2).reshape(bsz, seq, -1))
        g, h = self.c(self.q(x)).chunk(2, dim=-1)
        return x + self.d(F.silu(g) * h)


class Blorp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.s = nn.ModuleList([Zork() for _ in range(2)])
        self.n = nn.LayerNorm(HIDDEN)
        self.h = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.t(input_ids)
        for blk in self.s:
            x = blk(x)
        return self.h(self.n(x))


EXPECTED = {
    "t.weight": Role.VOCAB_EMBEDDING,
    "s.0.a.weight": Role.COLUMN,
    "s.0.a.bias": Role.SHARDED,
    "s.0.b.weight": Role.ROW,
    "s.0.b.bias": Role.REPLICATED,
    "s.0.c.weight": Role.COLUMN,
    "s.0.d.weight": Role.ROW,
    "s.1.a.weight": Role.COLUMN,
    "s.1.d.weight": Role.ROW,
    "s.0.p.weight": Role.REPLICATED,
    "h.weight": Role.LM_HEAD,
}


def test_meaningless_names_get_the_right_plan() -> None:
    with torch.device("meta"):
        model = Blorp()
    plan = tpcompile.plan_model(model, tp=2)
    for fqn, role in EXPECTED.items():
        assert plan.params[fqn].role is role, (fqn, plan.params[fqn].role)
    # fused q|k|v: rank 0 holds [q_0 | k_0 | v_0], read off the split in the graph
    runs = plan.params["s.0.a.weight"].runs
    assert runs[0] == [[0, 32], [64, 96], [128, 160]]
    assert plan.params["s.0.c.weight"].layout == "fused"  # gate_0 | up_0
    assert plan.params["s.0.c.weight"].runs[1] == [[64, 128], [192, 256]]
    assert plan.modules["s.0"].attr_fixups == {"w": [64, 32]}


def _blorp(rank: int, world: int, cls: type[nn.Module] = Blorp) -> tuple[float, float]:
    """Output and gradient errors of ``cls()`` transformed at ``world`` (a squared-mean loss)."""
    torch.manual_seed(0)
    ref = cls()
    model = copy.deepcopy(ref)
    tpcompile.transform(model, tp=world)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    want, got = ref(ids), model(ids)
    want.square().mean().backward()
    got.square().mean().backward()
    return (got - want).abs().max().item(), max(grad_errors(model, ref, world).values())


class Wobble(nn.Module):
    """A short causal convolution over positions as older code writes it: windows by
    ``unfold``, taps read backwards by ``flip``, an in-place ``masked_fill_``, and a
    ``cat`` with an empty 1-D piece (XLM's cache of no earlier tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.taps = nn.Parameter(torch.randn(2 * HIDDEN, 3))
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        h = self.up(x).masked_fill_(~keep, 0.0)
        h = torch.cat([torch.zeros(0, device=h.device), h], dim=1)  # [B, S, C]
        windows = F.pad(h.transpose(1, 2), (2, 0)).unfold(-1, 3, 1)  # [B, C, S, 3]
        h = (windows.flip(-1) * self.taps[None, :, None]).sum(-1).transpose(1, 2)
        return x + self.down(F.silu(h))


class Wobbles(nn.Module):
    """Its blocks walked beside a per-layer list (Ergo's ``zip(config.layer_types,
    self.layers, strict=True)``): a capture cut to one block cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.kinds = ["short_conv"] * 3
        self.s = nn.ModuleList([Wobble() for _ in self.kinds])
        self.h = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, keep = self.t(input_ids), (input_ids > 3)[..., None]
        for _kind, blk in zip(self.kinds, self.s, strict=True):
            x = blk(x, keep)
        return self.h(x)


def test_positional_windows_split_by_channels_and_uncuttable_stacks_are_traced_whole() -> None:
    from tpcompile.capture import capture

    with torch.device("meta"):
        model = Wobbles()
    assert capture(model).stacks.members == {}  # traced whole once the cut one failed
    plan = tpcompile.plan_model(model, tp=2)
    for i in range(3):
        assert plan.params[f"s.{i}.up.weight"].role is Role.COLUMN
        assert plan.params[f"s.{i}.taps"].role is Role.SHARDED
        assert plan.params[f"s.{i}.down.weight"].role is Role.ROW


class Sometimes(nn.Module):
    """Blocks of one structure called differently (NeoMME's value embeddings): every
    second block also gets a lookup of its own table, added to its split features."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.extra = nn.Embedding(VOCAB, 2 * HIDDEN)
        self.s = nn.ModuleList([Plus() for _ in range(4)])
        self.h = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, extra = self.t(input_ids), self.extra(input_ids)
        for i, blk in enumerate(self.s):
            x = blk(x, extra if i % 2 else None)
        return self.h(x)


class BlockStack(nn.Module):
    """Token ids through an embedding, a stack of ``blocks`` (each ``x -> x``) and a head."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.s = nn.ModuleList(blocks)
        self.h = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.t(input_ids)
        for blk in self.s:
            x = blk(x)
        return self.h(x)


class Shifted(BlockStack):
    """Swin's window attention in miniature: a per-head position bias read from a table
    by a fixed index (``table[index].view(N, N, heads)``), and blocks of one structure
    whose ``shift`` setting alone sends every second one down another path: it adds a
    replicated mask and reshapes its scores by the module's global head count."""

    def __init__(self) -> None:
        super().__init__([Windowed(shift=i % 2) for i in range(4)])


class Windowed(nn.Module):
    def __init__(self, shift: int) -> None:
        super().__init__()
        self.shift, self.heads = shift, HEADS
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o = nn.Linear(HIDDEN, HIDDEN)
        self.table = nn.Parameter(torch.randn(17, HEADS))
        self.register_buffer("index", torch.arange(81).remainder(17), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, -1, HD).permute(2, 0, 3, 1, 4)
        bias = self.table[self.index[: n * n]].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)
        scores = q @ k.transpose(-1, -2) + bias
        if self.shift:  # only the shifted blocks: a mask, and the scores viewed by heads
            mask = torch.triu(torch.full((n, n), -1e4, device=x.device), diagonal=1)
            scores = (scores.view(b, 1, self.heads, n, n) + mask).view(b, -1, n, n)
        out = scores.softmax(-1) @ v
        return x + self.o(out.transpose(1, 2).reshape(b, n, -1))


class Plus(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None) -> torch.Tensor:
        h = self.up(x)
        if extra is not None:
            h = h + extra
        return x + self.down(F.silu(h))


class Factored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(VOCAB, 16)
        self.proj = nn.Linear(16, HIDDEN, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.table(input_ids))


class TiedRead(nn.Module):
    """The root reads a weight under a tied name of its own (NeoMME's
    ``hidden @ self.unembedding_projection.weight``, tied to the embedding's projection)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = Factored()
        self.s = nn.ModuleList([Plus() for _ in range(2)])
        self.unproj = nn.Linear(16, HIDDEN, bias=False)
        self.unproj.weight = self.emb.proj.weight
        self.h = nn.Linear(16, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for blk in self.s:
            x = blk(x, None)
        return self.h(x @ self.unproj.weight)


class Squeeze(nn.Module):
    """SEW's upsampling: a projection whose output the model returns (a head, gathered
    whole), reshaped from channels into positions by an attribute that equals tp."""

    def __init__(self) -> None:
        super().__init__()
        self.projection = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.factor = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.projection(x))
        b, s, d = h.size()
        return h.reshape(b, s, self.factor, d // self.factor).reshape(b, s * self.factor, d // self.factor)


class Upsampled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.s = nn.ModuleList([Plus() for _ in range(2)])
        self.up = Squeeze()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.t(input_ids)
        for blk in self.s:
            x = blk(x, None)
        return self.up(x)


class Pyramid(nn.Module):
    """A detector's and a decoder's spatial ops on split channels: resized (nearest,
    bilinear), shifted (``roll``, Swin's windows), a transposed convolution contracting
    them, and ``nn.Unfold``'s taps (ConvBERT) read by a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Conv2d(HIDDEN, 2 * HIDDEN, 1)
        self.deconv = nn.ConvTranspose2d(2 * HIDDEN, HIDDEN, (2, 1), stride=(2, 1))
        self.widen = nn.Conv2d(HIDDEN, 2 * HIDDEN, 1)
        self.mix = nn.Linear(2 * HIDDEN * 3, HIDDEN)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.t(input_ids).transpose(1, 2)[..., None]  # [B, C, S, 1]
        s = x.shape[2]
        h = F.gelu(self.up(x))
        h = F.interpolate(h, scale_factor=(2, 1), mode="nearest")
        h = torch.roll(h, shifts=1, dims=2)
        h = F.interpolate(h, size=(s + 1, 2), mode="bilinear", align_corners=False)
        h = F.gelu(self.widen(self.deconv(h)))
        return self.mix(F.unfold(h, kernel_size=(3, 1), padding=(1, 0)).transpose(1, 2))


class Deformable(nn.Module):
    """A deformable attention's sampling (RT-DETR, Mask2Former): each head's values,
    heads folded into the batch dim, sampled at points the head computes itself."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.heads, self.head_dim = 4, HIDDEN // 4
        self.value = nn.Linear(HIDDEN, HIDDEN)
        self.offsets = nn.Linear(HIDDEN, 4 * 2)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.t(input_ids)
        b, s, _ = x.shape
        h, d = self.heads, self.head_dim
        v = self.value(x).view(b, s, h, d).permute(0, 2, 3, 1).reshape(b * h, d, s, 1)
        grid = torch.tanh(self.offsets(x)).view(b, s, h, 1, 2).permute(0, 2, 1, 3, 4).reshape(b * h, s, 1, 2)
        sampled = F.grid_sample(v, grid, align_corners=False)  # [b * heads, head_dim, s, 1]
        return self.out(sampled.view(b, h, d, s).permute(0, 3, 1, 2).reshape(b, s, h * d))


class SizeReader(nn.Module):
    """Attention as older code writes it (TrOCR, BLIP, GroupViT): the width read off the
    input with ``.size()``, a fused q|k|v reshaped in a helper by ``width // heads``, and
    the heads merged back by the width read, not by an attribute; an attribute the width
    read is asserted equal to (FSMT) keeps its global value."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.width = HEADS, HIDDEN
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def _split(self, t: torch.Tensor, bsz: int, seq: int, width: int) -> torch.Tensor:
        return t.reshape(bsz, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, width = x.size()
        assert width == self.width
        q, k, v = self._split(self.qkv(x), bsz, seq, width)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(bsz, seq, width))


class SizeReaders(BlockStack):
    def __init__(self) -> None:
        super().__init__([SizeReader() for _ in range(2)])


def test_sizes_read_at_run_time_are_made_local_at_their_lines() -> None:
    with torch.device("meta"):
        model = SizeReaders()
    plan = tpcompile.plan_model(model, tp=2)
    assert plan.params["s.1.qkv.weight"].role is Role.COLUMN and plan.params["s.1.out.weight"].role is Role.ROW
    fix = plan.modules["s.1"].attr_fixups
    code = SizeReader.forward.__code__
    merge, split = f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno + 5}", code.co_firstlineno + 3
    # the merge's width (64 -> 32) and the split's heads and head dim (4 -> 2; 16 stays 16,
    # where the width read over the local head count would give 32): by the lines in forward
    assert fix[f"@{merge}"] == [3, [[2, HIDDEN // 2]]]
    assert fix[f"@{merge.rsplit(':', 1)[0]}:{split}"] == [5, [[2, 3], [3, HEADS // 2], [4, HD]]]
    assert "width" not in fix  # asserted equal to the input's width: it was made 32 and the assert failed


def test_deformable_sampling_splits_heads() -> None:
    with torch.device("meta"):
        model = Deformable()
    plan = tpcompile.plan_model(model, tp=2)
    roles = {n: plan.params[f"{n}.weight"].role for n in ("value", "offsets", "out")}
    assert roles == {"value": Role.COLUMN, "offsets": Role.COLUMN, "out": Role.ROW}


def test_spatial_ops_keep_channels_split() -> None:
    with torch.device("meta"):
        model = Pyramid()
    plan = tpcompile.plan_model(model, tp=2)
    roles = {n: plan.params[f"{n}.weight"].role for n in ("up", "deconv", "widen")}
    # the transposed convolution's weight is [C_in, C_out, ...]: it contracts dim 0
    assert roles == {"up": Role.COLUMN, "deconv": Role.ROW, "widen": Role.COLUMN}
    assert plan.params["deconv.weight"].shard_dim == 0
    assert plan.params["mix.weight"].shard_dim == 1  # each rank's channels' three taps


def test_no_size_read_after_a_gathered_head_is_made_local() -> None:
    with torch.device("meta"):
        model = Upsampled()
    plan = tpcompile.plan_model(model, tp=2)
    assert plan.params["up.projection.weight"].role is Role.LM_HEAD
    # the reshape after the head sees the gathered output: `factor` keeps its value (it
    # was made 1, which skipped the reshape and returned the wrong shape)
    assert "up" not in plan.modules or not plan.modules["up"].attr_fixups


def test_blocks_called_differently_are_traced_apart() -> None:
    from tpcompile.capture import capture

    with torch.device("meta"):
        model = Sometimes()
    # block 1 stands for the blocks that get the extra input, block 0 for the others (one
    # block stood for all four: the ones adding the extra whole crashed at run time)
    assert capture(model).stacks.members == {"s": [0, 1, 0, 1]}


class NormScaled(nn.Module):
    """PEFT DeLoRA's scaling: the projection's output times a norm of its own weight,
    over the split output features (``over_split``: a partial norm on each rank, unless
    the weight stays whole) or per output feature (split with them)."""

    def __init__(self, over_split: bool) -> None:
        super().__init__()
        self.over_split = over_split
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.over_split:
            return x * self.up.weight.norm(dim=0) + self.down(F.silu(h))
        return x + self.down(F.silu(h * self.up.weight.norm(dim=1)))


class NormScaledStack(BlockStack):
    def __init__(self, over_split: bool = True) -> None:
        super().__init__([NormScaled(over_split), NormScaled(over_split)])


class NormPerFeatureStack(NormScaledStack):
    def __init__(self) -> None:
        super().__init__(over_split=False)


def test_a_weight_reduced_over_its_split_dim_stays_whole() -> None:
    with torch.device("meta"):
        whole, split = NormScaledStack(), NormPerFeatureStack()
    plan = tpcompile.plan_model(whole, tp=2)
    # each rank's rows would give a partial norm taken as whole: nothing shows in a shape
    assert plan.params["s.0.up.weight"].shard_dim is None
    assert "reads s.0.up.weight whole along dim 0" in plan.params["s.0.up.weight"].whole_because
    # a norm per output feature is split with those features
    assert tpcompile.plan_model(split, tp=2).params["s.0.up.weight"].role is Role.COLUMN


def test_a_weight_reduced_by_its_own_module_is_exact(world2: CaseResults) -> None:
    assert_exact(world2, "norm_scaled")
    assert_exact(world2, "norm_per_feature")


@pytest.fixture(scope="module")
def world2() -> CaseResults:
    """This module's multi-process cases, in one launch."""
    return run_cases(2, {"blorp": (_blorp,), "bad tp": (_bad_tp,), "wobbles": (_blorp, Wobbles),
                         "sometimes": (_blorp, Sometimes), "tied_read": (_blorp, TiedRead),
                         "upsampled": (_blorp, Upsampled), "pyramid": (_blorp, Pyramid),
                         "deformable": (_blorp, Deformable), "size_readers": (_blorp, SizeReaders),
                         "shifted": (_blorp, Shifted), "gated": (_blorp, GatedStack),
                         "selected": (_blorp, SelectedStack), "head_biased": (_blorp, HeadBiasedStack),
                         "norm_scaled": (_blorp, NormScaledStack), "norm_per_feature": (_blorp, NormPerFeatureStack)})


def assert_exact(results: CaseResults, case: str) -> None:
    """Every rank's output and gradient errors of ``case`` (a :func:`_blorp` run) within 1e-5."""
    for out_err, grad_err in results[case]:
        assert out_err < 1e-5 and grad_err < 1e-5


def test_blocks_called_differently_are_exact(world2: CaseResults) -> None:
    assert_exact(world2, "sometimes")


def test_blocks_set_differently_are_traced_apart_and_exact(world2: CaseResults) -> None:
    from tpcompile.capture import capture

    with torch.device("meta"):
        model = Shifted()
    # the shifted blocks' own path is traced (one block stood for all four: the shifted
    # ones' view by the global head count crashed at run time)
    assert capture(model).stacks.members == {"s": [0, 1, 0, 1]}
    plan = tpcompile.plan_model(model, tp=2)
    # the position-bias table splits by heads with the attention, not kept whole
    assert plan.params["s.0.table"].shard_dim == 1 and plan.params["s.1.table"].shard_dim == 1
    assert plan.modules["s.1"].attr_fixups.get("heads") == [HEADS, HEADS // 2]
    assert_exact(world2, "shifted")


def test_spatial_ops_on_split_channels_are_exact(world2: CaseResults) -> None:
    assert_exact(world2, "pyramid")


def test_deformable_sampling_is_exact(world2: CaseResults) -> None:
    assert_exact(world2, "deformable")


def test_sizes_read_at_run_time_are_exact(world2: CaseResults) -> None:
    # a batch and length other than the capture's: the sites' sizes are the features' only
    assert_exact(world2, "size_readers")


def test_a_gathered_head_reshaped_after_it_is_exact(world2: CaseResults) -> None:
    assert_exact(world2, "upsampled")


def test_a_weight_read_under_its_tied_name_outside_is_local_there(world2: CaseResults) -> None:
    # crashed on a DTensor: only the first of the tied names was swapped for the root's forward
    assert_exact(world2, "tied_read")


def test_positional_windows_exact_outputs_and_grads(world2: CaseResults) -> None:
    assert_exact(world2, "wobbles")


@pytest.mark.slow
def test_meaningless_names_exact_outputs_and_grads(world2: CaseResults) -> None:
    assert_exact(world2, "blorp")


def test_plan_json_round_trip() -> None:
    with torch.device("meta"):
        model = Blorp()
    plan = tpcompile.plan_model(model, tp=2)
    again = tpcompile.Plan.from_json(plan.to_json())
    assert again.to_dict() == plan.to_dict()


# ---- clear errors --------------------------------------------------------------------


def test_no_process_group_error() -> None:
    with pytest.raises(TPError, match="initialized process group"):
        tpcompile.transform(Blorp(), tp=2)


def _bad_tp(rank: int, world: int) -> str:
    try:
        tpcompile.transform(Blorp(), tp=3)
    except TPError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_world_size_not_divisible_error(world2: CaseResults) -> None:
    for msg in world2["bad tp"]:
        assert "not divisible by tp=3" in msg and "[1, 2]" in msg


def test_heads_not_divisible_lists_working_tp() -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=4))
    # 4 heads at tp=3 are dealt 2/1/1 with padding heads; at tp=8 a rank would hold none
    assert tpcompile.plan_model(model, tp=3).params["model.layers.0.self_attn.q_proj.weight"].layout == "padded"
    with pytest.raises(TPError, match=r"tp=8.*tp values that work for it: \[1, 2, 4\]"):
        tpcompile.plan_model(model, tp=8)


class Weird(nn.Module):
    """Sharded features go through an op no rule knows (a cumulative product)."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Linear(HIDDEN, 128)
        self.down = nn.Linear(128, HIDDEN)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.cumprod(self.up(self.e(input_ids)), dim=1))


def test_unknown_op_strict_names_module_and_op() -> None:
    with torch.device("meta"):
        model = Weird()
    with pytest.raises(TPError, match=r"cumprod.*Add a rule"):
        tpcompile.plan_model(model, tp=2)


class Routed(nn.Module):
    """A router's scores gathered at its top-2 choices scale an MLP (DeepSeek-V4's gate)."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(VOCAB, HIDDEN)
        self.gate = nn.Linear(HIDDEN, 8, bias=False)
        self.up = nn.Linear(HIDDEN, 128)
        self.down = nn.Linear(128, HIDDEN)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.e(input_ids)
        scores = self.gate(x).softmax(-1)
        weight = scores.gather(-1, scores.topk(2, dim=-1).indices).sum(-1, keepdim=True)
        return self.down(torch.relu(self.up(x))) * weight


def test_gathered_router_scores_stay_whole_and_the_mlp_splits() -> None:
    # the gather reads the scores across the router's features: they tie, the router is
    # one unit kept whole, and strict planning needs no rule from the user
    with torch.device("meta"):
        model = Routed()
    roles = tpcompile.plan_model(model, tp=2).roles()
    assert (roles["gate.weight"], roles["up.weight"], roles["down.weight"]) == ("replicated", "column", "row")


def test_unknown_op_non_strict_replicates_with_warning() -> None:
    with torch.device("meta"):
        model = Weird()
    with pytest.warns(UserWarning, match="cumprod"):
        plan = tpcompile.plan_model(model, tp=2, strict=False)
    assert plan.params["up.weight"].role is Role.REPLICATED
    # with its input replicated, `down` is no longer a row: it feeds the output directly
    assert plan.params["down.weight"].role is not Role.ROW


def test_user_rule_places_unknown_op() -> None:
    from tpcompile.rules.pointwise import pointwise

    from tpcompile.analysis.propagate import rule

    @rule(torch.ops.aten.cumprod)
    def cumprod_over_tokens(an, node):  # cumprod over tokens is independent per feature
        return pointwise(an, node)

    with torch.device("meta"):
        model = Weird()
    plan = tpcompile.plan_model(model, tp=2, rules=[cumprod_over_tokens])
    assert plan.params["up.weight"].role is Role.COLUMN
    assert plan.params["down.weight"].role is Role.ROW


class Scaled(nn.Module):
    """xIELU's pattern: a learnable [1] scalar multiplies the split MLP features."""

    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(VOCAB, HIDDEN)
        self.up = nn.Linear(HIDDEN, 128, bias=False)
        self.alpha = nn.Parameter(torch.ones(1))
        self.down = nn.Linear(128, HIDDEN, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(self.e(input_ids)) * self.alpha)


def test_backward_check_catches_a_partial_gradient_a_rule_forgot() -> None:
    """A rule that carries the split features through ``mul`` but forgets the scalar it
    meets (as the pointwise rule once skipped numel-1 operands) leaves ``alpha`` with a
    partial gradient on each rank: the backward check refuses the plan, naming it, or
    (non-strict) keeps the region replicated; the real rules sum it."""
    from tpcompile.analysis.propagate import rule
    from tpcompile.analysis.state import Feat

    @rule(torch.ops.aten.mul)
    def careless_mul(an, node):
        v = an.val(node.args[0])
        return an.feat(an.aligned_to(v.atoms, an.ndim(node))) if isinstance(v, Feat) else None

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(TPError, match=r"alpha meets split features in op mul.*partial gradient"):
        tpcompile.plan_model(model, tp=2, rules=[careless_mul])
    with pytest.warns(UserWarning, match="partial gradient"):
        plan = tpcompile.plan_model(model, tp=2, rules=[careless_mul], strict=False)
    assert plan.params["up.weight"].role is Role.REPLICATED
    plan = tpcompile.plan_model(model, tp=2)
    assert plan.params["up.weight"].role is Role.COLUMN
    assert plan.params["alpha"].role is Role.GRAD_ALLREDUCE


def test_a_rule_that_misplaces_features_is_refused_by_name() -> None:
    """A rule returning features shaped unlike its value (a flattened refill read as
    rows, as a masked_scatter rule once did) would deal features to the wrong
    positions: the op is refused naming the rule, never planned on."""
    from tpcompile.analysis.propagate import rule
    from tpcompile.analysis.state import Feat

    @rule(torch.ops.aten.mul)
    def doubled_mul(an, node):
        v = an.val(node.args[0])
        if not isinstance(v, Feat):
            return None
        atoms = an.aligned_to(v.atoms, an.ndim(node))
        return an.feat(np.concatenate([atoms, atoms], axis=-1))  # twice the features there are

    with torch.device("meta"):
        model = Scaled()
    with pytest.raises(TPError, match=r"rule doubled_mul gave features shaped \(1, 1, 256\) to a value shaped"):
        tpcompile.plan_model(model, tp=2, rules=[doubled_mul])


def test_overrides_force_replicated_and_reject_contradictions() -> None:
    with torch.device("meta"):
        model = Blorp()
    plan = tpcompile.plan_model(model, tp=2, overrides={"re:s\\.\\d+\\.[cd]\\.weight": "replicated"})
    assert plan.params["s.1.c.weight"].role is Role.REPLICATED
    assert plan.params["s.1.a.weight"].role is Role.COLUMN
    with pytest.raises(TPError, match="contradicts the dataflow"):
        tpcompile.plan_model(model, tp=2, overrides={"s.0.b.weight": "column"})
    with pytest.raises(TPError, match="matches no parameter"):
        tpcompile.plan_model(model, tp=2, overrides={"nope": "replicated"})


def test_te_backend_explains_itself_without_cuda() -> None:
    from torch.distributed.device_mesh import DeviceMesh

    from tpcompile.runtime.backend import make_backend as _backend

    with pytest.raises(TPError, match="backend='te'"):
        _backend("te", DeviceMesh.__new__(DeviceMesh))
    with pytest.raises(TPError, match="backend must be one of"):
        _backend("mystery", DeviceMesh.__new__(DeviceMesh))


def _fixups(model: torch.nn.Module, tp: int) -> dict[str, dict[str, list[int]]]:
    plan = tpcompile.plan_model(model, tp=tp)
    return {k: v.attr_fixups for k, v in plan.modules.items() if v.attr_fixups}


def test_fixups_are_exactly_the_sizes_the_trace_uses() -> None:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
        llama_kv1 = AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=1))
    fix = _fixups(gpt2, 2)
    # embed_dim / num_heads / config.n_embd equal sharded sizes too, but the forward
    # never turns them into a shape: only split_size and Conv1D.nf are rewritten
    assert fix["transformer.h.0.attn"] == {"split_size": [64, 32]}
    assert fix["transformer.h.0.attn.c_attn"] == {"nf": [192, 96]}
    assert _fixups(llama_kv1, 2)["model.layers.1.self_attn"] == {"num_key_value_groups": [4, 2]}


def test_coincidental_attribute_values_are_left_alone() -> None:
    from tpcompile.tools.presets import build_meta_model

    # Gemma-2-9B: sliding_window 4096 equals the query width; Llama-3-8B: 32 layers
    # equal 32 heads. Neither attribute shapes a tensor in attention.
    assert _fixups(build_meta_model("gemma2"), 8) == {}
    assert _fixups(build_meta_model("llama"), 8) == {}


def test_a_list_of_per_head_layers_is_traced_whole() -> None:
    # StableLM's qk_layernorm zips a ModuleList of per-head LayerNorms with the heads: cut
    # like a stack of blocks, the capture ran one head (and the analysis crashed in numpy);
    # traced whole, the zip's dependence on the global head count is refused by name
    import transformers as hf

    cfg = hf.StableLmConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4, vocab_size=128, qk_layernorm=True)
    with torch.device("meta"):
        model = hf.StableLmForCausalLM(cfg)
    from tpcompile.capture import capture

    assert set(capture(model).stacks.members) == {"model.layers"}  # the decoder layers only
    with pytest.raises(TPError, match=r"q_layernorm\.norms\.\d+: op layer_norm"):
        tpcompile.plan_model(model, tp=2)
    assert tpcompile.plan_model(hf.StableLmForCausalLM(hf.StableLmConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=128)).to("meta"), tp=2).over_ideal() < 1.05  # without the per-head norms it splits


def test_a_meta_model_is_captured_once_until_it_changes() -> None:
    """Planning, the cost model and the layout search share one capture of a meta model;
    a change the forward could see (config, attention implementation, a module, a hook)
    captures afresh, and a model with real weights is never kept."""
    from tpcompile.capture import capture
    from tpcompile.tools.presets import build_meta_model

    model = build_meta_model("llama", config=tiny_config("llama"))
    first = capture(model)
    assert capture(model) is first
    assert capture(model, cut_stacks=False) is not first  # another key, not the memo
    model.config._attn_implementation = "eager" if model.config._attn_implementation != "eager" else "sdpa"
    second = capture(model)
    assert second is not first and capture(model) is second
    handle = model.model.norm.register_forward_hook(lambda *_: None)
    assert capture(model) is not second
    handle.remove()
    model.model.layers = model.model.layers[:1]
    assert len(capture(model).stacks.members.get("model.layers", [0])) == 1

    real = Blorp()
    assert capture(real) is not capture(real)
    # a module attribute the forward reads (what the fix-ups make rank-local)
    meta = build_meta_model("llama", config=tiny_config("llama"))
    cap = capture(meta)
    meta.model.layers[0].self_attn.scaling = 0.5
    assert capture(meta) is not cap


@pytest.mark.slow
def test_the_analysis_settles_however_many_passes_it_takes() -> None:
    # every pass but the last keeps one more block whole, so the passes are bounded by
    # the blocks; HY-V4 takes 38 (a fixed cap of 12 refused it)
    from transformers import AutoConfig

    from tpcompile.tools.verify import build_small_model

    torch.manual_seed(0)
    model = build_small_model(AutoConfig.for_model("hy_v4"), tp=2, task="causal-lm")
    plan = tpcompile.plan_model(model, tp=2)
    assert plan.stats["analysis_passes"] > 12
    assert any(p.role is Role.COLUMN for p in plan.params.values())


class _SharedAndSliced(nn.Module):
    """A module held under two names and blocks reached through a slice of their list:
    export then names modules by the way the forward reached them."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.alias = self.shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[1:]:
            x = layer(x)
        return self.alias(x)


def test_captured_modules_go_by_their_own_names() -> None:
    from tpcompile.analysis.propagate import innermost_module
    from tpcompile.capture import capture

    cap = capture(_SharedAndSliced(), example_args=(torch.randn(2, 8),), cut_stacks=False)
    # not ``layers.slice(1, None, None).0`` or ``alias``: the names parameters' owners have
    assert {innermost_module(n) for n in cap.graph.nodes} - {""} == {"layers.1", "layers.2", "shared"}


class _Gated(nn.Module):
    """A projection whose own forward applies its whole vectors to its input before a
    split contraction, beside a sub-module it calls (AdaLoRA's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.a = nn.Parameter(torch.randn(4, HIDDEN) * 0.1)
        self.e = nn.Parameter(torch.randn(4, 1))
        self.b = nn.Parameter(torch.randn(4 * HIDDEN, 4) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ (self.a * self.e).T @ self.b.T


class _Folded(nn.Module):
    """A row projection plus the wrapper's own row product of its input, folded into
    groups and summed (MiSS's shape): two partial sums, one module inside the other."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(4 * HIDDEN, HIDDEN)
        self.block = nn.Parameter(torch.randn(4, HIDDEN) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x.reshape(*x.shape[:-1], -1, 4).sum(-2) @ self.block


class _GatedFolded(nn.Module):
    def __init__(self, folded: bool) -> None:
        super().__init__()
        self.up, self.down = _Gated(), _Folded() if folded else nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class GatedStack(BlockStack):
    def __init__(self) -> None:
        super().__init__([_GatedFolded(folded=i == 1) for i in range(2)])


def test_whole_vectors_before_a_split_contraction_sum_their_gradients_and_nested_rows_stay_whole(
        world2: CaseResults) -> None:
    with torch.device("meta"):
        model = GatedStack()
    plan = tpcompile.plan_model(model, tp=2)
    p = plan.params
    assert p["s.0.up.b"].shard_dim == 0 and p["s.0.up.base.weight"].shard_dim == 0  # split like the output
    # a and e meet no split feature themselves: their gradients are each rank's part
    assert p["s.0.up.a"].role is Role.GRAD_ALLREDUCE and p["s.0.up.e"].role is Role.GRAD_ALLREDUCE
    # base all-reduces where it returns and the wrapper again: the region stays whole
    assert p["s.1.down.base.weight"].shard_dim is None and p["s.1.down.block"].shard_dim is None
    assert "joins one its caller computes" in p["s.1.down.base.weight"].whole_because
    assert_exact(world2, "gated")  # both were off before: gradients, and the forward


class _Selected(nn.Module):
    """An MLP run on the positions a boolean mask over batch and time selects
    (``h[mask]``: one index tensor spanning two dims), scattered back."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x[..., 0] > 0
        picked = self.down(torch.relu(self.up(x)[mask]))
        return x + torch.zeros_like(x).masked_scatter(mask.unsqueeze(-1), picked)


class SelectedStack(BlockStack):
    def __init__(self) -> None:
        super().__init__([_Selected() for _ in range(2)])


def test_a_boolean_mask_over_several_dims_keeps_features_split(world2: CaseResults) -> None:
    with torch.device("meta"):
        model = SelectedStack()
    plan = tpcompile.plan_model(model, tp=2)
    # the mask spans batch and time, not the features (it was read as one dim: the rule
    # then gave its output the wrong shape and the transform failed)
    assert plan.params["s.0.up.weight"].role is Role.COLUMN and plan.params["s.0.down.weight"].role is Role.ROW
    assert_exact(world2, "selected")


class _HeadBiased(nn.Module):
    """Attention adding a per-head parameter viewed by a global count (Parakeet's
    ``bias_u.view(1, config.num_attention_heads, 1, head_dim)``): a shape site on a
    split parameter's view."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.bias_u = nn.Parameter(torch.randn(HEADS, HD) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, -1, HD).permute(2, 0, 3, 1, 4)
        q = q + self.bias_u.view(1, HEADS, 1, HD)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, n, -1))


class HeadBiasedStack(BlockStack):
    def __init__(self) -> None:
        super().__init__([_HeadBiased() for _ in range(2)])


def test_a_split_parameter_viewed_by_a_global_count_gets_a_shape_site(world2: CaseResults) -> None:
    with torch.device("meta"):
        model = HeadBiasedStack()
    plan = tpcompile.plan_model(model, tp=2)
    assert plan.params["s.0.bias_u"].shard_dim == 0  # by heads, with the attention
    assert any(k.startswith("@") for k in plan.modules["s.0"].attr_fixups)  # refused before
    assert_exact(world2, "head_biased")



def test_planning_keeps_each_modules_training_mode() -> None:
    # a PEFT model is in training mode around a base left in eval mode (dropout off);
    # the capture's eval() was undone with the root's flag for all, switching it on
    model = Blorp().train()
    model.s[0].eval()
    modes = {n: m.training for n, m in model.named_modules()}
    tpcompile.plan_model(model, tp=2)
    assert {n: m.training for n, m in model.named_modules()} == modes
