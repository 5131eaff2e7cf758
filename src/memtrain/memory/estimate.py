"""Memory model: a training step's peak device memory, predicted before the run (its public surface, in one import).

    peak = model states (parameters, gradients, optimizer states: ZeRO stage, offload, world size)
         + activations (saved per layer, the recompute working set, logits and loss buffers)
         + the allocator's margin

Activation sizes are measured, not derived from formulas: the real transformers model with one
decoder layer runs one forward and backward per AC mode at the target micro-batch, sequence
length and dtype, on fake tensors (`FakeTensorMode`: shapes only, nothing allocated); a 2-layer
run separates the layer from what lies around it. A tracker follows every tensor storage through
the step (`memtrain.recompute.meter.StepTracker`), so the measurement covers any decoder family, attention kernel, dtype
and whatever the AC modes really keep. The layer count scales it: the live bytes at any point
are prefix sums of per-layer costs (`activation_peak`), which tests check against real steps.

Any ACPlan maps onto it (`predict_plan`, memtrain.memory.planner.predict_run): per-layer modes, sqrt
segments (one unit of k full layers: one layer's resident bytes, a k-layer recompute working
set), modules patterns (matched sublayers as their modes, anything else inside a layer measured
as a mode of its own; matches outside the layers are named in `Prediction.notes`), memtrain's
offload (PREFETCH_DEPTH restored inputs ahead during the backward; on CUDA the side-stream copy
holding an input through the next forward), ZeRO-1/2 reduce buckets (backward only), and the
allocator margin (ALLOCATOR_MARGIN, measured on an H100: see there).

The model lives in one module per job: `target` (the run predicted for), `states` (model states under
DeepSpeed's layout), `profile` (activation costs measured on fake tensors), `predict` (the step's
peak for any plan) and `rates` (this machine's rates for the time model). This module re-exports them.
"""
from __future__ import annotations

from memtrain.memory.predict import (ALLOCATOR_MARGIN, ALLOCATOR_MARGIN_BYTES, LayerChoice, Prediction, Unit,
                                     activation_peak, allocator_margin, as_choice, layer_footprint, plan_choices,
                                     plan_units, predict, predict_plan, unit_footprint)
from memtrain.memory.profile import (CUDA_BLOCK, MODULES, ActivationProfile, LayerCost, fake_model, mode_plan,
                                     modules_mode, profile_activations, supported_modes)
from memtrain.memory.rates import Rates, measure_rates
from memtrain.memory.states import ModelStates, model_states
from memtrain.memory.target import Target, compute_dtype, make_target, model_and_config, recompute_spec

__all__ = [
    "predict", "ALLOCATOR_MARGIN", "ALLOCATOR_MARGIN_BYTES", "ActivationProfile", "CUDA_BLOCK", "LayerCost",
    "MODULES", "LayerChoice", "ModelStates", "Prediction", "Rates", "Target", "Unit", "activation_peak",
    "allocator_margin", "as_choice", "compute_dtype", "fake_model", "layer_footprint", "make_target", "mode_plan",
    "measure_rates", "model_and_config", "model_states", "modules_mode", "plan_choices", "plan_units",
    "predict_plan", "profile_activations", "recompute_spec", "supported_modes", "unit_footprint",
]
