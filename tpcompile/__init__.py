"""tpcompile: compile any Hugging Face model into a tensor-parallel (+FSDP2) model.

    model = tpcompile.transform(model, tp=8)      # inside torch.distributed

The model is captured with ``torch.export``, every module's role is read off the dataflow
(no per-model policy), parameters are sharded as DTensors and collectives are hooked
around the model's own code.
"""

from __future__ import annotations

from .api import plan_model, transform
from .checkpoint import from_pretrained, hf_state_dict, load_hf_weights, save_pretrained
from .errors import TPError
from .fsdp import parallelize
from .plan import ModulePlan, ParamPlan, Plan, Role
from .translate import TranslationTable

__all__ = [
    "ModulePlan", "ParamPlan", "Plan", "Role", "TPError", "TranslationTable", "from_pretrained",
    "hf_state_dict", "load_hf_weights", "parallelize", "plan_model", "save_pretrained", "transform",
]
__version__ = "0.1.0"
