"""tpcompile: compile any Hugging Face model into a tensor-parallel (+FSDP2) model.

    model = tpcompile.transform(model, tp=8)      # inside torch.distributed

The model is captured with ``torch.export`` (:mod:`tpcompile.capture`), every module's
role is read off the dataflow (:mod:`tpcompile.analysis`, no per-model policy), the
decisions are written down as a :class:`Plan` (:mod:`tpcompile.plan`) and applied from
outside by one composer in a fixed order (:mod:`tpcompile.compose`,
:mod:`tpcompile.runtime`); checkpoints speak the HF format (:mod:`tpcompile.checkpoint`).
"""

from __future__ import annotations

# the front door assembles every stage, the tools' one hook included: importing the tools
# package (cheap: its modules load on first use) installs the layout search that
# parallelize(layout="auto") runs (tpcompile.plan.layout), so ``import tpcompile`` suffices
from . import _moved, tools  # noqa: F401
from .api import data_parallel_rank, from_pretrained, parallelize, plan_model, transform
from .checkpoint import hf_state_dict, load_hf_weights, save_pretrained
from .config import ParallelConfig
from .errors import TPError
from .plan import ModulePlan, ParamPlan, Plan, Role, TranslationTable
from .runtime.pipeline_step import clip_grad_norm_, pipeline_step

_moved.install()

__all__ = [
    "ModulePlan", "ParallelConfig", "ParamPlan", "Plan", "Role", "TPError", "TranslationTable",
    "clip_grad_norm_", "data_parallel_rank", "from_pretrained", "hf_state_dict", "load_hf_weights", "parallelize", "pipeline_step",
    "plan_model", "save_pretrained", "transform",
]
__version__ = "0.1.0"
