"""shrink_config: small models of every family build and run, and keep every relation
of their sharded sizes to tp (single process, fast)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, PreTrainedConfig

from tpcompile.errors import TPError
from tpcompile.tools import presets
from tpcompile.tools.shrink import count_for_tp, shrink_config, size_for_tp
from tpcompile.tools.verify import _inputs, build_small_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2", "gpt_neox", "mixtral",
            "bert", "t5", "vit", "whisper", "mamba", "deepseek_v3", "qwen2_moe", "gpt_oss", "falcon",
            "bloom", "opt", "mamba2", "swin", "swin2sr", "beit", "qwen2_5_vl", "qwen3_vl"]
_MAX_PARAMS = 3_000_000  # "small": a forward on CPU in milliseconds


def _family_config(name: str) -> PreTrainedConfig:
    return AutoConfig.for_model(name)


def _run_once(config: PreTrainedConfig, tp: int, task: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_small_model(config, tp=tp, task=task)
    assert sum(p.numel() for p in model.parameters()) < _MAX_PARAMS
    batch = _inputs(model, torch.Generator().manual_seed(1))
    out = model(**batch)
    floats = [v for v in out.values() if isinstance(v, torch.Tensor) and v.is_floating_point()]
    assert floats and all(torch.isfinite(v).all() for v in floats)
    return model


@pytest.mark.parametrize("name", FAMILIES)
def test_family_builds_and_runs(name: str) -> None:
    real = _family_config(name)
    model = _run_once(real, 2)
    assert type(model.config) is type(real)


@pytest.mark.parametrize("name", presets.list_presets())
def test_preset_builds_and_runs(name: str) -> None:
    preset = presets.get_preset(name)
    model = _run_once(presets.build_config(preset), 2, task=preset.task)
    layers = next(getattr(model.config, k) for k in ("num_hidden_layers", "n_layer"))
    assert layers == 2


# ---------------------------------------------------------------------------------
# The relations
# ---------------------------------------------------------------------------------

_COUNTS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
           "decoder_attention_heads", "num_local_experts", "num_experts", "n_routed_experts")
_WIDTHS = ("intermediate_size", "d_ff", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
           "ffn_hidden_size", "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size",
           "q_lora_rank", "kv_lora_rank")
_KV = ("num_key_value_heads", "num_kv_heads")


def _raw(config: PreTrainedConfig) -> dict:
    return config.to_dict()


def _check_relations(real: PreTrainedConfig, small: PreTrainedConfig, tp: int) -> None:
    r, s = _raw(real), _raw(small)
    for key in _COUNTS:
        if isinstance(r.get(key), int):
            assert s[key] % tp == r[key] % tp, (key, r[key], s[key], tp)
            assert (s[key] >= tp) == (r[key] >= tp), (key, r[key], s[key], tp)
            assert s[key] <= max(r[key], 1)
    for key in _WIDTHS:
        if isinstance(r.get(key), int):
            assert s[key] % tp == r[key] % tp, (key, r[key], s[key], tp)
    heads = next((k for k in _COUNTS[:5] if isinstance(r.get(k), int)), None)
    for key in _KV:
        if isinstance(r.get(key), int) and heads:
            kv, kv_s = r[key], s[key]
            if kv == r[heads]:
                assert kv_s == s[heads]  # MHA stays MHA
            elif kv < tp:
                assert kv_s == kv  # the same replication factor tp / kv
            else:
                assert kv_s % tp == kv % tp and kv_s >= tp
            assert s[heads] % kv_s == 0  # whole query groups
    experts = next((s[k] for k in _COUNTS[5:] if isinstance(s.get(k), int)), None)
    if experts is not None and isinstance(s.get("num_experts_per_tok"), int):
        assert 1 <= s["num_experts_per_tok"] <= experts


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_divisibility_relations_hold(tp: int) -> None:
    for name in FAMILIES:
        real = _family_config(name)
        _check_relations(real, shrink_config(real, tp), tp)
    for name in presets.list_presets():
        real = presets.build_config(name)
        _check_relations(real, shrink_config(real, tp), tp)


@pytest.mark.parametrize("kv, heads, tp, want_kv", [(1, 32, 8, 1), (4, 32, 8, 4), (8, 32, 8, 8),
                                                    (8, 64, 2, 2), (2, 16, 4, 2), (3, 24, 2, 3)])
def test_kv_heads(kv: int, heads: int, tp: int, want_kv: int) -> None:
    real = AutoConfig.for_model("llama", num_attention_heads=heads, num_key_value_heads=kv,
                                hidden_size=heads * 128)
    small = shrink_config(real, tp)
    assert small.num_key_value_heads == want_kv
    _check_relations(real, small, tp)
    assert small.num_attention_heads // small.num_key_value_heads >= min(heads // kv, 2)


def test_non_divisible_counts_stay_non_divisible() -> None:
    falcon = AutoConfig.for_model("falcon", num_attention_heads=71, hidden_size=4544)
    small = shrink_config(falcon, 2)
    assert small.num_attention_heads % 2 == 1 and small.hidden_size == small.num_attention_heads * 16
    gpt2 = shrink_config(AutoConfig.for_model("gpt2"), 2)
    assert gpt2.vocab_size % 2 == 1 and gpt2.eos_token_id < gpt2.vocab_size  # folded id
    qwen_moe = shrink_config(AutoConfig.for_model("qwen2_moe"), 8)  # 60 experts over 8
    assert qwen_moe.num_experts == 12


def test_one_layer_of_each_kind() -> None:
    gemma = shrink_config(AutoConfig.for_model("gemma2"), 2)
    assert sorted(gemma.layer_types) == ["full_attention", "sliding_attention"]
    assert gemma.sliding_window == 8
    deepseek = shrink_config(AutoConfig.for_model("deepseek_v3"), 2)
    assert deepseek.num_hidden_layers == 2 and deepseek.first_k_dense_replace == 1  # dense, then MoE
    assert deepseek.qk_head_dim == deepseek.qk_nope_head_dim + deepseek.qk_rope_head_dim
    # Jamba: attention every 8th layer from 4, experts every 2nd from 1
    jamba = shrink_config(AutoConfig.for_model("jamba"), 2)
    kinds = {(t, jamba.layers_num_experts[i] > 1) for i, t in enumerate(jamba.layers_block_type)}
    assert {("mamba", False), ("mamba", True), ("attention", False)} <= kinds
    # Zamba2: an explicit per-layer list and an index list stay consistent
    zamba = shrink_config(AutoConfig.for_model("zamba2"), 2)
    assert len(zamba.layers_block_type) == zamba.num_hidden_layers
    assert [i for i, t in enumerate(zamba.layers_block_type) if t == "hybrid"] == zamba.hybrid_layer_ids
    qwen2 = shrink_config(presets.build_config("qwen2", layer_types=None), 2, layers=3)
    assert qwen2.num_hidden_layers == 3


def test_sub_configs_are_shrunk() -> None:
    llava = shrink_config(AutoConfig.for_model("llava"), 2)
    assert llava.text_config.num_hidden_layers == 2 and llava.text_config.hidden_size <= 128
    assert llava.vision_config.num_hidden_layers == 2 and llava.vision_config.image_size <= 64


@pytest.mark.parametrize("name,keys", [("mamba2", ("num_heads", "head_dim", "expand", "n_groups")),
                                       ("bamba", ("mamba_n_heads", "mamba_d_head", "mamba_expand", "mamba_n_groups")),
                                       ("zamba2", ("n_mamba_heads", "mamba_headdim", "mamba_expand", "mamba_ngroups"))])
def test_state_space_heads_tile_the_width(name: str, keys: tuple) -> None:
    """A Mamba-2-style mixer's heads x head width stays expand x hidden (its config
    validates it), and its groups divide the heads, relating to tp as the real ones."""
    heads, dim, expand, groups = keys
    real = AutoConfig.for_model(name)
    small = shrink_config(real, 2)
    assert getattr(small, heads) * getattr(small, dim) == getattr(small, expand) * small.hidden_size
    assert getattr(small, heads) % getattr(small, groups) == 0
    assert (getattr(small, groups) % 2 == 0) == (getattr(real, groups) % 2 == 0)
    assert getattr(small, heads) <= 8 and small.hidden_size <= 128


def test_sizes_tied_to_others_follow_them() -> None:
    """SigLIP's text projection_size equals the vision width its logits multiply with;
    Marian's decoder vocabulary is the vocabulary: both shrink with what they equal."""
    siglip = shrink_config(AutoConfig.for_model("siglip"), 2)
    assert siglip.text_config.projection_size == siglip.text_config.hidden_size == siglip.vision_config.hidden_size
    marian = shrink_config(AutoConfig.for_model("marian"), 2)
    assert marian.decoder_vocab_size == marian.vocab_size <= 512
    assert marian.pad_token_id < marian.vocab_size
    # Zamba2's attention reads the hidden state and the embeddings concatenated: twice the width
    zamba2 = shrink_config(AutoConfig.for_model("zamba2"), 2)
    assert zamba2.attention_hidden_size == 2 * zamba2.hidden_size, zamba2.attention_hidden_size


def test_count_and_size_helpers() -> None:
    assert count_for_tp(3, 8, 4) == 3 and count_for_tp(12, 8, 4) == 12 and count_for_tp(71, 2, 4) == 5
    assert size_for_tp(128256, 8, 256) == 256 and size_for_tp(50257, 4, 256) % 4 == 1
    with pytest.raises(TPError, match="tp must be an integer >= 1"):
        shrink_config(AutoConfig.for_model("llama"), 0)


def test_per_layer_overrides_and_widths_follow_the_kept_layers() -> None:
    """Gemma 4's per_layer_config (layer index -> head_dim override) and Gemma 3n's
    per-layer intermediate sizes and KV-sharing tail are rewritten for the kept layers."""
    g4 = shrink_config(AutoConfig.for_model("gemma4_text"), 2).to_dict()
    assert g4["layer_types"] == ["sliding_attention", "full_attention"]
    assert g4["per_layer_config"] == {"1": {"head_dim": 2 * g4["head_dim"]}}
    g3n = shrink_config(AutoConfig.for_model("gemma3n_text"), 2).to_dict()
    assert len(g3n["intermediate_size"]) == g3n["num_hidden_layers"] and max(g3n["intermediate_size"]) <= 256
    assert 0 < g3n["num_kv_shared_layers"] < g3n["num_hidden_layers"]


def test_lists_one_per_layer_and_routing_aliases_follow() -> None:
    """Bailing's per-layer SwiGLU limits are lists as long as the layers whatever their
    name; its expert groups (``num_expert_group``) and top-k (``num_experts_per_token``)
    are other names for DeepSeek's, and must fit the shrunk experts for it to run."""
    real = AutoConfig.for_model("bailing_hybrid")
    small = shrink_config(real, 2).to_dict()
    layers = small["num_hidden_layers"]
    assert len(small["expert_swiglu_limit_list"]) == len(small["share_expert_swiglu_limit_list"]) == layers
    experts, groups = small["num_experts"], small["num_expert_group"]
    assert experts % groups == 0 and experts // groups >= 2
    assert small["num_experts_per_token"] <= small["topk_group"] * experts // groups
    torch.manual_seed(0)
    model = build_small_model(real, tp=2)
    model(**_inputs(model, torch.Generator().manual_seed(1)))


def test_staged_vision_models_and_multimodal_rotary_run() -> None:
    # ConvNeXt halves its grid each stage: 2x2 patches reached its third stage as 1x1,
    # where the downsampling kernel does not fit; the image now keeps a patch to the end
    small = shrink_config(AutoConfig.for_model("convnext"), 2)
    assert small.image_size == small.patch_size * 2 ** (len(small.depths) - 1)
    model = build_small_model(AutoConfig.for_model("convnext"), tp=2)
    assert torch.isfinite(model(**_inputs(model, torch.Generator().manual_seed(1))).last_hidden_state).all()
    # GLM-4V's rotary sections (default [8, 12, 12] in its code) follow the shrunk head
    text = shrink_config(AutoConfig.for_model("glm4v"), 2).text_config
    head_dim = text.hidden_size // text.num_attention_heads
    sections = text.rope_parameters["mrope_section"]
    assert sum(sections) == head_dim // 2 and len(sections) == 3 and min(sections) >= 1
    # a vision tower's depth shrinks like layers, its block-index lists with it (Qwen2.5-VL's
    # full-attention blocks, Qwen3-VL's deepstack taps): one windowed and one full block
    vision = shrink_config(AutoConfig.for_model("qwen2_5_vl"), 2).vision_config
    assert (vision.depth, vision.fullatt_block_indexes) == (2, [1])
    assert shrink_config(AutoConfig.for_model("qwen3_vl"), 2).vision_config.deepstack_visual_indexes == [1]


def test_a_towers_output_width_follows_the_shrunk_text_width() -> None:
    # vision_config.out_hidden_size (or text_hidden_size) sizes the tower's output for the
    # text model and must equal its width: the shrunk copy failed its own validation
    from transformers import CONFIG_MAPPING

    for kind, field in (("granite_docling", "out_hidden_size"), ("llava_onevision1_5", "out_hidden_size"),
                        ("inkling2", "text_hidden_size")):
        real = CONFIG_MAPPING[kind]()
        assert getattr(real.vision_config, field) == real.text_config.hidden_size, kind
        small = shrink_config(real, 2)
        assert getattr(small.vision_config, field) == small.text_config.hidden_size < real.text_config.hidden_size
