"""ZeRO-3's optimizer step in mixed precision (memory.states.zero3_update): counted by hand on llama-1b, against
DeepSpeed's own cut of the sub groups, and the one-GPU step's peak against the H100 measurement."""
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from conftest import ROOT
from memtrain.config.ds_config import load_ds_config
from memtrain.config.recipe import load_recipe
from memtrain.memory.predict import Prediction
from memtrain.memory.profile import ActivationProfile
from memtrain.memory.states import model_states, zero_config
from memtrain.memory.target import Target, model_and_config
from memtrain.model.build import build_model

# make gpu-check on one NVIDIA H100 80GB HBM3, 2026-11-27 (recipes/llama-1b.yaml, ds_configs/zero3_ckpt.json, bf16,
# micro-batch 8): memtrain:full's torch.cuda.max_memory_allocated
H100_FULL_PEAK = 23_836_517_376


@pytest.fixture(scope="module")
def llama_1b():
    """llama-1b's parameters in model order (the meta device: no memory), and its states' inputs."""
    recipe = load_recipe(str(ROOT / "recipes/llama-1b.yaml"))
    config = model_and_config(recipe)
    with torch.device("meta"):
        model = build_model(recipe.model, config)
    numels = [p.numel() for p in model.parameters()]
    target = Target(device="cuda", dtype="bfloat16", micro_batch_size=8, seq_len=2048, world_size=1)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    profile = ActivationProfile(target=target, num_layers=config.num_hidden_layers, num_params=sum(numels),
                                largest_layer_params=layer, param_sizes=tuple(sorted(Counter(numels).items())),
                                layers={}, outside_saved=0, base=0, head_excess=0, head_net=0, tail_excess=0,
                                largest_block=0)
    return numels, profile, load_ds_config(str(ROOT / "ds_configs/zero3_ckpt.json"))


def test_zero3_step_holds_one_sub_group_flat_and_in_fp32(llama_1b):
    numels, profile, ds = llama_1b
    # DeepSpeed's own cut (stage3._create_fp16_sub_groups; one rank: a partition is the parameter)
    params = [SimpleNamespace(partition_numel=lambda n=n: n) for n in numels]
    cut = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(SimpleNamespace(sub_group_size=zero_config(ds).sub_group_size),
                                                                  params)
    largest_group = max(sum(p.partition_numel() for p in group) for group in cut)
    # by hand: the embedding (32,000 x 2,048), 21 layers of 44,044,288 (q, o 2048^2; k, v 2048 x 256; gate, up, down
    # 2048 x 5632; two norms) and layer 21's q, k, v, o and gate, the parameter that takes the group past 1e9
    assert sum(numels) == 1_100_048_384
    assert largest_group == 65_536_000 + 21 * 44_044_288 + 2 * 4_194_304 + 2 * 524_288 + 11_534_336 == 1_011_437_568
    exact = (2 + 4) * largest_group  # the bf16 flat copy and its fp32 conversion, alive together
    states = model_states(profile, ds, profile.target)
    # memtrain counts the largest group as the sub group size plus the largest parameter (an upper bound)
    assert exact <= states.update <= exact + 6 * max(numels)
    # the step is policy full's peak on one H100: measured 64 MiB above the exact count, within 3% of memtrain's
    assert states.total + states.without_activations == pytest.approx(H100_FULL_PEAK, rel=0.03)
    assert states.total + exact + 64 * 2 ** 20 == pytest.approx(H100_FULL_PEAK, abs=16 * 2 ** 10)


def test_peak_at_names_the_step_when_it_holds_more_than_the_activations(llama_1b):
    """make plan's 'peak at': policy full on one H100 peaks at the step (above); none at its activations."""
    _, profile, ds = llama_1b
    states = model_states(profile, ds, profile.target)
    full, none = 3_341_435_904, 33_637_532_672  # make plan's activation peaks of full and none (bytes)
    at = {name: Prediction(states, 0, {}, 0, 0, activations, 0, "backward of layer 21").peak_at
          for name, activations in (("full", full), ("none", none))}
    assert at == {"full": "optimizer step", "none": "backward of layer 21"}
