"""Which transformers class a config builds: one answer for every tool.

``dump-plan`` / ``plan_layout`` on a config file, ``verify`` and ``from_pretrained``
all start from a config and need a model class.  They used to answer differently
(``dump-plan`` knew causal and masked LMs only and crashed on a T5 config), so a family
that verified could not be planned from its ``config.json``.  The order here:

1. the task asked for (``"causal-lm"`` / ``"masked-lm"``);
2. the config's ``architectures`` (what the checkpoint was saved as);
3. the richest head the model type registers: seq2seq (text, then speech) for an
   encoder-decoder, a causal LM (a masked LM for encoders not configured as decoders),
   then the bare model.

Example::

    >>> from transformers import AutoConfig
    >>> model_class(AutoConfig.for_model("t5")).__name__
    'T5ForConditionalGeneration'
"""

from __future__ import annotations

from typing import Any

from ..errors import TPError

TASK_CAUSAL_LM = "causal-lm"
TASK_MASKED_LM = "masked-lm"
TASKS = (TASK_CAUSAL_LM, TASK_MASKED_LM)


def _autos() -> dict[str, Any]:
    import transformers as tf

    return {TASK_CAUSAL_LM: tf.AutoModelForCausalLM, TASK_MASKED_LM: tf.AutoModelForMaskedLM}


def lm_task(config: Any) -> str | None:
    """``"causal-lm"`` or ``"masked-lm"`` from the architectures, else the model type;
    None when the type registers neither head."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    for arch in getattr(config, "architectures", None) or []:
        if arch.endswith("ForMaskedLM"):
            return TASK_MASKED_LM
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return TASK_CAUSAL_LM
    model_type = getattr(config, "model_type", None)
    causal = model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    masked = model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    if causal and masked:
        # Encoder families (bert, roberta, ...) also register a causal head; they are
        # only used that way when explicitly configured as decoders.
        return TASK_CAUSAL_LM if getattr(config, "is_decoder", False) else TASK_MASKED_LM
    if causal:
        return TASK_CAUSAL_LM
    if masked:
        return TASK_MASKED_LM
    return None


def model_class(config: Any, task: str | None = None) -> type:
    """The transformers class to build ``config`` with (see the module docstring).

    Raises :class:`~tpcompile.errors.TPError` for an unknown task or a config no auto
    class registers."""
    import transformers as tf

    autos = _autos()
    if task is not None:
        if task not in autos:
            raise TPError(f"task must be one of {TASKS}, got {task!r}")
        mapping = autos[task]._model_mapping
        if type(config) not in mapping:
            raise TPError(f"{type(config).__name__} has no {task} head in transformers")
        return mapping[type(config)]
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(tf, arch, None)
        if isinstance(cls, type):
            return cls
    order = [tf.AutoModelForSeq2SeqLM, tf.AutoModelForSpeechSeq2Seq] \
        if getattr(config, "is_encoder_decoder", False) else []
    lm = lm_task(config)
    if lm is not None:
        order.append(autos[lm])
    for auto in [*order, tf.AutoModel]:
        if type(config) in auto._model_mapping:
            return auto._model_mapping[type(config)]
    raise TPError(f"no transformers model class for {type(config).__name__}; "
                  "build the model yourself and pass it")
