"""A recompute's host dispatch (issue 37's time model): the aten ops `memtrain.memory.recompute_ops` counts on the fake
1-layer model against gpu-check's probe's dispatch counter on real tiny Llama steps, and the max() of device and host seconds
the per-layer solver and the search price a recompute at, by hand. In process, seconds."""
import torch

from conftest import ROOT
from memtrain.config.ds_config import load_ds_config
from memtrain.config.recipe import load_recipe
from memtrain.memory.predict import LayerChoice
from memtrain.memory.rates import Rates
from memtrain.memory import profile_cache
from memtrain.memory.recompute_ops import count_recompute_ops, forget_counted, recompute_ops
from memtrain.memory.score import make_family
from memtrain.memory.target import make_target, model_and_config
from memtrain.model.build import build_config, build_model
from memtrain.recompute.hooks import apply_plan
from memtrain.recompute.policy import plan_for
from memtrain.recompute.meter import OpCounter

DS = ROOT / "ds_configs" / "zero3_ckpt.json"
MODES = ("full", "op", "attn", "mlp")
POLICY = {"full": "full", "op": "op", "attn": "selective:attn", "mlp": "selective:mlp"}


def _real_step_ops(recipe, layers: int, policy: str) -> int:
    """aten ops of one forward and backward of the real tiny Llama, every layer under `policy`, after a warm-up."""
    config = build_config(recipe.model, vocab_size=257, seq_len=recipe.data.seq_len)
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = build_model(recipe.model, config).train()
    apply_plan(model, plan_for(policy, layers, backend="torch"))
    ids = torch.randint(0, 257, (recipe.train.micro_batch_size, recipe.data.seq_len),
                        generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    with OpCounter() as ops:  # gpu-check's probe's counter
        model(input_ids=ids, labels=ids).loss.backward()
    return ops.ops


def _tiny():
    recipe = load_recipe(None, ["model.config.num_hidden_layers=3", "model.config.vocab_size=257",
                                "activation_checkpointing.policy=none"])
    return recipe, load_ds_config(DS)


def test_recompute_ops_match_real_steps_and_price_the_recompute(tmp_path):
    """Each mode's recompute ops on the fake 1-layer model equal those of real 3-layer steps, per layer (real tensors,
    the trainer's model builder, every layer under the mode, less the step without recompute). And a family's
    seconds of a choice are max(device seconds, ops x host_op_s): host-bound at a slow host, device-bound at host 0."""
    recipe, ds = _tiny()
    config = model_and_config(recipe)
    target = make_target(recipe, ds, 1)
    counted = count_recompute_ops(config, target, MODES)
    keep = _real_step_ops(recipe, 3, "none")
    real = {m: (_real_step_ops(recipe, 3, POLICY[m]) - keep) / 3 for m in MODES}
    assert counted == real, (counted, real)
    profile_cache.keep_in(tmp_path)  # kept like a profile: written once, then read, not counted again
    try:
        forget_counted()
        assert recompute_ops(config, target, MODES) == counted
        (kept,) = tmp_path.glob("*.json")
        kept.write_text(kept.read_text().replace(f'"op": {counted["op"]}', '"op": 7'))
        forget_counted()
        assert recompute_ops(config, target, MODES) == {**counted, "op": 7}
    finally:
        profile_cache.keep_in(None)
        forget_counted()
    assert counted["op"] > counted["attn"] > counted["mlp"] > 0, counted

    fast, slow = Rates(1e12, 1e11, 1e10, "cuda"), Rates(1e12, 1e11, 1e10, "cuda", host_op_s=1e-3)
    fam = make_family(recipe, ds, config, 1, 1, 1, False, slow)
    mb = fam.profile.target.micro_batch_size
    by_hand = {}
    for m in ("full", "op"):
        c = fam.profile.layers[m]
        device = c.recompute_flops / 1e12 + c.recompute_written / 1e11
        assert fam.ops[m] * 1e-3 > device  # this slow host binds
        by_hand[m] = fam.ops[m] * 1e-3
    assert {m: fam.seconds_at(mb, slow)[LayerChoice(m)] for m in by_hand} == by_hand
    plain = make_family(recipe, ds, config, 1, 1, 1, False, fast)
    assert plain.ops == {}  # nothing counted where the rates do not price it
    for m in by_hand:
        c = plain.profile.layers[m]
        assert plain.seconds_at(mb, fast)[LayerChoice(m)] == c.recompute_flops / 1e12 + c.recompute_written / 1e11
