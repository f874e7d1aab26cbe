"""Shrink any Hugging Face config to a CPU-sized model that splits like the real one.

``verify`` checks a model's tensor-parallel split on a laptop: it needs a model of the
same classes and the same head / expert structure as the real checkpoint, but small
enough to run a forward and a backward in seconds on a few CPU processes.  What must not
change is how every sharded size relates to ``tp``: a model whose 71 heads do not divide
by 2 (Falcon-7B), whose single KV head is replicated on every rank, whose 60 experts are
uneven over 8 ranks (Qwen1.5-MoE) or whose 50257-token vocabulary needs padding (GPT-2)
takes a different code path in the compiler than a model where everything divides.
:func:`shrink_config` keeps those relations; see its docstring for the rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedConfig

from ..config import check_degree

__all__ = ["count_for_tp", "shrink_config", "size_for_tp"]

# Target sizes of the small model (before the tp relations push them up).
_LAYERS = 2
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 16
_HIDDEN = 64
_FFN = 128
_EXPERT_FFN = 32
_EXPERTS = 4
_TOP_K = 2
_VOCAB = 256
_POSITIONS = 128
_TARGET_POSITIONS = 64
_SOURCE_POSITIONS = 16  # Whisper-style encoders take exactly 2x this many frames
_SLIDING_WINDOW = 8
_LORA_RANK = 32
_ROPE_HEAD_DIM = 8
_PATCHES_PER_SIDE = 2
_STAGE_HEAD_DIM = 8  # a head's width in a staged vision model's first stage

# Field roles, by the name a config stores them under (raw keys, not attribute_map).
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_decoder_layers",
               "encoder_layers", "decoder_layers", "depth")  # depth: Qwen-VL / GLM-4V vision towers
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
              "decoder_attention_heads")
_KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model", "embed_dim")
_HEAD_DIM_KEYS = ("head_dim", "d_kv", "attention_head_dim")
_FFN_KEYS = ("intermediate_size", "n_inner", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
             "ffn_hidden_size", "shared_expert_intermediate_size")
_EXPERT_FFN_KEYS = ("moe_intermediate_size",)
# the shortest list read as one entry per layer by its length alone
_PER_LAYER_LENGTH = 6
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "top_k")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "original_max_position_embeddings",
                  "n_ctx")
_LORA_KEYS = ("q_lora_rank", "kv_lora_rank")
_MLA_DIM_KEYS = ("qk_nope_head_dim", "v_head_dim")
# Sizes that are the model width under another name when equal to it in the real config.
_HIDDEN_ALIASES = ("word_embed_proj_dim", "pooler_output_size", "projection_dim", "projection_size")
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "speech_config", "encoder",
                "decoder", "vision_tower_config")


def count_for_tp(real: int, tp: int, target: int) -> int:
    """A small count (heads, experts) that relates to ``tp`` exactly as ``real`` does.

    The result is ``real`` itself when ``real <= target`` or ``real < tp``; otherwise
    the smallest value ``>= max(target, tp)`` congruent to ``real`` modulo ``tp`` (so
    ``real % d`` is kept for every divisor ``d`` of ``tp``, and ``real >= tp`` stays
    true).

    Example:
        >>> count_for_tp(71, 2, 4), count_for_tp(32, 8, 4), count_for_tp(60, 8, 4)
        (5, 8, 12)
    """
    if real <= target or real < tp:
        return real
    low = max(target, tp)
    return min(real, low + (real - low) % tp)


def size_for_tp(real: int, tp: int, target: int, *, multiple: int = 1) -> int:
    """A small width (MLP, vocabulary) with ``real``'s remainder modulo ``tp``.

    The smallest ``v >= target`` (a multiple of ``multiple`` when that keeps the
    remainder) with ``v % tp == real % tp``; ``real`` itself if it is already small.

    Example:
        >>> size_for_tp(50257, 2, 256), size_for_tp(14336, 8, 128)
        (257, 128)
    """
    if real <= target:
        return real
    value = target + (real - target) % tp
    step = multiple * tp // math.gcd(multiple, tp)
    aligned = [v for v in range(value, value + step + 1) if v % tp == real % tp and v % multiple == 0]
    return min(real, aligned[0] if aligned else value)


def _get(data: dict[str, Any], keys: Sequence[str]) -> list[str]:
    """The keys of ``keys`` that ``data`` holds as plain integers."""
    return [k for k in keys if isinstance(data.get(k), int) and not isinstance(data.get(k), bool)]


# ---------------------------------------------------------------------------------
# Layers: keep one layer of every distinct kind
# ---------------------------------------------------------------------------------

# Scalar per-layer switches: name -> (predicate on (layer index, value), rebuild).
# Each is re-solved for the kept layers so every kept layer keeps its kind.
_Predicate = Callable[[int, int], bool]
_THRESHOLDS: dict[str, _Predicate] = {
    "first_k_dense_replace": lambda i, k: i < k,        # DeepSeek: dense MLP before k
    "max_window_layers": lambda i, k: i < k,            # Qwen2: full attention before k
}
# Counts of the last layers that differ (Gemma 3n: the last k layers reuse earlier
# layers' keys and values)
_FROM_END = ("num_kv_shared_layers",)
_PERIODS: dict[str, _Predicate] = {
    "decoder_sparse_step": lambda i, s: s > 0 and (i + 1) % s == 0,   # Qwen2-MoE
    "moe_layer_freq": lambda i, f: f > 0 and i % f == 0,              # DeepSeek-V2
}


def _period_pairs(data: dict[str, Any]) -> list[tuple[str, str]]:
    """``(x_period, x_offset)`` pairs (Jamba: attention / expert layer placement)."""
    return [(k, k[: -len("_period")] + "_offset") for k in _get(data, list(data))
            if k.endswith("_period") and isinstance(data.get(k[: -len("_period")] + "_offset"), int)]


def _per_layer_fields(data: dict[str, Any], layers: int) -> tuple[list[str], list[str]]:
    """Fields with one entry per layer (lists / pattern strings) and layer-index lists
    (``mlp_only_layers``; a vision tower's ``fullatt_block_indexes``)."""
    per_layer, indices = [], []
    for key, value in data.items():
        # a list as long as the layers is one entry per layer whatever its name (Bailing's
        # ``expert_swiglu_limit_list``) once that length cannot be a coincidence
        named = "layer" in key or "pattern" in key or "block_type" in key or key in _FFN_KEYS
        if isinstance(value, (list, str)) and len(value) == layers and layers > 1 and (
                named or isinstance(value, list) and layers >= _PER_LAYER_LENGTH):
            per_layer.append(key)
        elif (("layer" in key or "index" in key) and isinstance(value, list) and value
              and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < layers for v in value)):
            indices.append(key)
    return per_layer, indices


def _layer_maps(data: dict[str, Any], layers: float = math.inf) -> dict[str, dict[int, Any]]:
    """Fields mapping layer indices (below ``layers``) to per-layer overrides (Gemma 4's
    ``per_layer_config``: ``{"05": {"head_dim": 512}, ...}``), as ``{field: {layer index:
    override}}``."""
    out: dict[str, dict[int, Any]] = {}
    for key, value in data.items():
        if "layer" not in key or not isinstance(value, dict) or not value:
            continue
        try:
            indexed = {int(k): v for k, v in value.items()}
        except (TypeError, ValueError):
            continue
        if all(0 <= i < layers for i in indexed):
            out[key] = indexed
    return out


def _layer_kind(data: dict[str, Any], i: int, per_layer: list[str], indices: list[str]) -> tuple:
    kind: list[Any] = [data[k][i] for k in per_layer]
    kind += [i in data[k] for k in indices]
    kind += [pred(i, data[k]) for k, pred in {**_THRESHOLDS, **_PERIODS}.items() if k in _get(data, [k])]
    kind += [i % data[p] == data[o] % data[p] for p, o in _period_pairs(data) if data[p] > 0]
    return tuple(kind)


def _solve(flags: list[bool], candidates: range, pred: _Predicate, fallback: int) -> int:
    """The first candidate value whose predicate reproduces ``flags`` on the new layers."""
    for value in candidates:
        if [pred(j, value) for j in range(len(flags))] == flags:
            return value
    return fallback


def _solve_pair(flags: list[bool], old: tuple[int, int]) -> tuple[int, int]:
    n = len(flags)
    for period in range(1, n + 1):
        for offset in range(period):
            if [j % period == offset for j in range(n)] == flags:
                return period, offset
    return old[0], old[1]


def _shrink_layers(data: dict[str, Any], new: dict[str, Any], layers_key: str, minimum: int) -> None:
    """Keep the first layer of every distinct kind (at least ``minimum`` layers) and
    rewrite every per-layer field for the kept layers."""
    total = data[layers_key]
    per_layer, indices = _per_layer_fields(data, total)
    maps = _layer_maps(data, total)
    from_end = [k for k in _get(data, _FROM_END) if 0 < data[k] <= total]
    kinds = [_layer_kind(data, i, per_layer, indices) + tuple(repr(m.get(i)) for m in maps.values())
             + tuple(i >= total - data[k] for k in from_end) for i in range(total)]
    keep = sorted({kinds.index(k) for k in kinds})
    extra = [i for i in range(total) if i not in keep]
    keep = sorted(keep + extra[: max(0, min(minimum, total) - len(keep))])
    new[layers_key] = len(keep)
    for key in per_layer:
        value = [data[key][i] for i in keep]
        new[key] = "".join(value) if isinstance(data[key], str) else value
    for key in indices:
        new[key] = [keep.index(i) for i in data[key] if i in keep]
    for key, m in maps.items():
        new[key] = {str(keep.index(i)): v for i, v in m.items() if i in keep}
    for key in from_end:
        new[key] = sum(i >= total - data[key] for i in keep)
    for key, pred in _THRESHOLDS.items():
        if key in _get(data, [key]):
            flags = [pred(i, data[key]) for i in keep]
            new[key] = _solve(flags, range(len(keep) + 1), pred, data[key])
    for key, pred in _PERIODS.items():
        if key in _get(data, [key]):
            flags = [pred(i, data[key]) for i in keep]
            new[key] = _solve(flags, range(1, len(keep) + 2), pred, data[key])
    for p, o in _period_pairs(data):
        if data[p] > 0:
            flags = [i % data[p] == data[o] % data[p] for i in keep]
            new[p], new[o] = _solve_pair(flags, (data[p], data[o]))


# ---------------------------------------------------------------------------------
# Widths
# ---------------------------------------------------------------------------------


def _kv_for(kv: int, heads: int, tp: int) -> int:
    if kv == heads:
        return -1  # MHA: follows the shrunk head count
    if kv == 1 or kv < tp:
        return kv  # replicated KV heads: keep the exact replication relation
    return count_for_tp(kv, tp, _KV_HEADS)


def _heads_over_kv(heads: int, kv_new: int, kv_real: int, tp: int) -> int:
    """The smallest head count that is a multiple of ``kv_new`` and relates to tp as
    ``heads`` does (``heads / kv_real`` always qualifies, so the search terminates)."""
    groups = heads // kv_real
    for g in range(min(groups, 2), groups + 1):
        value = kv_new * g
        if value % tp == heads % tp and (value >= tp) == (heads >= tp):
            return value
    return kv_new * groups


def _shrink_heads(data: dict[str, Any], new: dict[str, Any], tp: int) -> list[int]:
    """Attention and KV head counts; returns every new head count (for the width)."""
    counts = []
    kv_keys = _get(data, _KV_KEYS)
    for i, key in enumerate(_get(data, _HEAD_KEYS)):
        heads = data[key]
        kv_key = kv_keys[0] if kv_keys and i == 0 else None
        kv = data[kv_key] if kv_key else heads
        if kv_key and heads % max(kv, 1) == 0 and kv != heads:
            kv_new = _kv_for(kv, heads, tp)
            new[key] = _heads_over_kv(heads, kv_new, kv, tp)
            new[kv_key] = kv_new
        else:
            new[key] = count_for_tp(heads, tp, _HEADS)
            if kv_key:
                new[kv_key] = new[key] if kv == heads else _kv_for(kv, heads, tp)
        if i == 0:
            # a config may hold the KV count under two keys (Falcon: ``num_kv_heads``,
            # read only by the new decoder architecture, beside ``num_key_value_heads``):
            # each keeps its own relation to the heads
            for other in kv_keys[1:]:
                value = data[other]
                new[other] = (new[key] if value == heads else new[kv_key] if value == kv
                              else _kv_for(value, heads, tp))
        counts.append(new[key])
    return counts


def _head_dim(data: dict[str, Any], hidden_key: str | None, head_keys: list[str]) -> int:
    for key in _get(data, _HEAD_DIM_KEYS):
        return int(data[key])
    if hidden_key and head_keys and data[head_keys[0]]:
        return data[hidden_key] // data[head_keys[0]]
    return _HEAD_DIM


def _shrink_widths(data: dict[str, Any], new: dict[str, Any], tp: int, head_counts: list[int]) -> None:
    hidden_keys = _get(data, _HIDDEN_KEYS)
    hidden_key = hidden_keys[0] if hidden_keys else None
    head_keys = _get(data, _HEAD_KEYS)
    real_hd = _head_dim(data, hidden_key, head_keys)
    hd = min(real_hd, _HEAD_DIM)
    explicit_hd = _get(data, _HEAD_DIM_KEYS)
    for key in explicit_hd:
        new[key] = hd
    if hidden_key:
        real_hidden = data[hidden_key]
        heads_match = head_keys and all(real_hidden == data[k] * real_hd for k in head_keys)
        if head_counts and (heads_match or not explicit_hd):
            # hidden = heads * head_dim (for every stack sharing the width)
            lcm = math.lcm(*head_counts)
            new[hidden_key] = lcm * max(1, math.ceil(max(head_counts) * hd / lcm))
        else:
            new[hidden_key] = size_for_tp(real_hidden, tp, _HIDDEN, multiple=2)
        staged = [h for k in _HEAD_KEYS if isinstance(data.get(k), list) for h in data[k] if isinstance(h, int) and h > 0]
        if staged and new[hidden_key] % math.lcm(*staged):
            # heads per stage (Swin2SR's [6, 6, 6, 6], kept): a width every stage's heads divide
            lcm = math.lcm(*staged)
            new[hidden_key] = lcm * math.ceil(new[hidden_key] / lcm)
        for key in _get(data, _HIDDEN_ALIASES):
            if data[key] == real_hidden:
                new[key] = new[hidden_key]
        for key, value in data.items():
            # a width given as a multiple of the hidden size (Zamba2's attention_hidden_size:
            # twice it, the concatenated input and original embeddings) keeps its multiple
            if (key.endswith("attention_hidden_size") and key not in new and type(value) is int
                    and value > real_hidden and value % real_hidden == 0):
                new[key] = value // real_hidden * new[hidden_key]
        if data.get("query_pre_attn_scalar") == real_hd:
            new["query_pre_attn_scalar"] = hd
    for key in _get(data, _FFN_KEYS):
        new[key] = size_for_tp(data[key], tp, _FFN, multiple=2)
    for key in _FFN_KEYS:  # one width per layer (Gemma 3n), the kept layers' already
        if isinstance(new.get(key), list):
            new[key] = [size_for_tp(v, tp, _FFN, multiple=2) for v in new[key]]
    for key in _get(data, _EXPERT_FFN_KEYS):
        new[key] = size_for_tp(data[key], tp, _EXPERT_FFN, multiple=2)
    for key in _get(data, _LORA_KEYS):
        new[key] = size_for_tp(data[key], tp, _LORA_RANK)
    for key in _get(data, _MLA_DIM_KEYS):
        new[key] = min(data[key], _HEAD_DIM)
    if "qk_rope_head_dim" in _get(data, ["qk_rope_head_dim"]):
        new["qk_rope_head_dim"] = min(data["qk_rope_head_dim"], _ROPE_HEAD_DIM)
        if "head_dim" in explicit_hd and data["head_dim"] == data["qk_rope_head_dim"]:
            new["head_dim"] = new["qk_rope_head_dim"]  # MLA: head_dim is the rotary part
        if "qk_head_dim" in data:
            new["qk_head_dim"] = new.get("qk_nope_head_dim", 0) + new["qk_rope_head_dim"]
    # A rotary width given in channels (GPT-J / CodeGen's rotary_dim) keeps its share of
    # the head, rounded to an even count
    if isinstance(data.get("rotary_dim"), int) and real_hd:
        new["rotary_dim"] = max(2, (data["rotary_dim"] * hd // real_hd) // 2 * 2)
    # per-layer overrides of the head width (Gemma 4's full-attention layers: twice the
    # sliding ones') keep their ratio to the head width
    for key in _layer_maps(data):
        if isinstance(new.get(key), dict) and real_hd:
            new[key] = {i: {k: max(1, v * hd // real_hd) if k in _HEAD_DIM_KEYS and isinstance(v, int) else v
                            for k, v in entry.items()} if isinstance(entry, dict) else entry
                        for i, entry in new[key].items()}
    # State-space mixers: rank of the step projection is derived from the width.
    width = new.get(hidden_key) if hidden_key else None
    for key in ("time_step_rank", "mamba_dt_rank"):
        if width and key in _get(data, [key]):
            new[key] = math.ceil(width / 16)


# Mamba-2-style mixers: (heads, head width, expansion) under the names families use
_SSM_HEADS = (("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
              ("n_mamba_heads", "mamba_headdim", "mamba_expand"), ("mamba_num_heads", "mamba_head_dim", "expand"))
# the expert groups of group-limited routing (names are aliases of one another)
_EXPERT_GROUP_KEYS = ("n_group", "num_expert_group")
_SSM_GROUP_KEYS = ("n_groups", "mamba_n_groups", "mamba_ngroups")
_SSM_STATE_KEYS = ("state_size", "mamba_d_state", "ssm_state_size")
_SSM_CHUNK_KEYS = ("chunk_size", "mamba_chunk_size")
_SSM_STATE = 16
_SSM_CHUNK = 8


def _shrink_ssm(data: dict[str, Any], new: dict[str, Any], tp: int) -> None:
    """A Mamba-2-style mixer keeps ``heads x head width = expand x hidden`` when the real
    config has it (its config validates that), groups that divide the heads and relate to
    ``tp`` as the real ones, a small state and chunks shorter than the test sequence."""
    hidden_keys = _get(data, _HIDDEN_KEYS)
    if not hidden_keys or hidden_keys[0] not in new:
        return
    hidden = new[hidden_keys[0]]
    for heads_key, dim_key, expand_key in _SSM_HEADS:
        if not all(isinstance(data.get(k), int) for k in (heads_key, dim_key, expand_key)):
            continue
        if data[heads_key] * data[dim_key] != data[expand_key] * data[hidden_keys[0]]:
            continue  # heads are not tied to the width here (Falcon-H1's mamba_d_ssm)
        width = data[expand_key] * hidden
        heads = count_for_tp(data[heads_key], tp, _HEADS)
        while width % heads:  # the smallest head count >= the target that tiles the width
            heads += tp if data[heads_key] % tp == 0 else 1
        new[heads_key], new[dim_key] = heads, width // heads
        for key in _get(data, _SSM_GROUP_KEYS):
            groups = min(heads, count_for_tp(data[key], tp, 2))
            while heads % groups:
                groups -= 1
            new[key] = groups
        for key in _get(data, _SSM_STATE_KEYS):
            new[key] = min(data[key], _SSM_STATE)
        for key in _get(data, _SSM_CHUNK_KEYS):
            new[key] = min(data[key], _SSM_CHUNK)


def _shrink_experts(data: dict[str, Any], new: dict[str, Any], tp: int) -> None:
    expert_keys = _get(data, _EXPERT_KEYS)
    for key in expert_keys:
        new[key] = count_for_tp(data[key], tp, _EXPERTS)
    experts = new[expert_keys[0]] if expert_keys else None
    for key in _get(data, _TOP_K_KEYS):
        new[key] = min(data[key], _TOP_K, experts or data[key])
    for group_key in _get(data, _EXPERT_GROUP_KEYS) if experts else ():
        # Group-limited routing (DeepSeek, Bailing): groups divide the experts, >= 2
        # experts each so the per-group top-2 score exists; top-k fits in the selected groups.
        groups = max(g for g in range(1, min(data[group_key], experts) + 1)
                     if experts % g == 0 and experts // g >= 2) if experts >= 2 else 1
        new[group_key] = groups
        if "topk_group" in _get(data, ["topk_group"]):
            new["topk_group"] = min(data["topk_group"], groups)
            per_group = experts // groups
            for key in _get(data, _TOP_K_KEYS):
                new[key] = min(new[key], new["topk_group"] * per_group)


# ---------------------------------------------------------------------------------
# Vocabulary, positions, inputs
# ---------------------------------------------------------------------------------


def _fold_ids(value: Any, vocab: int) -> Any:
    # Ids beyond the small vocabulary are folded into it (bos != eos mostly survive)
    # so embeddings' padding_idx and generate's stop tokens stay in range.
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value % vocab
    if isinstance(value, list):
        return [_fold_ids(v, vocab) for v in value]
    return value


def _fold_placeholders(data: dict[str, Any], new: dict[str, Any]) -> None:
    """A multimodal model's placeholder ids (``image_token_index`` on the top config, the
    vocabulary on ``text_config``) folded into the text's small vocabulary, each to its
    own id: an image token equal to the video token would take both modalities' slots."""
    text = data.get("text_config")
    vocab = text.get("vocab_size") if isinstance(text, dict) else None
    if not isinstance(vocab, int) or vocab <= 0:
        return
    taken = {v for k, v in data.items() if k.endswith("token_id") and isinstance(v, int) and v < vocab}
    for key, value in data.items():
        if not key.endswith(("_token_id", "_token_index")) or isinstance(value, bool) \
                or not isinstance(value, int) or value < vocab:
            continue
        folded = value % vocab
        while folded in taken:
            folded = (folded - 1) % vocab
        new[key] = folded
        taken.add(folded)


def _shrink_vocab(data: dict[str, Any], new: dict[str, Any], tp: int) -> None:
    if "vocab_size" not in _get(data, ["vocab_size"]):
        _fold_placeholders(data, new)
        return
    vocab = new["vocab_size"] = size_for_tp(data["vocab_size"], tp, _VOCAB)
    if data.get("decoder_vocab_size") is not None:  # Marian: its own decoder vocabulary
        new["decoder_vocab_size"] = vocab if data["decoder_vocab_size"] == data["vocab_size"] else \
            size_for_tp(data["decoder_vocab_size"], tp, _VOCAB)
    for key, value in data.items():
        if key.endswith(("token_id", "token_ids", "_tokens", "_token_index")):
            new[key] = _fold_ids(value, vocab)


def _shrink_positions(data: dict[str, Any], new: dict[str, Any]) -> None:
    for key in _get(data, _POSITION_KEYS):
        new[key] = min(data[key], _POSITIONS)
    if "max_target_positions" in _get(data, ["max_target_positions"]):
        new["max_target_positions"] = min(data["max_target_positions"], _TARGET_POSITIONS)
    if "max_source_positions" in _get(data, ["max_source_positions"]):
        new["max_source_positions"] = min(data["max_source_positions"], _SOURCE_POSITIONS)
    window = data.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and window > 0:
        new["sliding_window"] = min(window, _SLIDING_WINDOW)
    rope = data.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("original_max_position_embeddings"), int):
        # Scaled RoPE needs the pre-training context shorter than the extended one.
        factor = rope.get("factor") or 1.0
        limit = new.get("max_position_embeddings", _POSITIONS)
        new["rope_parameters"] = {**rope, "original_max_position_embeddings":
                                  max(1, int(limit // factor))}
    patch, image = data.get("patch_size"), data.get("image_size")
    if isinstance(patch, int) and isinstance(image, int) and image > patch * _PATCHES_PER_SIDE:
        new["image_size"] = patch * _PATCHES_PER_SIDE
    _shrink_windows(data, new)
    _shrink_stages(data, new)
    tokens = data.get("mm_tokens_per_image")
    if isinstance(tokens, int) and tokens > _PATCHES_PER_SIDE ** 2:
        # pooled to a square of tokens per image (Gemma 3): no more than the patches
        new["mm_tokens_per_image"] = _PATCHES_PER_SIDE ** 2


def _shrink_windows(data: dict[str, Any], new: dict[str, Any]) -> None:
    """Window attention over stages (Swin: ``window_size``, ``depths``): windows of
    ``_PATCHES_PER_SIDE`` patches a side, and an image whose last stage, after a 2x
    patch merging per stage, still holds one window.  A smaller image makes the model
    shrink its windows below its position-bias table's and fail."""
    window, depths = data.get("window_size"), new.get("depths", data.get("depths"))
    patch, image = data.get("patch_size"), new.get("image_size", data.get("image_size"))
    if not (isinstance(window, int) and isinstance(depths, list) and depths
            and isinstance(patch, int) and isinstance(image, int)):
        return
    window = min(window, _PATCHES_PER_SIDE)
    new["window_size"] = window
    new["image_size"] = max(image, patch * window * 2 ** (len(depths) - 1))
    # two blocks a stage keep a plain and a shifted one; a width every stage's heads
    # divide, 8 channels a head in the first stage (Swin doubles both per stage)
    new["depths"] = [min(d, 2) if isinstance(d, int) else d for d in depths]
    heads = new.get("num_heads", data.get("num_heads"))
    if isinstance(heads, list) and heads and all(isinstance(h, int) and h > 0 for h in heads) \
            and isinstance(data.get("embed_dim"), int):
        lcm = math.lcm(*heads)
        new["embed_dim"] = lcm * max(1, math.ceil(_STAGE_HEAD_DIM * heads[0] / lcm))


def _shrink_mrope(cls: type, data: dict[str, Any]) -> None:
    """Multimodal rotary sections (temporal, height, width: GLM-4V, Qwen2-VL) that sum to
    the shrunk head's rotary half, in the real ones' ratio (2:3:3 where the default lives
    in the model's code, sized for the real head)."""
    rope = data.get("rope_parameters")
    if "mrope_section" not in getattr(cls, "ignore_keys_at_rope_validation", ()) or not isinstance(rope, dict):
        return
    heads, hidden = data.get("num_attention_heads"), data.get("hidden_size")
    head_dim = data.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None)
    if not isinstance(head_dim, int):
        return
    half = int(head_dim * rope.get("partial_rotary_factor", data.get("partial_rotary_factor") or 1.0)) // 2
    given = rope.get("mrope_section")
    ratio = given or [2, 3, 3]
    if half < len(ratio) or (given and sum(given) == half):
        return
    sections = [max(1, half * r // sum(ratio)) for r in ratio]
    sections[-1] += half - sum(sections)
    data["rope_parameters"] = {**rope, "mrope_section": sections}


def _shrink_stages(data: dict[str, Any], new: dict[str, Any]) -> None:
    """A hierarchical vision model (``depths`` per stage, halving its grid each stage:
    ConvNeXt) gets an image whose last stage still holds a patch: 2x2 patches would
    reach its third stage as 1x1 and its downsampling kernel would not fit."""
    depths, window = new.get("depths", data.get("depths")), data.get("window_size")
    patch, image = data.get("patch_size"), new.get("image_size", data.get("image_size"))
    if isinstance(window, int) or not (isinstance(depths, list) and len(depths) > 1
                                       and isinstance(patch, int) and isinstance(image, int)):
        return
    new["image_size"] = max(image, patch * 2 ** (len(depths) - 1))


# ---------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------


def _shrink_backbone_outputs(data: dict[str, Any], new: dict[str, Any]) -> None:
    """A backbone's ``out_indices`` (stage ``i`` = after layer ``i``) moved onto the kept
    layers, each to the same place in the shorter stack, and ``out_features`` derived
    from them again: BEiT's default names ``stage12``, which 2 layers do not have."""
    indices, key = data.get("out_indices"), "num_hidden_layers"
    total, kept = data.get(key), new.get(key)
    if not (isinstance(indices, list) and isinstance(total, int) and isinstance(kept, int)) or kept == total:
        return
    moved = [0 if i == 0 else max(1, round(i * kept / total)) for i in indices if isinstance(i, int)]
    new["out_indices"] = sorted(set(moved))
    new["out_features"] = None


def _shrink_flat(data: dict[str, Any], tp: int, layers: int) -> dict[str, Any]:
    new: dict[str, Any] = {}
    for key in _get(data, _LAYER_KEYS):
        _shrink_layers(data, new, key, layers)
    _shrink_backbone_outputs(data, new)
    heads = _shrink_heads(data, new, tp)
    _shrink_widths(data, new, tp, heads)
    _shrink_ssm(data, new, tp)
    _shrink_experts(data, new, tp)
    _shrink_vocab(data, new, tp)
    _shrink_positions(data, new)
    return new


def _keep_merged_patches(config: PreTrainedConfig, data: dict[str, Any]) -> None:
    """A model that merges its vision tower's patches ``k x k`` into one text token
    (Mistral 3's ``spatial_merge_size``) keeps ``_PATCHES_PER_SIDE`` merged tokens a side:
    2x2 patches merged 2x2 left one token per image, which Mistral 3's projector
    squeezes to a vector and cannot split by image."""
    merge, vision = data.get("spatial_merge_size"), data.get("vision_config")
    real = getattr(getattr(config, "vision_config", None), "image_size", None)
    if not (isinstance(merge, int) and merge > 1 and isinstance(vision, dict) and isinstance(real, int)):
        return
    patch, image = vision.get("patch_size"), vision.get("image_size")
    if isinstance(patch, int) and isinstance(image, int):
        vision["image_size"] = max(image, min(real, patch * _PATCHES_PER_SIDE * merge))


def _scale_pinpoints(config: PreTrainedConfig, data: dict[str, Any]) -> None:
    """Tiling grids given in pixels of the real tower's image size (LLaVA-NeXT's and
    LLaVA-OneVision's ``image_grid_pinpoints``, multiples of it) scaled to the shrunk
    size, so an image tiles into as many views as on the real model, not hundreds."""
    pinpoints, vision = data.get("image_grid_pinpoints"), data.get("vision_config")
    real = getattr(getattr(config, "vision_config", None), "image_size", None)
    small = vision.get("image_size") if isinstance(vision, dict) else None
    if not (isinstance(pinpoints, list) and isinstance(real, int) and isinstance(small, int) and small < real):
        return
    data["image_grid_pinpoints"] = [[max(1, round(int(n) / real)) * small for n in point] for point in pinpoints]


def _follow_text_width(config: PreTrainedConfig, data: dict[str, Any]) -> None:
    """A tower's fields that size its output for the text model (Granite-Docling's and
    LLaVA-OneVision-1.5's ``vision_config.out_hidden_size``, Inkling 2's
    ``text_hidden_size``), equal to the text's width in the real config, follow the shrunk
    text width: the config's own validation refuses them otherwise.  The tower's own width
    (``hidden_size``, tied to its heads) is left alone."""
    text = data.get("text_config")
    real = getattr(getattr(config, "text_config", None), "hidden_size", None)
    width = text.get("hidden_size") if isinstance(text, dict) else None
    if not (isinstance(real, int) and isinstance(width, int)) or real == width:
        return
    for key in _SUB_CONFIGS:
        sub, orig = data.get(key), getattr(config, key, None)
        if key == "text_config" or not isinstance(sub, dict) or not isinstance(orig, PreTrainedConfig):
            continue
        for field, value in orig.to_dict().items():
            if value == real and field not in _HIDDEN_KEYS and ("hidden" in field or field.startswith("text_")):
                sub[field] = width


def shrink_config(config: PreTrainedConfig, tp: int, *, layers: int = _LAYERS) -> PreTrainedConfig:
    """A CPU-sized copy of ``config`` that the compiler splits over ``tp`` ranks the way
    it splits the real model.

    The rule, applied to every (sub-)config (``text_config``, ``vision_config``,
    ``audio_config``, ``encoder``, ``decoder``):

    * **Layers**: ``layers`` (default 2), but at least one of every distinct layer kind.
      A layer's kind is its entry in every per-layer list (``layer_types``, block-type
      lists and pattern strings), its membership in layer-index lists
      (``mlp_only_layers``, ``attn_layer_indices``), and its side of every scalar switch
      (``first_k_dense_replace``, ``max_window_layers``, ``decoder_sparse_step``,
      ``x_layer_period`` / ``x_layer_offset``).  The first layer of each kind is kept
      and every such field is rewritten so each kept layer keeps its kind.
    * **Counts** (attention heads, experts) go to :func:`count_for_tp`: unchanged when
      already small or below ``tp``, otherwise the smallest value ``>= max(4, tp)``
      with the same remainder modulo ``tp``.  So a count divisible by ``tp`` (or by a
      divisor of it) stays so, and a non-divisible one stays non-divisible.
    * **KV heads**: MHA stays MHA; 1 KV head stays 1; fewer KV heads than ``tp``
      are kept exactly (same replication factor ``tp / kv``); otherwise as a count
      (target 2).  Heads are then the smallest multiple of the KV heads (at least 2
      groups when the real model has them) with the heads' remainder modulo ``tp``.
    * **Widths** (MLP, expert MLP, low-rank MLA projections, vocabulary) go to
      :func:`size_for_tp`: the smallest value above a small target (128 / 32 / 32 / 256)
      with the real remainder modulo ``tp``.  ``head_dim`` becomes ``min(real, 16)``;
      the hidden size is heads x head_dim where the family ties them (or the real model
      has them equal), else 64-ish.  Fields equal to the hidden size follow it, and a
      tower's fields sized for the text (``out_hidden_size``) follow the text's width.
    * **Experts**: top-k ``<= min(2, experts)``; group-limited routing keeps groups that
      divide the experts.
    * **Vocabulary**: special token ids beyond the small vocabulary are folded into it
      (``id % vocab``).  Positions are capped at 128 (decoder targets 64, audio source
      positions 16), sliding windows at 8, images at 2x2 patches.

    Raises :class:`~tpcompile.errors.TPError` if ``tp`` is not a positive integer.

    Example:
        >>> from transformers import AutoConfig
        >>> small = shrink_config(AutoConfig.for_model("falcon", num_attention_heads=71), 2)
        >>> small.num_attention_heads % 2, small.num_hidden_layers
        (1, 2)
    """
    check_degree("tp", tp)
    data = config.to_dict()
    for key in _SUB_CONFIGS:
        sub = getattr(config, key, None)
        if isinstance(sub, PreTrainedConfig):
            data[key] = shrink_config(sub, tp, layers=layers).to_dict()
    data.update(_shrink_flat(data, tp, layers))
    _keep_merged_patches(config, data)
    _scale_pinpoints(config, data)
    _follow_text_width(config, data)
    _shrink_mrope(type(config), data)
    data["dtype"] = "float32"  # exact comparisons need float32 on CPU
    data.pop("transformers_version", None)
    return type(config).from_dict(data)
