"""AC policies: same gradients as no recompute (dropout on and off), the activation-memory
ordering they promise, their errors and warnings, `memtrain.tools.ac_profile`, and ZeRO-3 runs."""
import copy
import csv

import pytest
import torch
from torch import nn

from memtrain.recompute.policy import custom_plan, plan_for, layer_modes, sqrt_segments
from memtrain.recompute.hooks import apply_plan
from memtrain.tools.ac_profile import main as ac_profile_main
from memtrain.tools.ac_profile import max_rel_err, measure_step
from memtrain.errors import UserError
from memtrain.recompute.meter import ActivationMeter
from memtrain.model.build import build_config, build_model
from memtrain.config.recipe import ModelSection

SEQ, BATCH, VOCAB = 32, 2, 257
FAMILIES = {
    "llama": {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 64},
    "gpt2": {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 64},
}
DROPOUT = {  # the family's dropout keys: on = 0.1 everywhere, off = 0
    "llama": ("attention_dropout",),
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
}
LAYERS = {"llama": "model.layers", "gpt2": "transformer.h"}
NORM = {"llama": "post_attention_layernorm", "gpt2": "ln_2"}  # a leaf module that saves more than its input


def _policies(family):
    """(policy, recipe AC keys) for every policy and composition."""
    return [("full", {}), ("every:2", {}), ("first:1", {}), ("first:9", {}), ("sqrt", {}), ("sqrt+first:3", {}),
            ("sqrt", {"segment_len": 3}), ("selective:attn", {}), ("selective:mlp", {}),
            ("selective:mlp+every:2", {}), ("op", {}), ("op", {"op_save": ["matmul/2", "attention"]}),
            ("op+first:2", {}), ("modules", {"modules": [f"{LAYERS[family]}.*.{NORM[family]}"]})]


def _model(family, dropout=0.0):
    config = {**FAMILIES[family], **{k: dropout for k in DROPOUT[family]}}
    section = ModelSection(type=family, config=config)
    torch.manual_seed(0)
    return build_model(section, build_config(section, vocab_size=VOCAB, seq_len=SEQ)).train()


def _plan(policy, **keys):
    return plan_for(policy, 4, backend="torch", **keys)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _step(model, plan, ids, seed):
    """One plain training step (no FLOP counting): loss, gradients, activation bytes."""
    apply_plan(model, plan)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    meter = ActivationMeter()
    with meter.measure():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, meter.bytes


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["dropout-off", "dropout-on"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_policy_matches_no_recompute(family, dropout, ids):
    """Recompute replays the RNG: with dropout on, the masks (hence the gradients) are the same."""
    model = _model(family, dropout)
    ref_loss, ref, ref_bytes = _step(model, _plan("none"), ids, seed=7)
    if dropout:  # dropout really is on: another seed gives other gradients
        assert max_rel_err(_step(model, _plan("none"), ids, seed=8)[1], ref) > 1e-3
    for policy, keys in _policies(family):
        loss, grads, act_bytes = _step(model, _plan(policy, **keys), ids, seed=7)
        assert loss == pytest.approx(ref_loss, rel=1e-6), policy
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[name], rtol=1e-5, atol=1e-6, msg=f"{policy} {keys}: {name}")
        assert act_bytes < ref_bytes, (policy, keys)


def _analytic_full_bytes(config, s, b):
    """Bytes `full` keeps for a Llama in fp32. Korthikanti et al. 2022: full recompute keeps one
    hidden state per layer, 2*s*b*h bytes in 16-bit, so 4*s*b*h in fp32. Outside the layers
    (not recomputed) the model keeps, by construction of its forward:
    embedding: the token ids (int64); the rotary cos/sin tables and position ids, shared by
    every layer and bound into each checkpoint; head: the final RMSNorm's input, its normalized
    output and 1/rms, the lm_head input, the log-softmax output (s*b*V) and the shifted labels."""
    h, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    d = h // config.num_attention_heads
    fp32, i64 = 4, 8
    layers = L * (2 * s * b * h) * fp32 // 2
    embedding = i64 * s * b + 2 * s * d * fp32 + i64 * s
    head = (3 * s * b * h + s * b + s * b * V) * fp32 + i64 * s * b
    return layers + embedding + head


def test_activation_ordering_recompute_cost_and_full_matches_analytic(ids):
    model = _model("llama")
    cost = {p if not k else f"{p} {k}": measure_step(model, _plan(p, **k), ids)
            for p, k in [("none", {}), ("op", {}), ("op", {"op_save": ["matmul/2", "attention"]}),
                         ("selective:attn", {}), ("selective:mlp", {}), ("full", {}), ("sqrt", {})]}
    act = {p: c.activation_bytes for p, c in cost.items()}
    for partial in ("op", "selective:attn", "selective:mlp"):
        assert act["none"] > act[partial] > act["full"], act
    assert act["op {'op_save': ['matmul/2', 'attention']}"] < act["op"], act
    assert act["full"] > act["sqrt"], act

    analytic = _analytic_full_bytes(model.config, SEQ, BATCH)
    assert abs(act["full"] - analytic) <= 0.10 * analytic, (act["full"], analytic)

    peak = {p: c.peak_backward_bytes for p, c in cost.items()}
    assert peak["none"] == act["none"]  # nothing is recomputed: the peak is the end of the forward
    assert act["full"] < peak["full"] < act["none"]  # plus one layer's recomputed activations
    assert peak["sqrt"] > peak["full"]  # a segment recomputes two layers at once

    overhead = {p: c.flops_total / cost["none"].flops_total - 1 for p, c in cost.items()}
    assert 0.15 < overhead["full"] <= 1 / 3, overhead  # about one more forward of the layers only
    assert 0 < overhead["selective:attn"] < overhead["full"] and 0 < overhead["selective:mlp"] < overhead["full"]
    assert overhead["op"] < overhead["selective:attn"], overhead  # matmuls and attention are saved


def test_policy_strings_and_compositions():
    assert layer_modes("every:2", 5) == ("full", "keep", "full", "keep", "full")
    assert layer_modes("first:2", 3) == ("full", "full", "keep")
    assert layer_modes("first:9", 3) == ("full", "full", "full")  # more than the model has: all of them
    assert layer_modes("none", 2) == ("keep", "keep")
    assert layer_modes("op+first:2", 4) == ("op", "op", "keep", "keep")
    assert layer_modes("selective:attn+every:2", 4) == ("attn", "keep", "attn", "keep")
    assert layer_modes("selective:mlp", 2) == ("mlp", "mlp")
    assert layer_modes("sqrt+first:3", 4) == ("full", "full", "full", "keep")
    assert sqrt_segments(("full",) * 22) == ((0, 5), (5, 10), (10, 15), (15, 20), (20, 22))
    assert sqrt_segments(("full",) * 4) == ((0, 2), (2, 4))
    assert sqrt_segments(("full",) * 5, segment_len=2) == ((0, 2), (2, 4))  # a 1-layer rest is plain full
    plan = _plan("sqrt+first:3")
    assert plan.segments == ((0, 2),) and plan.layer_marks() == "[R R] R ."
    for bad in ["none+first:2", "modules+first:2", "sqrt+every:2", "op+last:2", "op+first:0", "selective:xyz",
                "every:0", "every:x", "every", "first:-1", "sometimes"]:
        with pytest.raises(UserError, match="activation_checkpointing.policy"):
            layer_modes(bad, 4)
    with pytest.raises(ValueError, match="segments"):
        custom_plan(("full", "keep", "full"), segments=((0, 2),))
    mixed = custom_plan(("full", "full", "attn", "op"), segments=((0, 2),))
    assert mixed.layer_marks() == "[R R] A O"


def test_op_needs_torch_backend_and_bad_keys_are_user_errors():
    with pytest.raises(UserError, match="backend is 'deepspeed'"):
        plan_for("op+first:2", 4, backend="deepspeed")
    json_ac = {"activation_checkpointing": {"partition_activations": True}}
    with pytest.raises(UserError, match="partition_activations/cpu_checkpointing.*backend 'auto'"):
        plan_for("op", 4, ds_config=json_ac, tp_size=2)  # a TP group: partitioning takes effect
    offload_ac = {"activation_checkpointing": {"cpu_checkpointing": True}}
    with pytest.raises(UserError, match="partition_activations/cpu_checkpointing.*backend 'auto'"):
        plan_for("op", 4, ds_config=offload_ac, device="cuda")
    # where neither key has anything to do (no TP group, a CPU run), 'auto' keeps torch's checkpoint
    assert plan_for("op", 4, ds_config=json_ac).backend == "torch"
    assert plan_for("op", 4, ds_config=offload_ac, device="cpu").backend == "torch"
    with pytest.raises(UserError, match="activation_checkpointing.op_save: unknown op 'matmull'"):
        _plan("op", op_save=["matmull"])
    with pytest.raises(UserError, match="activation_checkpointing.op_save: 'matmul/0'"):
        _plan("op", op_save=["matmul/0"])
    with pytest.raises(UserError, match="activation_checkpointing.modules: policy 'modules' needs"):
        _plan("modules")
    with pytest.raises(UserError, match="activation_checkpointing.modules: 'model.layers.\\*.mlpp' matches no"):
        apply_plan(_model("llama"), _plan("modules", modules=["model.layers.*.mlpp"]))
    assert any("segment_len is ignored" in w for w in _plan("full", segment_len=2).warnings)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(self.norm(x))


def test_stateful_modules_warn_and_overlapping_patterns_are_skipped(ids):
    from transformers.modeling_layers import GradientCheckpointingLayer

    class Layer(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.block = _Block()

        def forward(self, x):
            return x + self.block(x)

    toy = nn.Module()
    toy.layers = nn.ModuleList([Layer(), Layer()])
    toy.train()
    with pytest.warns(RuntimeWarning, match=r"layers\.0\.block\.norm \(BatchNorm1d\) updates running statistics"):
        apply_plan(toy, custom_plan(("full", "keep"), policy="first:1"))
    x = torch.randn(4, 8, requires_grad=True)
    for layer in toy.layers:
        x = layer(x)
    x.sum().backward()
    # the recompute updated the recomputed layer's running stats a second time: the warning is real
    assert toy.layers[0].block.norm.num_batches_tracked.item() == 2
    assert toy.layers[1].block.norm.num_batches_tracked.item() == 1

    model = _model("llama")
    ref = measure_step(copy.deepcopy(model), _plan("none"), ids)
    with pytest.warns(RuntimeWarning, match="overlaps 'model.layers.0'"):
        cost = measure_step(model, _plan("modules", modules=["model.layers.0", "model.layers.*.mlp"]), ids)
    assert model.model.layers[0].gradient_checkpointing and "_ac_checkpoint" in vars(model.model.layers[1].mlp)
    assert "_ac_checkpoint" not in vars(model.model.layers[0].mlp)
    assert max_rel_err(cost.grads, ref.grads) < 1e-5 and cost.activation_bytes < ref.activation_bytes


def test_ac_profile_cli_writes_table_and_csv(tmp_path, capsys):
    out = tmp_path / "ac.csv"
    ac_profile_main(["--policies", "full,op", "--seq-len", "32", "--out", str(out),
                     "--set", "model.config.num_hidden_layers=2", "--set", "model.config.hidden_size=64",
                     "--set", "model.config.intermediate_size=128"])
    text = capsys.readouterr().out
    assert "recipe tiny: llama, 2 layers, hidden 64" in text and "max grad err" in text
    rows = list(csv.DictReader(out.open()))
    assert [r["policy"] for r in rows] == ["none", "full", "op"]
    assert {"policy", "activation_bytes", "peak_backward_bytes", "flops_total", "recompute_overhead",
            "max_grad_rel_err"} <= set(rows[0])
    assert float(rows[0]["recompute_overhead"]) == 0.0 and float(rows[1]["recompute_overhead"]) > 0
    assert all(float(r["max_grad_rel_err"]) < 1e-5 for r in rows)
    assert int(rows[1]["activation_bytes"]) < int(rows[2]["activation_bytes"]) < int(rows[0]["activation_bytes"])


@pytest.mark.skipif(getattr(torch.utils.checkpoint, "_RECOMPUTE", None) is None,
                    reason="'but-last' edits torch 2.13's selective-checkpoint storage; older torch keeps every matmul")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_op_default_does_not_keep_the_last_matmul(family):
    """op's default save list is matmul/but-last: each layer's last matmul (down_proj / c_proj) feeds only the
    residual add, so its output is not kept, and torch's early stop ends the recompute before it: one
    (batch, seq, hidden) tensor per layer less than saving every matmul, no extra matmul in the backward,
    the same gradients. Counted on the second step too (the decision must not depend on a first pass)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)

    class MatmulCount(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in matmuls
            return func(*args, **(kwargs or {}))

    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    runs = {}
    for name, keys in [("none", None), ("matmul", {"op_save": ["matmul", "attention"]}), ("default", {})]:
        model = _model(family)
        if keys is not None:
            apply_plan(model, _plan("op", **keys))
        for _ in range(2):
            model.zero_grad()
            meter = ActivationMeter()
            with meter.measure():
                loss = model(input_ids=ids, labels=ids).loss
            with MatmulCount() as backward:
                loss.backward()
        runs[name] = meter.bytes, backward.n, {n: p.grad.clone() for n, p in model.named_parameters()}
    hidden = FAMILIES[family].get("hidden_size") or FAMILIES[family]["n_embd"]
    assert runs["matmul"][0] - runs["default"][0] == 4 * BATCH * SEQ * hidden * 4  # 4 layers, fp32
    assert runs["default"][1] == runs["none"][1]  # nothing recomputed as a matmul beyond no-AC's backward
    for n, g in runs["default"][2].items():
        torch.testing.assert_close(g, runs["none"][2][n], rtol=1e-5, atol=1e-6)
