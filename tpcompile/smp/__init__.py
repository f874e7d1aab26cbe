"""An SMP v2 (SageMaker model parallelism, ``torch.sagemaker``) compatible front.

Module paths mirror ``torch.sagemaker``, so an SMP v2 script changes only its imports::

    import tpcompile.smp as tsm                      # was: import torch.sagemaker as tsm
    from tpcompile.smp.delayed_param import DelayedParamIniter
    from tpcompile.smp.distributed.checkpoint.state_dict_utils import sm_state_dict_type

A thin layer over :func:`tpcompile.transform` and tpcompile's checkpoint code; see the
README's "Coming from SMP v2 / accelerate" for what is supported and what raises.
"""

from __future__ import annotations

from .core import Ranker, State, init, state, transform

__all__ = ["Ranker", "State", "init", "state", "transform"]
