"""Long sequences: the fused loss, tiled MLPs and Ulysses sequence parallelism.

Single-process tests compare memtrain's code with HF's own forward and loss (an independent
implementation) and measure peaks with torch's MemTracker. One launch with the real deepspeed
launcher and 2 gloo ranks (tests/long_context_worker.py) checks ZeRO-1/2/3, sequence parallelism,
tied embeddings and ignored labels against a plain-torch reference, then runs the trainer.
"""
import copy
import json
import weakref

import deepspeed  # noqa: F401  imported before any capsys: its logger keeps the stream it first sees
import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from conftest import allocator_peak, ROOT
from families import SP_REFUSED, overrides
from memtrain.train import preflight
from memtrain.model.loss import install_loss
from memtrain.model.tiled_mlp import install_tiled_mlp, tiled_mlp_shards

DS = ROOT / "ds_configs" / "zero3_ckpt.json"


def _llama(vocab=300, layers=2, hidden=64, inter=128, tied=False, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                        tie_word_embeddings=tied, attn_implementation="sdpa"))


def _grad_rel_err(a, b):
    num = sum((p.grad - q.grad).pow(2).sum() for p, q in zip(a.parameters(), b.parameters())) ** 0.5
    return float(num / sum(p.grad.pow(2).sum() for p in a.parameters()) ** 0.5)


class _LivePeak(TorchDispatchMode):
    """Peak bytes of tensor storages that ops create and that are still alive (weak references to
    the storages; a storage's Python object lives as long as any tensor or autograd holds it)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.seen = WeakIdKeyDictionary()

    def _free(self, nbytes):
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st not in self.seen:
                    self.seen[st] = True
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, st.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def _live_peak(fn):
    with _LivePeak() as mode:
        fn()
    return mode.peak


def _peak(fn, *track):
    tracker = MemTracker()
    tracker.track_external(*track)
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


@pytest.fixture(params=["torch", "chunked"])
def fused_backend(request, monkeypatch):
    """The fused loss through torch's linear_cross_entropy, and through memtrain.model.chunked_ce as on torch < 2.13
    (where F has no linear_cross_entropy)."""
    if request.param == "chunked":
        monkeypatch.delattr(torch.nn.functional, "linear_cross_entropy", raising=False)  # torch < 2.13: absent
    return request.param


@pytest.mark.parametrize("tied", [False, True])
def test_fused_loss_equals_hf_standard(tied, fused_backend):
    """fused vs HF's own lm_head + ForCausalLMLoss: loss and every gradient, with ignored labels."""
    ref = _llama(tied=tied)
    fused = copy.deepcopy(ref)
    install_loss(fused, fused=True)
    ids = torch.randint(0, 300, (2, 64))
    labels = ids.clone()
    labels[:, :7] = -100
    labels[1, 30:45] = -100
    l_ref = ref(input_ids=ids, labels=labels).loss
    l_ref.backward()
    l_fused = fused(input_ids=ids, labels=labels).loss
    l_fused.backward()
    assert abs(l_ref.item() - l_fused.item()) < 1e-5
    assert _grad_rel_err(ref, fused) < 1e-6
    assert (fused.get_output_embeddings().weight is fused.get_input_embeddings().weight) == tied


def test_fused_loss_peak_at_8k_vocab_is_under_an_eighth(fused_backend):
    """A whole forward+backward of a small model with an 8,000-token vocabulary (2,048 tokens):
    MemTracker's peak with fused is <= 1/8 of standard's (HF's own forward). Both peaks grow with the vocabulary
    (the logits; the embedding and lm_head weights), so a larger one widens the gap: at 32,000 the figures are
    42.0 against 775.8 MiB (docs/long-sequences.md), but torch's fused loss takes a minute under MemTracker there."""
    standard = _llama(vocab=8000, layers=1)
    fused = copy.deepcopy(standard)
    install_loss(fused, fused=True)
    ids = torch.randint(0, 8000, (16, 128))
    peaks = {}
    for name, model in (("standard", standard), ("fused", fused)):
        peaks[name] = _peak(lambda: model(input_ids=ids, labels=ids).loss.backward(), model)
    assert peaks["fused"] * 8 <= peaks["standard"], peaks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_linear_cross_entropy_equals_reference(dtype):
    """memtrain.model.chunked_ce (torch < 2.13's fused loss) in several chunks vs F.linear + F.cross_entropy in
    float64: the summed loss and the gradients of hidden states, weight and bias, with ignored labels; and no
    tensor as large as the full logits is ever made."""
    from memtrain.model.chunked_ce import linear_cross_entropy_sum

    torch.manual_seed(0)
    n, h, v = 300, 16, 257
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h) / 4).to(dtype).requires_grad_()
    bias = torch.randn(v, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    labels[::7] = -100
    ref = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    loss_ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(*ref), labels, reduction="sum")
    (loss_ref * 0.5).backward()

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    with Largest():
        loss = linear_cross_entropy_sum(hidden, weight, labels, bias=bias, chunk=64)
        (loss * 0.5).backward()
    assert Largest.numel <= 64 * v < n * v
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(loss.item() - loss_ref.item()) <= tol * abs(loss_ref.item())
    for mine, theirs in zip((hidden, weight, bias), ref):
        assert mine.grad.dtype == dtype
        err = (mine.grad.double() - theirs.grad).norm() / theirs.grad.norm()
        assert err < tol, (mine.shape, float(err))


def test_tiled_mlp_same_gradients_lower_peak():
    ref = _llama(layers=2, inter=256)
    tiled = copy.deepcopy(ref)
    assert install_tiled_mlp(tiled.model.layers, 4) == 2
    ids = torch.randint(0, 300, (2, 256))
    ref(input_ids=ids, labels=ids).loss.backward()
    tiled(input_ids=ids, labels=ids).loss.backward()
    assert _grad_rel_err(ref, tiled) < 1e-6
    # the MLP's transient peak (forward + backward of one MLP over 4,096 tokens)
    x = torch.randn(1, 4096, 64, requires_grad=True)
    # (MemTracker's module tracker cannot follow TiledMLP's backward, which calls modules inside it)
    peaks = [_live_peak(lambda: m.model.layers[0].mlp(x).sum().backward()) for m in (ref, tiled)]
    assert peaks[1] < peaks[0] / 2, peaks
    assert type(tiled.model.layers[0].mlp).__name__ == "LlamaMLP"  # state-dict layout unchanged
    assert tiled.state_dict().keys() == ref.state_dict().keys()


def test_tiled_mlp_plan_line_counts_the_slices_tokens(tmp_path):
    """The start-up line's slice size is what one slice holds: the micro-batch's tokens as one row (4 x 64 tokens in
    2 slices: 128), counted at the MLP's forward."""
    import torch.distributed as dist

    from memtrain.config.recipe import load_recipe
    from memtrain.train import long_context

    recipe = load_recipe(None, ["train.micro_batch_size=4", "data.seq_len=64", "activation_checkpointing.tiled_mlp=2"])
    model = _llama()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        lines = long_context.prepare(model, recipe, 3).lines
    finally:
        dist.destroy_process_group()
    assert "tiled MLP: 2 slices of 128+ tokens in each of 2 layers" in lines, lines
    seen = []
    mlp = type(model.model.layers[0].mlp)
    handle = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[:-1]))
    ids = torch.randint(0, 300, (4, 64))
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    handle.remove()
    assert seen == [(1, 128), (1, 128)] and mlp.__name__ == "LlamaMLP", seen


def test_tiled_mlp_auto_shards():
    assert tiled_mlp_shards("auto", 131072, 4096) == 32
    assert tiled_mlp_shards("auto", 1000, 4096) == 1
    assert tiled_mlp_shards(0, 131072, 4096) == 1
    assert tiled_mlp_shards(8, 64, 4096) == 8


def _ds(tmp_path, edit):
    cfg = json.loads(DS.read_text())
    edit(cfg)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _error(capsys, argv, world=2):
    with pytest.raises(SystemExit) as exc:
        preflight.main(["--world-size", str(world), "--set", "data.random_tokens=true", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("sets, world, expected", [
    (["parallel.sequence=2", "model.config.attn_implementation=eager"], 2, "attn_implementation sdpa"),
    (["parallel.sequence=3"], 3, "does not divide num_attention_heads 4"),
    (["parallel.sequence=4", "model.config.num_key_value_heads=2", "model.config.num_attention_heads=8",
      "model.config.hidden_size=128"], 4, None),  # sp > kv heads: kv heads are replicated, allowed
    (["parallel.sequence=4", "model.config.num_key_value_heads=4", "model.config.num_attention_heads=12",
      "model.config.hidden_size=192", "parallel.sequence=6"], 6, "num_key_value_heads 4 do not divide"),
    (["parallel.sequence=2", "data.seq_len=127"], 2, "does not divide data.seq_len 127"),
    (["parallel.sequence=2"], 3, "does not divide the world size 3"),
])
def test_sequence_parallel_rejections(capsys, sets, world, expected):
    argv = [x for s in sets for x in ("--set", s)]
    if expected is None:
        preflight.main(["--world-size", str(world), "--set", "data.random_tokens=true", *argv])
        return
    line = _error(capsys, argv, world)
    assert "parallel.sequence" in line and expected in line, line


@pytest.mark.parametrize("family", SP_REFUSED)
def test_sequence_parallel_refuses_what_ulysses_gets_wrong(capsys, family):
    """Measured wrong or failing under Ulysses (DeepSpeed 0.19.8): attention called directly (Falcon), a
    sliding window that lives in the mask Ulysses drops (Gemma-3 under sdpa), eager attention (Gemma-2's
    default), heads split again after Ulysses merged them (GPT-2). One line each, before workers."""
    argv = [x for s in [*overrides(family), "parallel.sequence=2", "data.seq_len=64"] for x in ("--set", s)]
    line = _error(capsys, argv)
    assert "parallel.sequence: 2" in line and SP_REFUSED[family] in line, line


@pytest.mark.parametrize("model_type, why", [("jamba", "has linear_attention, mamba layers"),
                                             ("qwen3_next", "has linear_attention layers"),
                                             ("falcon_h1", "has hybrid layers"),
                                             ("llama4_text", "has chunked_attention layers")])
def test_sequence_parallel_refuses_hybrid_layers(model_type, why):
    """Layers that mix tokens outside attention (Mamba, linear attention, chunked attention in the mask) would see
    a rank's slice only: refused from the config alone, and `make plan --max-seq` offers no sequence-parallel row."""
    from transformers import AutoConfig

    from memtrain.errors import UserError
    from memtrain.tools.max_seq import sequence_sizes
    from memtrain.train.sequence_parallel import check

    config = AutoConfig.for_model(model_type)
    with pytest.raises(UserError, match=why):
        check(2, config, 16384, 2, 3, "sdpa")
    assert sequence_sizes(config, 4) == [1]


def test_sequence_parallel_rejects_zero0_and_json_mismatch(capsys, tmp_path):
    zero0 = _ds(tmp_path, lambda c: c["zero_optimization"].update(stage=0))
    line = _error(capsys, ["--deepspeed", zero0, "--set", "parallel.sequence=2"])
    assert "parallel.sequence: 2 needs ZeRO stage 1, 2 or 3" in line, line
    mismatch = _ds(tmp_path, lambda c: c.update(sequence_parallel_size=4))
    line = _error(capsys, ["--deepspeed", mismatch, "--set", "parallel.sequence=2"])
    assert "sequence_parallel_size: 4 disagrees with the recipe's parallel.sequence=2" in line, line


# --------------------------------------------------------------------------- the planner's new terms


def _planned_and_measured(sets, layers=2, batch=4, seq=256):
    from memtrain.config.recipe import load_recipe
    from memtrain.memory.profile import fake_model
    from memtrain.memory.target import make_target, model_and_config
    from memtrain.memory.planner import predict_run
    from memtrain.recompute.hooks import apply_plan
    from memtrain.recompute.policy import plan_for

    recipe = load_recipe(None, [f"train.micro_batch_size={batch}", f"data.seq_len={seq}",
                                f"model.config.num_hidden_layers={layers}", *sets])
    config = model_and_config(recipe)
    target = make_target(recipe, {}, 1, "cpu")
    plan = plan_for("full", layers, backend="torch")
    pred = predict_run(recipe, json.loads(DS.read_text()), 1, plan, config, target)
    torch.manual_seed(0)
    model = fake_model(config, layers, target)  # real tensors (no fake mode): the run's loss and tiling
    apply_plan(model, plan)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    # chat rows: two samples per row, positions restarting at the second (memtrain.model.chat_data.PackedChat)
    packed = {"position_ids": torch.arange(seq // 2).repeat(2).expand(batch, -1)} if target.packed else {}
    return pred, allocator_peak(model, ids, **packed)


@pytest.fixture(scope="module")
def standard_loss_8k_vocab():
    """The standard loss's prediction and allocator peak at an 8,000-token vocabulary: the same under either fused
    loss backend, so measured once for both."""
    return _planned_and_measured(["model.config.vocab_size=8000", "train.loss=standard"])


def test_planner_logits_term_standard_and_fused_match_the_allocator(fused_backend, standard_loss_8k_vocab):
    """An 8,000-token vocabulary: the predicted activation peak with the standard and the fused loss,
    and the difference between them (the logits term), against the CPU allocator (5%). The logits term is
    tokens x vocabulary, so a larger vocabulary checks the same count (32,000 made torch's fused loss the slowest
    unit test)."""
    std_pred, std_meas = standard_loss_8k_vocab
    fused_pred, fused_meas = _planned_and_measured(["model.config.vocab_size=8000", "train.loss=fused"])
    assert std_pred.activation_peak == pytest.approx(std_meas, rel=0.05)
    assert fused_pred.activation_peak == pytest.approx(fused_meas, rel=0.05)
    assert (std_pred.activation_peak - fused_pred.activation_peak) == pytest.approx(std_meas - fused_meas, rel=0.05)
    assert std_pred.logits_and_loss > 8 * fused_pred.logits_and_loss


def test_planner_counts_the_mask_of_packed_rows():
    """Chat rows pack samples with restarting positions, and sdpa gets a (micro-batch, 1, S, S) mask keeping them
    apart: at micro-batch 2 and seq 2,048 the mask is 8 MiB, and each layer's attention keeps a float copy for its
    backward. The predicted activation peak of packed rows, and its growth over text rows, against the CPU
    allocator (5%). The mask grows as seq squared and everything else linearly, so a longer sequence only makes
    the mask a larger share of the peak: 2,048 already makes it most of the growth checked."""
    long = ["model.config.max_position_embeddings=2048", "model.config.num_attention_heads=2",
            "model.config.num_key_value_heads=2", "model.config.hidden_size=32", "model.config.intermediate_size=64"]
    text_pred, text_meas = _planned_and_measured(long, batch=2, seq=2048)
    chat_pred, chat_meas = _planned_and_measured([*long, "data.format=chat"], batch=2, seq=2048)
    assert chat_pred.activation_peak == pytest.approx(chat_meas, rel=0.05)
    assert chat_pred.activation_peak - text_pred.activation_peak == pytest.approx(chat_meas - text_meas, rel=0.05)
    assert chat_meas - text_meas >= 8 * 2**20  # the mask itself, at least


def test_planner_tiled_mlp_working_set_matches_the_allocator():
    """A wide MLP over 1,024 tokens, untiled and in 8 slices: the predicted activation peak against
    the CPU allocator (5%), and the tiling's saving."""
    wide = ["model.config.intermediate_size=2048", "model.config.max_position_embeddings=1024", "train.loss=fused"]
    plain_pred, plain_meas = _planned_and_measured(wide, batch=1, seq=1024)
    tiled_pred, tiled_meas = _planned_and_measured([*wide, "activation_checkpointing.tiled_mlp=8"], batch=1, seq=1024)
    assert plain_pred.activation_peak == pytest.approx(plain_meas, rel=0.05)
    assert tiled_pred.activation_peak == pytest.approx(tiled_meas, rel=0.05)
    assert tiled_meas < plain_meas


def test_planner_host_memory_of_offloaded_inputs_and_sequence_parallel_tokens():
    """Offloaded checkpoint inputs on the host: layers x tokens x hidden x bytes (all but the last
    layer, which keeps its input); under parallel.sequence the target holds seq / sp tokens."""
    from memtrain.config.recipe import load_recipe
    from memtrain.memory.target import make_target
    from memtrain.memory.planner import predict_run
    from memtrain.recompute.policy import plan_for

    ds = json.loads(DS.read_text())
    ds["activation_checkpointing"]["cpu_checkpointing"] = True
    for sp in (1, 2):
        recipe = load_recipe(None, ["data.seq_len=256", "train.micro_batch_size=2", f"parallel.sequence={sp}"])
        target = make_target(recipe, ds, 2, "cpu")
        assert target.seq_len == 256 // sp
        plan = plan_for("full", 4, recipe.activation_checkpointing, ds_config=ds, backend="torch")
        pred = predict_run(recipe, ds, 2, plan, None, target)
        assert pred.host_activations == 3 * 2 * (256 // sp) * 128 * 4, sp


def test_plan_max_seq(capsys):
    """`make plan BUDGET=... ARGS=--max-seq`: one row per policy x loss x tiled MLP x SP; the fused
    loss, tiled MLPs and SP each lengthen what fits; a small host budget binds offloaded runs. The model takes 8,192
    positions: no row offers a longer sequence (the trainer would refuse it), the rows it cuts name the model's limit
    as what binds, and the text says what would lift it. (One report for both claims: it takes most of a minute.)"""
    from memtrain.tools import plan as plan_cli
    from memtrain.tools.max_seq import format_max_seq

    plan_cli.main(["--json", "--max-seq", "--budget", "1GiB", "--host-budget", "40MiB", "--ngpus", "2",
                   "--set", "model.config.vocab_size=32000", "--set", "model.config.max_position_embeddings=8192"])
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert len(rows) == 3 * 2 * 2 * 2  # policies x losses x tiled x SP sizes (1, 2)
    at = {(r["policy"], r["loss"], r["tiled_mlp"], r["sequence_parallel"]): r for r in rows}
    assert at["full", "fused", 0, 1]["max_seq"] > at["full", "standard", 0, 1]["max_seq"]
    assert at["none", "fused", "auto", 1]["max_seq"] > at["none", "fused", 0, 1]["max_seq"]
    assert at["full", "fused", 0, 2]["max_seq"] > at["full", "fused", 0, 1]["max_seq"]
    assert at["full", "fused", 0, 2]["tokens_per_rank"] * 2 == at["full", "fused", 0, 2]["max_seq"]
    offload = at["full+offload", "fused", "auto", 1]
    assert offload["runs_out_first"] == "host" and offload["host_gib"] <= 40 / 1024
    assert at["full", "fused", 0, 1]["runs_out_first"] == "device"
    # the model's positions: some rows would go further (fused loss, tiled MLPs, SP) and stop at them
    assert report["position_limit"] == 8192 and max(r["max_seq"] for r in rows) == 8192
    assert {r["runs_out_first"] for r in rows if r["max_seq"] == 8192} == {"neither: the model's 8192 positions bind"}
    assert at["full", "fused", 0, 2]["max_seq"] == 8192
    assert ("(no sequence above the model's max_position_embeddings (8,192), which the trainer refuses; a longer "
            "context needs RoPE scaling: model.config.rope_parameters") in format_max_seq(report)


def test_a_tiled_profile_measures_the_parts_outside_its_layers_as_tiled_runs_do():
    """A tiled target's profile takes what the embeddings and head keep (`outside_saved`) from untiled 1- and 2-layer
    runs (memory.profile._keep_pair): equal to what the tiled 1- and 2-layer runs measure, here, and its largest block
    and head_net cover the tiled 2-layer run's. On Gemma-2 (two layer kinds); all 17 families that tile gave profiles
    byte-identical to tiled pairs' (standard and fused loss, 512 tokens, reports/readme/test-times.md)."""
    from dataclasses import replace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from memtrain.config.recipe import load_recipe
    from memtrain.memory.profile import _live, _run, fake_model, packing, profile_activations
    from memtrain.memory.target import Target, model_and_config
    from memtrain.model.attention import plain

    config = model_and_config(load_recipe(None, [*overrides("gemma2"), "data.seq_len=64"]))
    target = replace(Target("cpu", "float32", 1, 256, 1), loss="fused", tiled_mlp="auto")  # 4 slices
    profile = profile_activations(config, target, ("keep",), count_flops=False)
    with FakeTensorMode(allow_non_fake_inputs=True), packing(False), plain():
        one = _run(fake_model(config, 1, target), ("keep",), target, False)
        two = _run(fake_model(config, 2, target), ("keep", "keep"), target, False)
    assert profile.outside_saved == 2 * one["saved"] - two["saved"]
    assert profile.largest_block >= two["largest_block"]
    assert profile.head_net >= _live(two, "bwd_start1") - _live(two, "fwd_end1")
