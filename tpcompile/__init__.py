"""tpcompile: compile any Hugging Face model into a tensor-parallel (+FSDP2) model.

    model = tpcompile.transform(model, tp=8)      # inside torch.distributed

The model is captured with ``torch.export``, every module's role is read off the dataflow
(no per-model policy), parameters are sharded as DTensors and collectives are hooked
around the model's own code.
"""

from __future__ import annotations

from .api import plan_model, transform
from .errors import TPError
from .plan import ModulePlan, ParamPlan, Plan, Role

__all__ = ["ModulePlan", "ParamPlan", "Plan", "Role", "TPError", "plan_model", "transform"]
__version__ = "0.1.0"
