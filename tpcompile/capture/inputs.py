"""Example inputs read off the model itself: what its forward needs to run once.

Capture, the dry-run self-check and ``verify`` all need one batch the model accepts.
Text decoders take ``input_ids``; a ViT takes ``pixel_values``, Whisper
``input_features``, wav2vec2 ``input_values``, T5 and BART also ``decoder_input_ids``.
Nothing here knows a family by name: the main input comes from
``model.main_input_name`` (every ``PreTrainedModel`` declares it), its shape from the
config's sizes (image size and channels, mel bins and source positions, the vocabulary),
and extra required arguments from the forward signature.  A dual-tower model (CLIP,
SigLIP: one sub-config per modality, no placeholder token that splices one modality into
the other's sequence) needs every modality its forward takes, so each is built too.  A
model this cannot serve gets a :class:`TPError` asking for ``example_inputs=``.

A vision- or audio-language model (an image or audio token in its config, an encoder
method) also gets its image or audio input and one placeholder per feature
(:mod:`.splice`), so its towers are captured.  :func:`text_only` marks a model whose
image or audio inputs could not be captured or split: every later default batch of it is
the text alone, so all traces agree.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import TPError
from .splice import spliced_inputs

__all__ = ["example_inputs", "forward_params"]


def _config(model: nn.Module) -> Any:
    return getattr(model, "config", None)


def _find(config: Any, *names: str, sub: tuple[str, ...] = ()) -> Any:
    """First of ``names`` set on ``config`` or on one of its sub-configs ``sub``."""
    for holder in (config, *(getattr(config, s, None) for s in sub)):
        if holder is None:
            continue
        for n in names:
            v = getattr(holder, n, None)
            if v is not None:
                return v
    return None


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, int):
        return v, v
    return int(v[0]), int(v[1])


def _vocab(config: Any) -> int:
    v = _find(config, "vocab_size", sub=("text_config", "decoder"))
    return int(v) if isinstance(v, int) and v > 0 else 2


def _token_ids(config: Any, batch: int, seq: int, device: Any, gen: torch.Generator | None) -> torch.Tensor:
    if gen is None:  # capture: the values never matter, zeros keep it deterministic
        return torch.zeros(batch, seq, dtype=torch.long, device=device)
    return torch.randint(0, _vocab(config), (batch, seq), generator=gen).to(device)


_DEFAULT_IMAGE_SIZE = 224
# Example sizes that cannot be mistaken for model sizes in the traced graph's shape
# constants: the fix-up pass skips constants <= 1, and no model has 7 heads.
_EXAMPLE_BATCH = 1
_EXAMPLE_SEQ = 7


def _floats(shape: tuple[int, ...], dtype: torch.dtype, device: Any, gen: torch.Generator | None) -> torch.Tensor:
    if gen is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def _main_input(name: str, config: Any, batch: int, seq: int, dtype: torch.dtype, device: Any,
                gen: torch.Generator | None) -> torch.Tensor:
    if name == "input_ids":
        return _token_ids(config, batch, seq, device, gen)
    if name == "pixel_values":
        towers = ("vision_config", "backbone_config", "encoder_config")
        size = _find(config, "image_size", "img_size", sub=towers)
        channels = _find(config, "num_channels", "in_channels", sub=towers) or 3
        # a convolutional model with no fixed size (ResNet, RegNet, SegFormer, DETR-style
        # detectors) takes any size: use the crop its image processor produces
        h, w = _pair(size if size is not None else _DEFAULT_IMAGE_SIZE)
        return _floats((batch, int(channels), h, w), dtype, device, gen)
    if name == "input_features":
        mels = _find(config, "num_mel_bins", sub=("audio_config", "encoder"))
        positions = _find(config, "max_source_positions", sub=("audio_config", "encoder"))
        if mels is not None and positions is not None:
            # Whisper-style encoders check the frame count: two conv frames per position
            return _floats((batch, int(mels), 2 * int(positions)), dtype, device, gen)
        # a speech encoder's own config (Parakeet, LASR: ``encoder_config.num_mel_bins``)
        audio = ("audio_config", "encoder", "encoder_config")
        per_frame = _find(config, "input_feat_per_channel", "feature_size", "num_mel_bins",
                          "feature_projection_input_dim", sub=audio)
        channels = _find(config, "input_channels", sub=audio) or 1
        if per_frame is None:
            raise TPError("the model takes input_features but its config gives no feature size; pass example_inputs=")
        return _floats((batch, 4 * seq, int(per_frame) * int(channels)), dtype, device, gen)
    if name == "input_values":
        mels, frames = _find(config, "num_mel_bins"), _find(config, "max_length")
        if isinstance(mels, int) and isinstance(frames, int):
            # a spectrogram of a fixed frame count (Audio Spectrogram Transformer: its
            # position table holds one row per patch of exactly that many frames)
            return _floats((batch, frames, mels), dtype, device, gen)
        # raw audio: long enough for a strided conv feature encoder to leave a few frames
        kernels = _find(config, "conv_kernel") or [10]
        strides = _find(config, "conv_stride") or [5]
        length = 1
        for k, s in reversed(list(zip(kernels, strides, strict=False))):
            length = (length - 1) * int(s) + int(k)
        frames = max(seq, 2)
        return _floats((batch, length + (frames - 1) * _prod(strides)), dtype, device, gen)
    raise TPError(
        f"tpcompile cannot build a {name!r} input for {type(config).__name__}; pass "
        "example_inputs=dict(...) with one batch the model's forward accepts"
    )


_MODALITY_INPUTS = ("input_ids", "pixel_values", "input_features", "input_values")
_TOWER_CONFIGS = ("text_config", "vision_config", "audio_config", "speech_config")
# a config naming one of these splices that modality into the text sequence (a VLM): its
# forward takes pixels only together with matching placeholder tokens (:mod:`.splice`)
_SPLICE_TOKENS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index",
                  "audio_token_id", "audio_token_index")


def _tower_inputs(config: Any, params: Any, main: str) -> list[str]:
    """The other modality inputs a dual-tower model needs beside ``main``."""
    if any(getattr(config, t, None) is not None for t in _SPLICE_TOKENS):
        return []
    if sum(getattr(config, s, None) is not None for s in _TOWER_CONFIGS) < 2:
        return []
    return [n for n in _MODALITY_INPUTS if n != main and n in params]


def _prefix_images(model: nn.Module, config: Any, params: Any, text: dict[str, Any],
                   pixels: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
    """``pixel_values`` beside ``text`` for a text model with one vision tower and an
    optional ``pixel_values`` that no placeholder token splices (GIT prepends its image
    features to the text), where one fake forward of the model takes them (GIT's batch of
    images; Idefics' image lists need masks too, and get none): the tower is captured
    then too; where it cannot be, :func:`text_only` plans the text alone."""
    from .fake import shape_trace

    holders = [h for h in (config, getattr(config, "text_config", None)) if h is not None]
    if ("pixel_values" not in params or getattr(config, "vision_config", None) is None
            or sum(getattr(config, s, None) is not None for s in _TOWER_CONFIGS) > 1
            or any(getattr(h, t, None) is not None for h in holders for t in _SPLICE_TOKENS)):
        return {}
    try:
        images = {"pixel_values": pixels()}
        shape_trace(model, {**text, **images})
    except Exception:  # noqa: BLE001 - not this layout, or more than pixels needed
        return {}
    return images


def _prod(values: Any) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def _param_dtype(model: nn.Module) -> tuple[torch.dtype, Any]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.float32, torch.device("cpu")


def example_inputs(
    model: nn.Module,
    *,
    batch: int = 1,
    seq: int = 7,
    generator: torch.Generator | None = None,
    labels: bool = False,
    splice: bool = True,
) -> dict[str, torch.Tensor]:
    """Keyword inputs for one forward of ``model``, built from the model itself.

    Args:
        model: a Hugging Face model (anything with ``main_input_name`` and a ``config``),
            or a plain module whose forward takes token ids first.
        batch / seq: batch size and token count (image and audio inputs take their
            length from the config).
        generator: draw real random values (token ids in the vocabulary, normal
            floats); ``None`` gives zeros, enough for tracing.
        labels: also build ``labels`` for a loss (token labels shaped like the
            decoder's or the main input's ids) where the forward takes them.
        splice: for a model that splices image features into its text at placeholder
            tokens (LLaVA, Gemma 3), also build ``pixel_values`` and one placeholder per
            feature; ``False``: the text alone.

    Example:
        >>> example_inputs(ViTModel(ViTConfig(image_size=32)))["pixel_values"].shape
        torch.Size([1, 3, 32, 32])
    """
    config = _config(model)
    dtype, device = _param_dtype(model)
    name = getattr(model, "main_input_name", "input_ids")
    params = forward_params(model)
    if config is None:
        if name != "input_ids":
            raise TPError(f"{type(model).__name__} has no config to size {name!r}; pass example_inputs=")
        return {next(iter(params), "input_ids"): _token_ids(config, batch, seq, device, generator)}
    spliced = spliced_inputs(
        model, params, batch, seq,
        main_input=lambda n: _main_input(n, config, batch, seq, dtype, device, generator),
        token_ids=lambda n: _token_ids(config, batch, n, device, generator),
    ) if name == "input_ids" and splice else None
    out = spliced or {name: _main_input(name, config, batch, seq, dtype, device, generator)}
    if spliced is None and splice and name == "input_ids":
        out.update(_prefix_images(model, config, params, out, lambda: _main_input(
            "pixel_values", config, batch, seq, dtype, device, generator)))
    for other in _tower_inputs(config, params, name):
        try:
            out[other] = _main_input(other, config, batch, seq, dtype, device, generator)
        except TPError:  # nothing in the config sizes it: the capture error will say so
            continue
    if "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
        start = getattr(config, "decoder_start_token_id", None)
        ids = _token_ids(config, batch, seq, device, generator)
        if start is not None:
            ids[:, 0] = int(start) % _vocab(config)
        out["decoder_input_ids"] = ids
    if labels and "labels" in params:
        ref = out.get("decoder_input_ids", out.get("input_ids"))
        if ref is not None:
            out["labels"] = _token_ids(config, batch, ref.shape[1], device, generator)
    return out


def forward_params(model: nn.Module) -> Any:
    """The forward's parameters; a wrapper whose forward takes ``*args, **kwargs`` alone (a
    ``PeftModel`` without a task type, around T5) has its base model's."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    base = getattr(model, "get_base_model", None)
    if params and all(p.kind in variadic for p in params.values()) and callable(base) and base() is not model:
        return forward_params(base())
    return params


def _example_inputs(model: nn.Module, splice: bool = True) -> tuple[tuple, dict]:
    splice = splice and model not in _TEXT_ONLY
    return (), example_inputs(model, batch=_EXAMPLE_BATCH, seq=_EXAMPLE_SEQ, splice=splice)


# Models whose image or audio inputs the capture could not trace: every later default capture and
# fake forward of them takes the text alone, so all agree on one graph
_TEXT_ONLY: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def text_only(model: nn.Module, err: Exception) -> bool:
    """After a default capture or plan of ``model`` failed on image or audio inputs
    spliced into its text: whether the text alone can stand in for them.  If so the model
    is marked (every later default capture and fake forward of it takes the text alone)
    and a warning names what stays whole."""
    if model in _TEXT_ONLY:
        return False
    extra = set(_example_inputs(model)[1]) - set(_example_inputs(model, splice=False)[1])
    if not extra:
        return False
    _TEXT_ONLY.add(model)
    kinds = [k for k, key in (("image", "pixel_values"), ("audio", "input_features")) if key in extra]
    sides = " and ".join({"image": "vision", "audio": "audio"}[k] for k in kinds) or "other"
    warnings.warn(
        f"tpcompile: {type(model).__name__} did not capture or split with its {' and '.join(kinds)} inputs "
        f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); planned the text alone, "
        f"so its {sides} side stays whole. Pass example_inputs= with {', '.join(sorted(extra))} and their "
        "placeholder tokens to split it.",
        stacklevel=3,
    )
    return True
