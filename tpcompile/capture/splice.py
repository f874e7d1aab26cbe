"""Modalities spliced into the text: pixels or audio and one placeholder per feature.

A vision- or audio-language model (LLaVA, Gemma 3, Mistral 3, Audio Flamingo 3) embeds
its image or audio with a tower and a projector, and writes each feature vector over one
placeholder token of the text (``masked_scatter``).  Its forward takes the tower's input
only together with exactly as many placeholders as the tower gives features, so the
capture's example batch needs that count: without it the towers are never run, never
captured, and stay whole.

Nothing here knows a family.  A modality is there when the config names its placeholder
(``image_token_id``, ``audio_token_index`` ...), the model (or the base model a head
wraps) offers its encoder (``get_image_features``, ``get_audio_features``), and the
forward takes its main input.  The count is what the encoder returns for one example,
run on fake tensors (no compute, no memory) over each layout the encoder may take:

* pixels as a batch of images, of one-image lists (Idefics 3), of tile lists (LLaVA-NeXT:
  a base view and the tiles of the largest grid pinpoint, each image's own count sliced
  off by the model), with each image's ``image_sizes`` as a Python list, a constant of
  the trace (LLaVA-NeXT tiles by it, Pixtral cuts its patch grid to it);
* audio features as the config sizes them (Whisper's ``[batch, mels, frames]``), every
  frame valid: the masks the encoder requires all ones, over the last dim or the second.

A count that only data decides is read at its bound, every position kept, where the
data is the all-ones masks built here (Audio Flamingo 3 keeps ``embeds[valid_mask]``):
that is what they select, and the capture answers the same question the same way
(:mod:`.branches`).  A count decided by other data (Idefics 3 drops images by their
pixel values) has no such answer, and that modality is left out.  A modality whose encoder needs more
than these (Qwen2-VL's patch grid, a tensor it derives positions from) is left out: the
text is captured without it, and that tower stays whole.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["MODALITIES", "spliced_inputs"]


@dataclass(frozen=True)
class Modality:
    """One kind of input a model splices into its text."""

    tokens: tuple[str, ...]  # config keys of its placeholder id
    encoder: str  # the method that turns the input into features
    main: str  # the forward's keyword for the input


MODALITIES = (
    Modality(("image_token_id", "image_token_index"), "get_image_features", "pixel_values"),
    Modality(("audio_token_id", "audio_token_index"), "get_audio_features", "input_features"),
)


def _placeholder(config: Any, m: Modality) -> int | None:
    """The id of ``m``'s placeholder token, on the config or its text config."""
    for holder in (config, getattr(config, "text_config", None)):
        for key in m.tokens:
            v = getattr(holder, key, None) if holder is not None else None
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def encoder_side(model: nn.Module, method: str) -> Any:
    """The module offering ``method``: the model, or the base model a head wraps
    (Janus's ``JanusForConditionalGeneration.model``)."""
    for holder in (model, getattr(model, "model", None)):
        if holder is not None and hasattr(holder, method):
            return holder
    return None


def _pixel_layouts(config: Any, pixels: torch.Tensor) -> Iterator[torch.Tensor]:
    """``pixels`` as a batch of images, of one-image lists, and of tile lists as long as
    the largest grid pinpoint's tiles plus the base view."""
    yield pixels
    yield pixels.unsqueeze(1)
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    h, w = pixels.shape[-2:]
    if isinstance(pinpoints, list | tuple) and pinpoints and h and w:
        tiles = 1 + max(int(a) // h * (int(b) // w) for a, b in pinpoints)
        yield pixels.unsqueeze(1).expand(-1, tiles, -1, -1, -1).contiguous()


def _candidates(m: Modality, config: Any, side: Any, main: torch.Tensor) -> Iterator[dict[str, Any]]:
    """Each way to hand ``main`` to ``side``'s encoder, with what else it reads."""
    params = inspect.signature(getattr(side, m.encoder)).parameters
    needed = {n for n, p in params.items() if n != m.main and p.default is inspect.Parameter.empty
              and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    if m.main == "pixel_values":
        # each image's size where the encoder asks for it; where it only may (LLaVA's
        # optional ``image_sizes`` switches to Pixtral's patch cutting), first without
        h, w = (int(n) for n in main.shape[-2:])
        sized = {"image_sizes": [[h, w] for _ in range(main.shape[0])]}
        options = [sized] if "image_sizes" in needed else [{}, sized] if "image_sizes" in params else [{}]
        for extra in options:
            if needed - set(extra):
                continue
            for layout in _pixel_layouts(config, main):
                yield {m.main: layout, **extra}
        return
    masks = {n for n in needed if "mask" in n}
    if needed - masks:
        return
    for frames in dict.fromkeys((main.shape[-1], main.shape[1])):
        ones = torch.ones(main.shape[0], frames, dtype=torch.long, device=main.device)
        yield {m.main: main, **{n: ones for n in masks}}


@contextlib.contextmanager
def small_constants(limit: int = 64) -> Iterator[None]:
    """Fake tensors made from Python data (``torch.as_tensor(image_sizes)``) keep their
    values up to ``limit`` entries instead of one, so counts computed from them
    (Mistral 3's tokens per image, ``.prod(-1).tolist()``) stay plain ints."""
    from torch._subclasses import fake_tensor

    before = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = max(before, limit)
    try:
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = before


def _at_bound(total: Any, mode: Any) -> int | None:
    """``total`` as an int: a count only data decides (``x[mask]``'s rows) at its upper
    bound, every position selected; ``None`` where no bound is known (``.tolist()``)."""
    if isinstance(total, int):
        return total
    expr = getattr(getattr(total, "node", None), "expr", None)
    if expr is None or mode.shape_env is None:
        return None
    bounds = {}
    for sym in expr.free_symbols:
        upper = mode.shape_env.var_to_range.get(sym)
        if upper is None or not upper.upper.is_finite:
            return None
        bounds[sym] = int(upper.upper)
    value = expr.subs(bounds)
    return int(value) if value.is_Integer else None


def _features(model: nn.Module, m: Modality, main: torch.Tensor) -> tuple[dict[str, Any], int] | None:
    """The inputs ``m``'s encoder takes for ``main`` and how many values it splices into
    the text for them (its ``pooler_output``, or its output), run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._pytree import tree_flatten, tree_map_only

    from .export import quiet_traces
    from .fake import as_if_exporting, fake_copy

    mode = FakeTensorMode(shape_env=ShapeEnv())
    twin = encoder_side(fake_copy(model, mode).eval(), m.encoder)
    for inputs in _candidates(m, model.config, twin, main):
        with mode:
            fake = tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), inputs)
        try:
            with quiet_traces(), mode, as_if_exporting(), torch.no_grad(), small_constants():
                out = getattr(twin, m.encoder)(**fake, return_dict=True)
        except Exception:  # noqa: BLE001 - not this layout, or more than these inputs needed
            continue
        leaves = [t for t in tree_flatten(getattr(out, "pooler_output", out))[0] if isinstance(t, torch.Tensor)]
        total = sum(t.numel() for t in leaves) if leaves else None
        if total is not None and not isinstance(total, int) and any("mask" in k for k in inputs):
            # kept by the all-ones masks made here: every position, the bound
            total = _at_bound(total, mode)
        if isinstance(total, int):
            return inputs, total
    return None


def _special_ids(config: Any) -> set[int]:
    """Every token id the config names (placeholders, indicators, bos / eos / pad)."""
    out: set[int] = set()
    for holder in (config, getattr(config, "text_config", None)):
        for key, v in (vars(holder).items() if holder is not None else ()):
            if not key.endswith(("token_id", "token_index", "token_ids")):
                continue
            for i in v if isinstance(v, list | tuple) else [v]:
                if isinstance(i, int) and not isinstance(i, bool):
                    out.add(i)
    return out


def spliced_inputs(model: nn.Module, params: Any, batch: int, seq: int,
                   main_input: Callable[[str], torch.Tensor],
                   token_ids: Callable[[int], torch.Tensor]) -> dict[str, Any] | None:
    """Token ids with one placeholder per feature of every modality the model splices
    (after one text token, as a chat template puts them), and those modalities' inputs;
    ``None`` where no modality's count can be read off the model: the text is captured
    alone then.  ``main_input(name)`` builds a modality's main input, ``token_ids(n)``
    random text of ``n`` tokens."""
    config = model.config
    present = [(m, token) for m in MODALITIES if (token := _placeholder(config, m)) is not None
               and m.main in params and encoder_side(model, m.encoder) is not None]
    if not present:
        return None
    table = getattr(model.get_input_embeddings(), "weight", None)
    if table is None or table.dim() != 2:
        return None
    rows, width = table.shape  # the table's rows, where the config's vocabulary differs
    found: list[tuple[int, int, dict[str, Any]]] = []
    for m, token in present:
        try:
            main = main_input(m.main)
        except Exception:  # noqa: BLE001 - nothing in the config sizes it
            continue
        got = _features(model, m, main)
        if got is None or got[1] % width or got[1] // width % batch:
            continue
        found.append((token, got[1] // width // batch, got[0]))
    if not found:
        return None
    n = sum(count for _, count, _ in found)
    positions = getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)
    if isinstance(positions, int) and n + seq > positions and any(
            isinstance(mod, nn.Embedding) and positions <= mod.num_embeddings <= positions + 2
            for mod in model.modules()):
        return None  # more features than a learned position table holds (BART's has 2 more rows)
    ids = token_ids(n + seq) % rows
    specials = _special_ids(config)
    safe = next(i for i in range(len(specials) + 1) if i not in specials)
    for v in specials:  # text drawing a placeholder (or an indicator) would be one too many
        ids[ids == v] = safe
    out: dict[str, Any] = {}
    start = 1
    for token, count, inputs in found:
        ids[:, start:start + count] = token
        start += count
        out.update({k: v for k, v in inputs.items() if k in params})
    return {"input_ids": ids, **out}
