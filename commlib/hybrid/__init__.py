"""Ulysses inside groups, Ring across them (USP), and a planner that picks
the Ulysses degree from head counts and the fabric's measured speed."""

from .attention import hybrid_attention, hybrid_attention_backward
from .model_plan import ModelPlan, RecurrentLayers, plan_model
from .planner import SplitPlan, plan

__all__ = ["hybrid_attention", "hybrid_attention_backward", "plan", "SplitPlan", "plan_model",
           "ModelPlan", "RecurrentLayers"]
