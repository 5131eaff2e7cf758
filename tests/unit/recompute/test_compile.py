"""train.compile on CPU in one process: compiled decoder layers (memtrain.recompute.compiled) against eager ones.

Gradients for sqrt segments on both checkpoint backends and a recomputed MLP, op's save lists, the profile of compiled
layers against what they save, a recompile after the warm-up as a warning naming its reason, the one-line refusals, and make plan's checkpoint backend. Other layer kinds
(Gemma-3), bf16, dropout, `train.compile: auto` and what the plan says are in test_compile_kinds.py (a file each: the
unit tier's two workers share the compiles). The same under ZeRO-3 on 2 ranks, with losses, fetches and recompile
counts, is in tests/launch/test_zero3_hooks.py; a stopped and resumed compiled run is in tests/launch/test_resume.py.
A layer counts as compiled when autograd's graph holds its compiled region's backward (`CompiledFunctionBackward`),
which eager layers never make.
"""
import copy
import json

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest
import torch

from conftest import ROOT
from memtrain.config.args import parse_args
from memtrain.config.recipe import DEFAULT_OP_SAVE
from memtrain.errors import UserError
from memtrain.memory.profile import profile_activations
from memtrain.memory.target import Target
from memtrain.recompute.compiled import CompiledLayers, CompileWatch
from memtrain.recompute.hooks import apply_plan
from memtrain.recompute.policy import FULL, KEEP, MLP, OP, plan_for
from memtrain.train.compile_choice import choose_compile
from memtrain.train.preflight import resolve_run
from unit.recompute.compile_step import fresh_dynamo, profiled_step, token_ids  # noqa: F401  fixture

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture(scope="module")
def base(small_llama):
    return small_llama


# what runs under ZeRO-3 (none, full on both backends, every:2, selective:attn, op) is checked on 2 ranks there; here
# sqrt segments (ZeRO 0-2 only), a recomputed MLP, and op with its save list
CASES = [("sqrt", "torch"), ("sqrt", "deepspeed"), ("selective:mlp", "torch")]


@pytest.mark.parametrize("policy, backend", CASES, ids=lambda v: str(v))
def test_compiled_layers_give_eager_gradients(base, policy, backend):
    plan = plan_for(policy, 4, backend=backend)
    eager, compiled = copy.deepcopy(base), copy.deepcopy(base)
    apply_plan(eager, plan)
    apply_plan(compiled, plan, CompiledLayers(plan.op_save))
    ids = token_ids()
    loss_e, grads_e, _, calls_e = profiled_step(eager, ids)
    profiled_step(compiled, ids)  # compiles
    loss_c, grads_c, _, calls_c = profiled_step(compiled, ids)
    assert calls_e == 0
    # each layer's compiled forward once, and again in the recompute of an eager checkpoint around it (a sqrt
    # segment's, DeepSpeed's); a sublayer's recompute runs inside its layer's compiled backward
    assert calls_c == (4 if policy.startswith("selective") else 8)
    assert abs(loss_c - loss_e) < 1e-5
    for name, g in grads_e.items():
        assert torch.allclose(grads_c[name], g, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("op_save", [list(DEFAULT_OP_SAVE), ["matmul/2"]], ids=["default", "every-2nd-matmul"])
def test_compiled_selective_checkpoint_saves_what_eager_op_saves(base, op_save):
    """Mode op under compile decides at trace time, from the same save list (each list its own graph, also in one
    process): about what eager op keeps, far less than no recompute keeps."""
    bytes_ = {}
    for policy in ("op", "none"):
        plan = plan_for(policy, 4, backend="torch", op_save=op_save)
        for compiled in (False, True):
            model = copy.deepcopy(base)
            apply_plan(model, plan, CompiledLayers(plan.op_save) if compiled else None)
            bytes_[policy, compiled] = profiled_step(model, token_ids())[2]
    # at most what eager op keeps (+5%); less where an output it must save is read by no backward (down_proj's)
    assert 0.8 * bytes_["op", False] <= bytes_["op", True] <= 1.05 * bytes_["op", False], bytes_
    assert bytes_["op", True] < 0.8 * bytes_["none", True], bytes_


def test_the_profile_of_compiled_layers_is_what_compiled_layers_save(base):
    """train.compile's prediction (memtrain.memory.profile on fake tensors, each layer split as inductor's partitioner
    splits it, no code generation) against what real inductor-compiled layers save, counted by the activation meter on
    real tensors: byte for byte on this torch, for each mode. Without recompute, less than eager layers save."""
    profile = profile_activations(base.config, Target("cpu", "float32", 2, 32, 1, compiled=True),
                                  (KEEP, OP, MLP, FULL), count_flops=False)
    eager = profile_activations(base.config, Target("cpu", "float32", 2, 32, 1), (KEEP,), count_flops=False)
    for policy, mode in (("none", KEEP), ("full", FULL), ("op", OP), ("selective:mlp", MLP)):
        plan = plan_for(policy, 4, backend="torch")
        model = copy.deepcopy(base)
        apply_plan(model, plan, CompiledLayers(plan.op_save))  # the graphs the tests above compiled
        measured = profiled_step(model, token_ids())[2]
        assert profile.outside_saved + 4 * profile.layers[mode].saved == measured, policy
    assert profile.layers[KEEP].saved < 0.9 * eager.layers[KEEP].saved


def test_the_profile_of_compiled_layers_with_dropout(base):
    """A layer that draws random numbers (attention dropout): inductor's joint-graph passes fuse its seeds under the
    partition's fake mode. The compiled profile runs them as inductor does (a run with dropout and train.compile
    stopped at start-up without it), and keeps no more than the same layer without dropout plus its masks."""
    config = copy.deepcopy(base.config)
    config.attention_dropout = 0.2
    target = Target("cpu", "float32", 2, 32, 1, compiled=True)
    dropped = profile_activations(config, target, (KEEP,), count_flops=False)
    plain = profile_activations(base.config, target, (KEEP,), count_flops=False)
    assert plain.layers[KEEP].saved <= dropped.layers[KEEP].saved < 2 * plain.layers[KEEP].saved


def test_a_recompile_after_the_warm_up_is_a_warning_naming_its_reason(base):
    plan = plan_for("full", 4, backend="torch")
    model = copy.deepcopy(base)
    apply_plan(model, plan, CompiledLayers(plan.op_save))
    watch = CompileWatch()
    lines = []
    for step, seq in enumerate((32, 32, 32, 24)):
        profiled_step(model, token_ids(seq))
        lines.append(watch.step_done(step, warmed_up=step >= 2))
    assert lines[:3] == [[], [], []] and watch.compiles >= 1  # the first step compiled, quietly
    assert len(lines[3]) == 1 and watch.late == lines[3]
    assert "compiled a recomputed decoder layer again at step 4" in lines[3][0]
    assert "size mismatch" in lines[3][0] and "expected 32, actual 24" in lines[3][0], lines[3][0]


DS = str(ROOT / "ds_configs" / "zero3_ckpt.json")


@pytest.mark.parametrize("argv, world, expected", [
    (["--set", "activation_checkpointing.policy=modules"], 2, "policy 'modules'"),
    (["--set", "activation_checkpointing.policy=sqrt"], 2, "policy 'sqrt' under ZeRO-3"),
    (["--set", "activation_checkpointing.policy=selective:attn", "--set", "activation_checkpointing.backend=deepspeed"],
     2, "on activation_checkpointing.backend deepspeed"),
    (["--set", "parallel.sequence=2"], 2, "parallel.sequence 2"),
    (["--deepspeed", str(ROOT / "ds_configs" / "zero3_tp2_ckpt.json")], 2, "tensor_parallel.autotp_size 2"),
    (["--deepspeed", "LEAF:[]"], 2, "the JSON's zero_optimization.leaf_module"),
], ids=["modules", "sqrt-zero3", "deepspeed-sublayer", "ulysses", "autotp", "json-leaf-modules"])
def test_what_cannot_compose_is_one_line_naming_its_key(tmp_path, argv, world, expected):
    argv = [_leaf_json(tmp_path, a.removeprefix("LEAF:")) if a.startswith("LEAF:") else a for a in argv]
    args = parse_args(["--deepspeed", DS, *argv, "--set", "train.compile=true",
                       "--set", "activation_checkpointing.modules=[model.layers.*.mlp]"])
    with pytest.raises(UserError) as e:
        resolve_run(args, world)
    message = str(e.value)
    assert message.startswith("embedded recipe 'tiny': train.compile: true cannot be combined with"), message
    assert expected in message and "\n" not in message


def _leaf_json(tmp_path, classes: str) -> str:
    """ds_configs/zero3_ckpt.json with the JSON's own zero_optimization.leaf_module classes."""
    raw = json.loads((ROOT / "ds_configs" / "zero3_ckpt.json").read_text())
    raw["zero_optimization"]["leaf_module"] = {"classes": json.loads(classes)}
    path = tmp_path / "leaf.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_a_json_that_makes_the_decoder_layer_its_leaf_compiles(tmp_path):
    path = _leaf_json(tmp_path, '["LlamaDecoderLayer"]')
    checked = resolve_run(parse_args(["--deepspeed", path, "--set", "train.compile=true"]), 2)
    assert checked.compile.on and not checked.zero3.leaf_layers  # the JSON decided, and named the layer


@pytest.mark.parametrize("classes, backend", [('["LlamaDecoderLayer"]', "torch"), ("[]", "deepspeed")],
                         ids=["json-leaf-layer", "json-no-leaf"])
def test_make_plan_names_the_checkpoint_backend_the_run_writes(tmp_path, capsys, classes, backend):
    """A JSON that names its own ZeRO-3 leaf modules: make plan --json's checkpoint backend is the one the run
    records in config.json (its ac_plan: resolve_run's plan). Hooks inside each layer (no leaf) take DeepSpeed's
    reentrant checkpoint under backend auto; the layer as the JSON's leaf keeps torch's."""
    from memtrain.tools.plan import main

    path = _leaf_json(tmp_path, classes)
    main(["--deepspeed", path, "--ngpus", "2", "--json"])
    planned = json.loads(capsys.readouterr().out)["ac_backend"]
    assert planned == resolve_run(parse_args(["--deepspeed", path]), 2).plan.to_dict()["backend"] == backend


def test_a_sublayers_offload_cannot_compose():
    plan = plan_for("selective:mlp", 4, ds_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                    backend="torch")
    assert plan.memtrain_offload
    with pytest.raises(UserError, match="cpu_checkpointing of a recomputed sublayer"):
        choose_compile(True, plan, "cuda")
