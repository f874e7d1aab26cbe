"""Tiny models of families beyond text decoders, built from their config classes.

Each builder gives the family's real structure at CPU size: encoder-decoder (T5), vision
encoder (ViT), state-space (Mamba), multi-head latent attention with MoE (DeepSeek-V3),
Phi-3 with grouped KV heads (two attributes of the same global value that map to
different local values at tp=2), Apertus (learnable scalars inside its activation) and
BART (a bias buffer added to the logits after the LM head), CLIP (two towers, two
required inputs), Qwen3-Next (gated delta-net layers with chunked causal masks) and
DBRX (an MoE layer whose expert loop depends on the routing), Mamba-2 (einsums) and
AIMv2 (a pooling head returned as ``pooler_output`` and read on by ``visual_projection``),
MPNet (a relative position bias the encoder makes once for every layer: its plan is
captured whole), I-BERT (embeddings and linears that return ``(values, None)``), Jamba (Mamba layers that normalise ``B`` / ``C`` / ``dt``, attention, experts),
OLMo-2 / OLMo-3 (``q_norm`` / ``k_norm`` over all heads) and BitNet (sub-norms over the
split attention output and MLP features): statistics over split features; OLMoE (the same
norms over 2 KV heads, or one: split at tp=2, at tp=4 the 2 KV heads keep the attention
whole as before while one KV head splits the queries only); Llama 4 (rotary as complex
multiplication through ``view_as_complex``, chunked attention, a layer without rotary,
MoE layers interleaved with dense ones); MPT and BLOOM (ALiBi built once outside the
attention and sliced to each rank's heads where it enters; BLOOM's has a row per batch
entry and head); ``*_uneven``: 7 heads, which no tp divides (Falcon's fused MQA
projection, GPT-2's ``[Q | K | V]`` sections, MPT's ALiBi, T5's per-head position bias),
dealt unevenly with a padding head, and BitNet's statistic over them, kept whole);
``*_straddle``: 20 query heads over 5 KV heads, whose query heads straddle KV groups at
tp=2 and tp=4 (Llama, Phi-3's fused projection, BitNet's sub-norms).
Models are returned in eval mode: dropout off, so the tensor-parallel copy and the
reference see the same function.
"""

from __future__ import annotations

import torch
import transformers as hf

__all__ = ["GENERATES", "build"]

# families whose model generates text (greedy tokens are compared)
GENERATES = {"phi3", "t5", "mamba", "deepseek_v3", "diffllama", "apertus", "bart", "qwen3_next", "dbrx", "mamba2",
             "mamba2_one_group", "falcon_h1", "jetmoe", "jamba",
             "olmo2", "olmo3", "bitnet", "olmoe", "olmoe_mqa", "gpt_oss", "gpt_oss_loop", "mixtral_loop",
             "llama4_text", "mpt", "bloom", "llava", "gemma3_vlm", "trocr", "llava_next", "mistral3", "audioflamingo3", "xlm", "git",
             "falcon_uneven", "falcon_alibi_uneven", "phi3_partial", "longt5", "gpt2_uneven", "mpt_uneven", "t5_uneven", "bitnet_uneven", "qwen2_uneven",
             "llama_straddle", "phi3_straddle", "bitnet_straddle", "llama_straddle_padded"}


def _llava_towers(kw: dict) -> dict:
    """A Llama text side and a CLIP vision side (32 px, 8 px patches) for LLaVA-style configs."""
    return dict(
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw),
        vision_config=dict(model_type="clip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8, **kw))


def _config(name: str, attn: str | None) -> tuple[type, hf.PreTrainedConfig]:
    kw = {} if attn is None else {"attn_implementation": attn}
    if name == "phi3":  # GQA: num_key_value_heads 2 -> 1 while num_key_value_groups stays 2
        return hf.Phi3ForCausalLM, hf.Phi3Config(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            num_hidden_layers=2, vocab_size=256, max_position_embeddings=128, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, **kw)
    if name == "phi3_partial":  # rotary on half of each head: the head count 4 maps to 2 and to 4
        # (rotate_half's halves), so which attributes go local is searched; with sdpa one of
        # the two made local still failed at o_proj, which was taken for progress
        return hf.Phi3ForCausalLM, hf.Phi3Config(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
            num_hidden_layers=2, vocab_size=256, max_position_embeddings=128, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, partial_rotary_factor=0.5, **kw)
    if name == "t5":  # relative-position bias per head, shared embedding, decoder start token
        return hf.T5ForConditionalGeneration, hf.T5Config(
            d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, num_decoder_layers=2,
            vocab_size=256, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **kw)
    if name == "longt5":  # local attention over blocks: an ellipsis einsum, a mask the trace needs
        return hf.LongT5ForConditionalGeneration, hf.LongT5Config(
            d_model=64, d_kv=16, num_heads=4, d_ff=128, num_layers=2, num_decoder_layers=2, local_radius=4,
            vocab_size=256, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **kw)
    if name == "vit":  # pixel_values in, conv patch embedding, CLS token
        return hf.ViTModel, hf.ViTConfig(
            hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
            image_size=32, patch_size=8, **kw)
    if name == "mamba":  # depthwise conv1d, selective scan over the sequence
        return hf.MambaForCausalLM, hf.MambaConfig(
            hidden_size=64, state_size=8, num_hidden_layers=2, vocab_size=256, expand=2,
            conv_kernel=4, time_step_rank=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "deepseek_v3":  # MLA (q_lora_rank, kv_lora_rank) + routed and shared experts
        return hf.DeepseekV3ForCausalLM, hf.DeepseekV3Config(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
            moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, vocab_size=256, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    if name == "diffllama":  # one scalar from four [head_dim] parameters weighs every head's second map
        return hf.DiffLlamaForCausalLM, hf.DiffLlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, **kw)
    if name == "apertus":  # xIELU: learnable [1] scalars broadcast over the sharded MLP features
        return hf.ApertusForCausalLM, hf.ApertusConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, **kw)
    # final_logits_bias [1, vocab]: a buffer added to the LM head's logits; an odd vocabulary
    # as BART's 50265 words, padded to divide (the shared table, tied to the head and both
    # embeddings, stayed whole for it)
    if name == "bart":
        return hf.BartForConditionalGeneration, hf.BartConfig(
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=257,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            decoder_start_token_id=2, forced_eos_token_id=None, **kw)
    if name == "clip":  # two towers: input_ids and pixel_values both required
        return hf.CLIPModel, hf.CLIPConfig(
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=256, max_position_embeddings=32, bos_token_id=1, eos_token_id=2,
                             pad_token_id=0, **kw),
            vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, image_size=32, patch_size=8, **kw),
            projection_dim=32, **kw)
    if name == "llava":  # a vision tower and projector whose features fill the text's image tokens
        return hf.LlavaForConditionalGeneration, hf.LlavaConfig(**_llava_towers(kw), image_token_index=3, **kw)
    if name in ("gemma3_vlm", "gemma3_vlm_whole_vision"):  # SigLIP tower, features pooled to 4 tokens per image, sliding text layers
        return hf.Gemma3ForConditionalGeneration, hf.Gemma3Config(
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
                             sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw),
            vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, image_size=32, patch_size=8, **kw),
            mm_tokens_per_image=4, image_token_index=3, boi_token_index=4, eoi_token_index=5, **kw)
    if name == "llava_next":  # tiles a base view and a pinpoint grid per image, chosen by image_sizes
        return hf.LlavaNextForConditionalGeneration, hf.LlavaNextConfig(
            **_llava_towers(kw), image_token_index=3, image_grid_pinpoints=[[32, 64], [64, 32], [64, 64]], **kw)
    if name == "mistral3":  # Pixtral cuts its patch grid to image_sizes; 2x2 patches merge into one token
        return hf.Mistral3ForConditionalGeneration, hf.Mistral3Config(
            text_config=dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw),
            vision_config=dict(model_type="pixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, head_dim=16, image_size=32, patch_size=8, **kw),
            image_token_index=3, spatial_merge_size=2, **kw)
    if name == "audioflamingo3":  # a Whisper-style audio tower, pooled, its valid frames kept by a mask
        return hf.AudioFlamingo3ForConditionalGeneration, hf.AudioFlamingo3Config(
            audio_config=dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                              num_mel_bins=16, max_source_positions=16, **kw),
            text_config=dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw),
            audio_token_id=5, **kw)
    if name == "xlm":  # its attention masks the scores with ``mask.view(bs, 1, 1, -1).expand_as(scores)``
        return hf.XLMWithLMHeadModel, hf.XLMConfig(
            emb_dim=64, n_heads=4, n_layers=2, vocab_size=256, max_position_embeddings=64,
            pad_index=0, bos_index=1, eos_index=2, **kw)
    if name == "git":  # image features prepended to the text (no placeholder): an optional pixel_values
        return hf.GitForCausalLM, hf.GitConfig(
            vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               image_size=32, patch_size=8),
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    if name == "janus":  # its vision attention reshapes by num_heads with a -1 that absorbs a wrong count
        from tpcompile.tools.shrink import shrink_config

        return hf.JanusForConditionalGeneration, shrink_config(hf.JanusConfig(**kw), 2)
    if name == "aimv2":  # a pooling head whose output is returned and read on by visual_projection
        return hf.Aimv2Model, hf.Aimv2Config(
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=256, max_position_embeddings=32, eos_token_id=2, **kw),
            vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, image_size=32, patch_size=8, use_head=True, **kw),
            projection_dim=32, **kw)
    if name == "trocr":  # its attention reads its width off the input: reshape(bsz, tgt_len, embed_dim)
        return hf.TrOCRForCausalLM, hf.TrOCRConfig(
            d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=128, vocab_size=256,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    if name == "ibert":  # quantization-aware modules returning (values, None) outside quant mode
        return hf.IBertForMaskedLM, hf.IBertConfig(
            hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
            vocab_size=256, max_position_embeddings=64, quant_mode=False, **kw)
    if name == "mpnet":  # relative position bias made once by the encoder and read by every layer
        return hf.MPNetForMaskedLM, hf.MPNetConfig(
            hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2,
            vocab_size=256, max_position_embeddings=64, relative_attention_num_buckets=32, **kw)
    if name == "qwen3_next":  # gated delta-net layers (chunked causal masks: tril) + MoE
        return hf.Qwen3NextForCausalLM, hf.Qwen3NextConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=128,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=64,
            layer_types=["linear_attention", "full_attention"], pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **kw)
    if name == "dbrx":  # experts looped over data-dependently (for e in mask.nonzero())
        return hf.DbrxForCausalLM, hf.DbrxConfig(
            d_model=64, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=256, pad_token_id=0,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2), **kw)
    if name in ("mamba2", "mamba2_one_group"):  # SSD mixer written with einsums over chunks and heads
        # one group (the usual checkpoint): B / C shared by every head, held by every rank
        # (gradients summed), and the gated norm over all heads a statistic over split features
        return hf.Mamba2ForCausalLM, hf.Mamba2Config(
            hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=4 if name == "mamba2" else 1,
            num_hidden_layers=2,
            vocab_size=256, expand=2, conv_kernel=4, chunk_size=8, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
    if name == "falcon_h1":  # Mamba-2 mixer of one group scaled by a buffer (mup_vector) narrowed per rank
        from tpcompile.tools import shrink_config

        cfg = shrink_config(hf.FalconH1Config(), 2)
        if attn is not None:
            cfg._attn_implementation = attn
        return hf.FalconH1ForCausalLM, cfg
    if name == "jetmoe":  # experts fed token groups split by data-dependent counts (.tolist())
        from tpcompile.tools import shrink_config

        cfg = shrink_config(hf.JetMoeConfig(), 2)
        cfg._attn_implementation = attn or "sdpa"
        return hf.JetMoeForCausalLM, cfg
    if name == "jamba":  # Mamba layers whose B / C / dt are normalised (params on a re-entered sum)
        from tpcompile.tools import shrink_config

        cfg = shrink_config(hf.JambaConfig(), 2)
        if attn is not None:
            cfg._attn_implementation = attn
        return hf.JambaForCausalLM, cfg
    if name in ("olmo2", "olmo3", "bitnet"):  # RMSNorms over every head's / MLP feature
        cls, config = {"olmo2": (hf.Olmo2ForCausalLM, hf.Olmo2Config), "olmo3": (hf.Olmo3ForCausalLM, hf.Olmo3Config),
                       "bitnet": (hf.BitNetForCausalLM, hf.BitNetConfig)}[name]
        extra = {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]} if name == "olmo3" else {}
        return cls, config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=256, max_position_embeddings=128, pad_token_id=0,
            bos_token_id=1, eos_token_id=2, **extra, **kw)
    if name in ("olmoe", "olmoe_mqa"):  # q_norm / k_norm over all heads, fewer KV heads than tp=4
        return hf.OlmoeForCausalLM, hf.OlmoeConfig(
            hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2 if name == "olmoe" else 1, num_experts=4, num_experts_per_tok=2,
            vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    if name == "mixtral_loop":  # transformers' per-expert loop: data-dependent, captured over every expert
        return hf.MixtralForCausalLM, hf.MixtralConfig(
            hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, vocab_size=256,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            experts_implementation="eager", **kw)
    if name in ("gpt_oss", "gpt_oss_loop"):  # expert biases added to the partial sum inside the experts' forward
        if name == "gpt_oss_loop":
            kw["experts_implementation"] = "eager"
        return hf.GptOssForCausalLM, hf.GptOssConfig(
            hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"], sliding_window=8, vocab_size=256,
            max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    if name == "llama4_text":  # complex rotary (view_as_complex), chunked attention, a NoPE layer, MoE
        return hf.Llama4ForCausalLM, hf.Llama4TextConfig(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
            intermediate_size_mlp=128, num_hidden_layers=4, interleave_moe_layer_step=2, num_local_experts=4,
            num_experts_per_tok=1, no_rope_layer_interval=4, attention_chunk_size=4, floor_scale=4,
            vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    if name == "mpt":  # ALiBi slopes built outside the attention, read inside it per head
        return hf.MptForCausalLM, hf.MptConfig(
            d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, vocab_size=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    if name == "deepseek_v4":  # grouped output projection: o_a_proj's [g * r, d] weight viewed per group
        from tpcompile.tools import shrink_config

        cfg = shrink_config(hf.AutoConfig.for_model("deepseek_v4"), 2)
        if attn is not None:
            cfg._attn_implementation = attn
        return hf.AutoModelForCausalLM._model_mapping[type(cfg)], cfg
    if name == "bloom":  # ALiBi of batch * heads rows, built outside the attention
        return hf.BloomForCausalLM, hf.BloomConfig(
            hidden_size=64, n_head=4, n_layer=2, vocab_size=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, **kw)
    # 7 heads, which no tp divides: dealt unevenly with a padding head (2/2/2/1 at tp=4)
    ids = dict(vocab_size=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    if name == "falcon_uneven":  # Falcon-7B's shape: one KV head, a fused [q heads | k | v]
        return hf.FalconForCausalLM, hf.FalconConfig(
            hidden_size=112, num_attention_heads=7, num_hidden_layers=2, multi_query=True,
            new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False, **ids)
    if name == "falcon_alibi_uneven":  # q|k|v interleaved per head: unflatten(-2, (num_heads, 3))
        return hf.FalconForCausalLM, hf.FalconConfig(
            hidden_size=112, num_attention_heads=7, num_hidden_layers=2, multi_query=False,
            new_decoder_architecture=False, parallel_attn=False, bias=True, alibi=True, **ids)
    if name == "gpt2_uneven":  # Conv1D c_attn: [Q | K | V] sections, a padding head in each
        return hf.GPT2LMHeadModel, hf.GPT2Config(n_embd=112, n_head=7, n_layer=2, n_positions=64, **ids)
    if name == "mpt_uneven":  # ALiBi sliced where it enters: the padding head repeats a slope
        return hf.MptForCausalLM, hf.MptConfig(d_model=112, n_heads=7, n_layers=2, expansion_ratio=2,
                                               max_seq_len=64, **ids)
    if name == "t5_uneven":  # the relative-position bias: an embedding with a column per head
        return hf.T5ForConditionalGeneration, hf.T5Config(
            d_model=112, d_kv=16, num_heads=7, d_ff=128, num_layers=2, num_decoder_layers=2,
            decoder_start_token_id=0, **{**ids, "eos_token_id": 1})
    if name == "qwen2_uneven":  # 14 heads over 2 KV heads: at tp=4 each group's 7 on two ranks, 4 + 3 and a pad
        return hf.Qwen2ForCausalLM, hf.Qwen2Config(
            hidden_size=112, intermediate_size=128, num_hidden_layers=2, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=128, **ids)
    if name == "bitnet_uneven":  # a statistic over the heads' output: padding would enter it, kept whole
        return hf.BitNetForCausalLM, hf.BitNetConfig(
            hidden_size=112, intermediate_size=128, num_hidden_layers=2, num_attention_heads=7,
            num_key_value_heads=7, max_position_embeddings=128, **ids)
    # 20 query heads over 5 KV heads (BitNet-2B's, Phi-3-medium's 40 / 10 halved): at tp=4
    # and tp=2 a rank's query heads straddle KV groups, each rank holding one copy of a
    # KV head per query head that reads it
    if name == "llama_straddle":
        return hf.LlamaForCausalLM, hf.LlamaConfig(
            hidden_size=160, intermediate_size=128, num_hidden_layers=2, num_attention_heads=20,
            num_key_value_heads=5, max_position_embeddings=128, **ids)
    if name == "llama_straddle_padded":  # 10 heads over 5 KV heads: at tp=4 dealt 3/3/2/2 with padding, straddling
        return hf.LlamaForCausalLM, hf.LlamaConfig(
            hidden_size=80, intermediate_size=128, num_hidden_layers=2, num_attention_heads=10,
            num_key_value_heads=5, max_position_embeddings=128, **ids)
    if name == "phi3_straddle":  # a fused [Q | K | V] projection sliced by config.num_key_value_heads
        return hf.Phi3ForCausalLM, hf.Phi3Config(
            hidden_size=160, intermediate_size=128, num_hidden_layers=2, num_attention_heads=20,
            num_key_value_heads=5, max_position_embeddings=128, **ids)
    if name == "bitnet_straddle":  # BitNet-2B's heads: sub-norms over the straddling heads' output
        return hf.BitNetForCausalLM, hf.BitNetConfig(
            hidden_size=160, intermediate_size=128, num_hidden_layers=2, num_attention_heads=20,
            num_key_value_heads=5, max_position_embeddings=128, **ids)
    raise KeyError(f"no tiny builder for family {name!r}")


class _I0(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.special.i0(x)


def build(name: str, attn: str | None = None, *, meta: bool = False) -> torch.nn.Module:
    """The tiny ``name`` model with seed 0 weights (``attn``: attention implementation)."""
    cls, cfg = _config(name, attn)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return cls(cfg).eval()
    model = cls(cfg).eval()
    if name == "gemma3_vlm_whole_vision":
        # an op no rule knows (Bessel's i0) between the vision MLP's column and row: the
        # image inputs cannot be split, so the text is planned alone, the vision side
        # whole and never captured (its pooling head's nn.MultiheadAttention reads its
        # out_proj's weight outside out_proj's forward)
        for mlp in (m for n, m in model.named_modules() if n.startswith("model.vision_tower") and n.endswith("mlp")):
            mlp.activation_fn = _I0()
    if name == "aimv2":  # float64: its embeddings are normalised from a small norm, so the head's
        return model.double()  # gradients reach ~400 and fp32 rounds them by ~1e-4 (rel 4e-7)
    if name.startswith("gpt_oss"):  # its expert biases start at zero, which would hide where they are added
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith("_bias"):
                    p.normal_(std=0.5)
    return model
