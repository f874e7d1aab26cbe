"""Named model presets with the real dimensions of well-known Hugging Face checkpoints.

The compiler never needs real weights to plan a tensor-parallel layout: the module
tree, parameter shapes and dataflow are enough.  The presets here let the CLI
(``python -m tpcompile dump-plan NAME``) and the test-suite build full-size models on
the ``meta`` device without any hub access, and build *tiny* CPU models of the same
families for numerical tests.

Each :class:`Preset` carries the ``config.json`` fields that shape the model, copied
from the published checkpoint named in :attr:`Preset.checkpoint`.  RoPE settings are
stored in the transformers-5 form (``rope_parameters``), which is what the published
``rope_theta`` / ``rope_scaling`` keys are converted into on load.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    PreTrainedConfig,
)

from ..errors import TPError
from ..integrations.hf_classes import TASK_CAUSAL_LM, TASK_MASKED_LM, TASKS, model_class

__all__ = [
    "ALIASES",
    "PRESETS",
    "TASK_CAUSAL_LM",
    "TASK_MASKED_LM",
    "Preset",
    "build_config",
    "build_meta_model",
    "build_meta_model_from_config",
    "get_preset",
    "list_presets",
    "load_config_path",
    "tiny_config",
]

_TASKS = TASKS


@dataclass(kw_only=True, frozen=True)
class Preset:
    """A named model: family, source checkpoint, and the config fields that matter.

    ``config`` is shared module state; treat it as read-only.  :func:`build_config`
    deep-copies it before handing it to transformers (which mutates some nested
    dicts, e.g. ``rope_parameters``, in place).
    """

    name: str
    model_type: str
    checkpoint: str
    config: dict[str, Any] = field(default_factory=dict)
    task: str = TASK_CAUSAL_LM

    def __post_init__(self) -> None:
        if self.task not in _TASKS:
            raise ValueError(
                f"preset {self.name!r}: task must be one of {_TASKS}, got {self.task!r}"
            )


def _rope(theta: float, **extra: Any) -> dict[str, Any]:
    """RoPE settings in transformers-5 ``rope_parameters`` form."""
    params: dict[str, Any] = {"rope_theta": float(theta), "rope_type": "default"}
    params.update(extra)
    return params


# Fields shared by the Llama-style decoders, as published: SwiGLU MLP, untied
# output head, bf16 weights.
_SILU_DECODER: dict[str, Any] = {
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}

# Llama 3.x share everything but width/depth; the 128k vocabulary and GQA with
# 8 KV heads are what make their embedding/attention sharding interesting.
_LLAMA3_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    **_SILU_DECODER,
    "vocab_size": 128256,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
}

# Mistral-7B and Mixtral-8x7B share the transformer body dimensions.
_MISTRAL_7B_BODY: dict[str, Any] = {
    **_SILU_DECODER,
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
}

_PRESET_LIST: list[Preset] = [
    Preset(
        name="llama",
        model_type="llama",
        checkpoint="meta-llama/Meta-Llama-3-8B",
        config={
            **_LLAMA3_COMMON,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "max_position_embeddings": 8192,
            "rope_parameters": _rope(500000.0),
        },
    ),
    Preset(
        name="llama-70b",
        model_type="llama",
        checkpoint="meta-llama/Meta-Llama-3-70B",
        config={
            **_LLAMA3_COMMON,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_hidden_layers": 80,
            "num_attention_heads": 64,
            "max_position_embeddings": 8192,
            "rope_parameters": _rope(500000.0),
        },
    ),
    Preset(
        name="llama-405b",
        model_type="llama",
        checkpoint="meta-llama/Llama-3.1-405B",
        config={
            **_LLAMA3_COMMON,
            "hidden_size": 16384,
            "intermediate_size": 53248,
            "num_hidden_layers": 126,
            "num_attention_heads": 128,
            "max_position_embeddings": 131072,
            # Llama 3.1 extends the 8k pre-training context to 128k with "llama3" scaling.
            "rope_parameters": _rope(
                500000.0,
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
        },
    ),
    Preset(
        name="mistral",
        model_type="mistral",
        checkpoint="mistralai/Mistral-7B-v0.1",
        config={
            "architectures": ["MistralForCausalLM"],
            **_MISTRAL_7B_BODY,
            "rope_parameters": _rope(10000.0),
            "sliding_window": 4096,
        },
    ),
    Preset(
        name="qwen2",
        model_type="qwen2",
        checkpoint="Qwen/Qwen2-7B",
        config={
            "architectures": ["Qwen2ForCausalLM"],
            **_SILU_DECODER,
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-6,
            "rope_parameters": _rope(1000000.0),
            # Published with sliding windows configured but disabled.
            "use_sliding_window": False,
            "sliding_window": 131072,
            "max_window_layers": 28,
        },
    ),
    Preset(
        name="qwen3",
        model_type="qwen3",
        checkpoint="Qwen/Qwen3-8B",
        config={
            "architectures": ["Qwen3ForCausalLM"],
            **_SILU_DECODER,
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "rope_parameters": _rope(1000000.0),
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 36,
        },
    ),
    Preset(
        name="gemma2",
        model_type="gemma2",
        checkpoint="google/gemma-2-9b",
        config={
            "architectures": ["Gemma2ForCausalLM"],
            "vocab_size": 256000,
            "hidden_size": 3584,
            "intermediate_size": 14336,
            "num_hidden_layers": 42,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            # head_dim * heads (4096) != hidden_size (3584): q/o projections are not square.
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6,
            "rope_parameters": _rope(10000.0),
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "tie_word_embeddings": True,
            "pad_token_id": 0,
            "dtype": "float32",
        },
    ),
    Preset(
        name="phi3",
        model_type="phi3",
        checkpoint="microsoft/Phi-3-mini-4k-instruct",
        config={
            # Fused qkv_proj and gate_up_proj: the planner must split these per shard.
            "architectures": ["Phi3ForCausalLM"],
            **_SILU_DECODER,
            "vocab_size": 32064,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_parameters": _rope(10000.0),
            "sliding_window": 2047,
            "pad_token_id": 32000,
        },
    ),
    Preset(
        name="gpt2",
        model_type="gpt2",
        checkpoint="openai-community/gpt2",
        config={
            # GPT-2 keeps its historical field names (n_embd, n_layer, ...) and uses
            # Conv1D (transposed Linear) layers, which the planner must special-case.
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": 50257,
            "n_embd": 768,
            "n_layer": 12,
            "n_head": 12,
            "n_inner": None,
            "n_positions": 1024,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": True,
            "dtype": "float32",
        },
    ),
    Preset(
        name="gpt_neox",
        model_type="gpt_neox",
        checkpoint="EleutherAI/pythia-1.4b",
        config={
            # Fused query_key_value with per-head interleaving, partial rotary (25%)
            # and parallel residual: three distinct sharding hazards in one family.
            "architectures": ["GPTNeoXForCausalLM"],
            "vocab_size": 50304,
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "hidden_act": "gelu",
            "max_position_embeddings": 2048,
            "layer_norm_eps": 1e-5,
            "rope_parameters": _rope(10000.0, partial_rotary_factor=0.25),
            "use_parallel_residual": True,
            "dtype": "float16",
        },
    ),
    Preset(
        name="mixtral",
        model_type="mixtral",
        checkpoint="mistralai/Mixtral-8x7B-v0.1",
        config={
            "architectures": ["MixtralForCausalLM"],
            # Each expert MLP has Mistral-7B's shape; attention is identical too.
            **_MISTRAL_7B_BODY,
            "rope_parameters": _rope(1000000.0),
            "sliding_window": None,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.02,
        },
    ),
    Preset(
        name="bert",
        model_type="bert",
        checkpoint="google-bert/bert-base-uncased",
        task=TASK_MASKED_LM,
        config={
            "architectures": ["BertForMaskedLM"],
            "vocab_size": 30522,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "hidden_act": "gelu",
            "max_position_embeddings": 512,
            "type_vocab_size": 2,
            "layer_norm_eps": 1e-12,
            "pad_token_id": 0,
            "tie_word_embeddings": True,
            "dtype": "float32",
        },
    ),
]

PRESETS: dict[str, Preset] = {p.name: p for p in _PRESET_LIST}

# Alternative spellings people actually type; each resolves to a canonical preset.
ALIASES: dict[str, str] = {
    "llama-8b": "llama",
    "llama3-8b": "llama",
    "llama-3-8b": "llama",
    "llama3-70b": "llama-70b",
    "llama3.1-405b": "llama-405b",
    "llama-3.1-405b": "llama-405b",
    "mistral-7b": "mistral",
    "qwen2-7b": "qwen2",
    "qwen3-8b": "qwen3",
    "gemma2-9b": "gemma2",
    "gemma-2-9b": "gemma2",
    "phi3-mini": "phi3",
    "phi-3-mini": "phi3",
    "gpt-neox": "gpt_neox",
    "pythia-1.4b": "gpt_neox",
    "mixtral-8x7b": "mixtral",
    "bert-base-uncased": "bert",
}

# Aliases must never shadow a preset or point nowhere; fail at import, not at use.
assert not set(ALIASES) & set(PRESETS), "alias shadows a preset name"
assert set(ALIASES.values()) <= set(PRESETS), "alias points to an unknown preset"


def list_presets() -> list[str]:
    """Canonical preset names, sorted."""
    return sorted(PRESETS)


def get_preset(name: str) -> Preset:
    """Return the preset called ``name`` (or one of its aliases), case-insensitively.

    Raises ``KeyError`` listing every accepted name when ``name`` is unknown.
    """
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    try:
        return PRESETS[key]
    except KeyError:
        available = ", ".join(sorted([*PRESETS, *ALIASES]))
        raise KeyError(f"unknown model preset {name!r}; available: {available}") from None


def _resolve(preset_or_name: Preset | str) -> Preset:
    return preset_or_name if isinstance(preset_or_name, Preset) else get_preset(preset_or_name)


def _canonical_keys(model_type: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """Rename generic field names to the family's own (GPT-2: hidden_size -> n_embd).

    Without this, an override ``num_hidden_layers=2`` would sit next to the preset's
    ``n_layer=12`` and which one wins would depend on transformers internals.
    """
    attribute_map: dict[str, str] = CONFIG_MAPPING[model_type].attribute_map or {}
    return {attribute_map.get(k, k): v for k, v in fields.items()}


def _fold_legacy_rope(fields: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Apply ``rope_theta`` / ``rope_scaling`` overrides onto ``rope_parameters``.

    transformers 5 silently ignores the legacy keys when ``rope_parameters`` is also
    given, so an override in the familiar config.json spelling would be lost.
    """
    if "rope_parameters" not in fields or "rope_parameters" in overrides:
        return
    rope = dict(fields["rope_parameters"] or {})
    if "rope_scaling" in overrides:
        # Replace the scaling but keep what is not scaling (theta, partial rotary).
        kept = {k: v for k, v in rope.items() if k in ("rope_theta", "partial_rotary_factor")}
        scaling = dict(overrides.pop("rope_scaling") or {})
        # config.json's older spelling of the scaling kind is "type".
        rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
        rope = {**kept, **scaling, "rope_type": rope_type}
    if "rope_theta" in overrides:
        rope["rope_theta"] = float(overrides.pop("rope_theta"))
    fields["rope_parameters"] = rope


def _config_fields(preset: Preset, overrides: Mapping[str, Any]) -> dict[str, Any]:
    fields = _canonical_keys(preset.model_type, copy.deepcopy(preset.config))
    extra = _canonical_keys(preset.model_type, copy.deepcopy(dict(overrides)))
    _fold_legacy_rope(fields, extra)
    fields.update(extra)
    # model_type is fixed by the preset; a stray copy in the fields would be ambiguous.
    fields.pop("model_type", None)
    return fields


def build_config(preset_or_name: Preset | str, **overrides: Any) -> PreTrainedConfig:
    """Build the transformers config of a preset, with optional field overrides.

    Overrides use config.json field names; the family's own spelling and the generic
    one are both accepted (``num_hidden_layers`` and ``n_layer`` for GPT-2).
    """
    preset = _resolve(preset_or_name)
    return AutoConfig.for_model(preset.model_type, **_config_fields(preset, overrides))


# Shrunk dimensions for CPU tests, by generic field name.  Only fields the preset
# already sets are replaced, so each family keeps its own structure (bias, fused
# projections, softcapping, ...) while becoming small enough to run instantly.
_TINY_FIELDS: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "original_max_position_embeddings": 128,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_window_layers": 2,
}
_TINY_KV_HEADS_GQA = 2
_TINY_SLIDING_WINDOW = 16
# Families whose MLP width is not called intermediate_size and is not in attribute_map.
_TINY_EXTRA_ALIASES: dict[str, dict[str, str]] = {"gpt2": {"intermediate_size": "n_inner"}}
_SPECIAL_TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _shrink_token_id(token_id: Any, vocab_size: int) -> Any:
    # Folding ids into the tiny vocabulary keeps distinct ids mostly distinct (bos vs
    # eos) while keeping e.g. an embedding padding_idx in range.
    if isinstance(token_id, int):
        return token_id % vocab_size
    if isinstance(token_id, list):
        return [t % vocab_size if isinstance(t, int) else t for t in token_id]
    return token_id


def tiny_config(name: Preset | str, **overrides: Any) -> PreTrainedConfig:
    """A CPU-sized config of the same family as preset ``name``, for tests.

    hidden 64, 2 layers, 4 heads (2 KV heads where the family uses GQA; MHA families
    stay MHA), MLP 128, vocab 256, 128 positions, head_dim 16 where the config has
    that field, 4 experts with top-2 routing for MoE, sliding windows of 16, and
    float32 weights.  ``overrides`` are applied last.
    """
    preset = _resolve(name)
    base = _canonical_keys(preset.model_type, preset.config)
    aliases = _TINY_EXTRA_ALIASES.get(preset.model_type, {})
    shrink: dict[str, Any] = {}
    for generic, value in _canonical_keys(preset.model_type, _TINY_FIELDS).items():
        key = aliases.get(generic, generic)
        if key in base:
            shrink[key] = value

    if "num_key_value_heads" in base:
        is_gqa = base["num_key_value_heads"] < base["num_attention_heads"]
        tiny_heads = _TINY_FIELDS["num_attention_heads"]
        shrink["num_key_value_heads"] = _TINY_KV_HEADS_GQA if is_gqa else tiny_heads
    if base.get("sliding_window") is not None:
        shrink["sliding_window"] = _TINY_SLIDING_WINDOW
    rope = base.get("rope_parameters")
    if isinstance(rope, dict) and "original_max_position_embeddings" in rope:
        # Scaled RoPE (llama3, yarn, ...) requires the pre-training context to be
        # shorter than the extended one; keep the published extension factor.
        tiny_max = _TINY_FIELDS["max_position_embeddings"]
        factor = rope.get("factor") or 1.0
        rope = {**rope, "original_max_position_embeddings": max(1, int(tiny_max // factor))}
        shrink["rope_parameters"] = rope
    vocab = overrides.get("vocab_size", shrink.get("vocab_size"))
    if isinstance(vocab, int):
        # Presets omit bos/eos ids (irrelevant to sharding), so the family defaults
        # apply and may lie outside the tiny vocabulary too (gpt2: 50256).
        defaults = CONFIG_MAPPING[preset.model_type]()
        for key in _SPECIAL_TOKEN_FIELDS:
            token_id = base.get(key, getattr(defaults, key, None))
            if token_id is not None:
                shrink[key] = _shrink_token_id(token_id, vocab)
    # Numerical tests compare against float32 references; bf16 on CPU is slow and lossy.
    shrink["dtype"] = "float32"
    shrink.update(overrides)
    return build_config(preset, **shrink)


def _no_init_weights() -> AbstractContextManager[None]:
    # transformers already skips its own init on meta, but every nn.Linear still runs
    # torch's kaiming_uniform_ in reset_parameters; skipping it saves about a third.
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older/newer layouts: just skip the speed-up
        return nullcontext()
    return no_init_weights()


def build_meta_model_from_config(
    config: PreTrainedConfig, task: str | None = None
) -> torch.nn.Module:
    """Instantiate ``config`` on the meta device (no memory, no weight init).

    ``task`` is ``"causal-lm"`` or ``"masked-lm"``; when omitted the class is the one
    :func:`~tpcompile.integrations.hf_classes.model_class` picks (the config's
    architectures, else the richest head its type registers: seq2seq, LM, bare model),
    so any family's config can be planned.  The model's default attention
    implementation is kept, so plans reflect what users actually run.
    """
    try:
        auto_cls: Any = model_class(config, task)
    except TPError as exc:
        raise ValueError(str(exc)) from None
    with torch.device("meta"), _no_init_weights():
        model = auto_cls._from_config(config)
    # no_init_weights also stubs PreTrainedModel.init_weights, which is where
    # transformers ties the output head to the embeddings; redo the tying, otherwise
    # tied families (gpt2, gemma2, bert) would get a separate lm_head parameter.
    model.tie_weights()
    return model


def build_meta_model(
    preset_or_name: Preset | str,
    *,
    config: PreTrainedConfig | None = None,
    **overrides: Any,
) -> torch.nn.Module:
    """Build a preset's full-size model on the meta device.

    ``config`` replaces the preset's config (the preset then only chooses the task);
    otherwise ``overrides`` are applied to the preset's fields, e.g.
    ``build_meta_model("llama-405b", num_hidden_layers=4)``.
    """
    preset = _resolve(preset_or_name)
    if config is not None and overrides:
        raise TypeError("pass either config= or field overrides to build_meta_model, not both")
    if config is None:
        config = build_config(preset, **overrides)
    return build_meta_model_from_config(config, task=preset.task)


def load_config_path(path: str | Path) -> PreTrainedConfig:
    """Load a config from a local model directory (with config.json) or a config.json file.

    Never touches the network.  Raises ``FileNotFoundError`` naming the path when
    nothing is there, and ``ValueError`` when the file is not a usable HF config.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
    elif path.is_file():
        config_file = path
    else:
        raise FileNotFoundError(f"no model directory or config.json at {path}")

    try:
        # transformers writes non-finite floats as {"__float__": "Infinity"} (Mamba-2's
        # time_step_limit); read them back as from_pretrained does
        data = json.loads(config_file.read_text(encoding="utf-8"), object_hook=_special_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_file} is not a valid JSON config file: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} must hold a JSON object, not {type(data).__name__}")
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ValueError(f"{config_file} has no 'model_type' field; is it a Hugging Face config?")
    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{config_file}: model_type {model_type!r} is not supported by the installed "
            "transformers (custom remote-code models are not loaded)"
        )
    # from_dict is what from_pretrained uses after fetching the file, including the
    # conversion of legacy keys such as rope_theta/rope_scaling.
    return CONFIG_MAPPING[model_type].from_dict(data)


def _special_float(obj: dict) -> object:
    if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
        return float(obj["__float__"].replace("Infinity", "inf"))
    return obj
