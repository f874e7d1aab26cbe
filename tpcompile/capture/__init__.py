"""The capture stage: the model as an FX graph of ATen ops, weights never touched.

* :func:`capture` exports the model (``torch.export``, on meta tensors), cutting each
  stack of identical blocks to a representative or two (:class:`LayerStacks`);
* :func:`example_inputs` builds one batch of forward keyword arguments from the model
  itself (``main_input_name``, config sizes, decoder start tokens).

Example:
    >>> from tpcompile.capture import capture, example_inputs    # doctest: +SKIP
    >>> cap = capture(meta_model)
    >>> cap.stacks.members["model.layers"][:2]
"""

from __future__ import annotations

from .export import Capture, LayerStacks, capture, layer_stacks, structural_signature
from .inputs import example_inputs

__all__ = ["Capture", "LayerStacks", "capture", "example_inputs", "layer_stacks", "structural_signature"]
