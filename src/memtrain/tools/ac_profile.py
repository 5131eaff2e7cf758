"""What each AC policy costs on a recipe's model: one measured training step per policy, on CPU.

`python -m memtrain ac-profile [--recipe YAML] [--set k=v ...] [--policies a,b,...]`
(`make ac-profile [RECIPE=...]`) builds the recipe's model in fp32, runs one forward+backward
per policy on the same random token batch and writes a table (stdout) and a CSV
(`reports/ac_profile.csv`):

* activation_bytes: bytes saved for the backward and alive at the end of the forward
  (`memtrain.metrics.ActivationMeter`: saved-tensor hooks, plus checkpoint inputs and
  op-level saved outputs, which checkpoints hold outside autograd);
* peak_backward_bytes: the largest live set of saved plus recomputed activation bytes during
  the backward. Every storage counted in activation_bytes, and every tensor a recompute
  produces (watched by a dispatch mode entered around each recompute via
  `memtrain.recompute.observe_recompute`), is tracked through a weak reference to its storage; the
  live total is sampled when the backward starts and after every recompute op. Between
  recomputes the backward only frees activations, so these samples contain the peak.
  Gradients and the backward's own temporaries are not activations and are not counted;
* flops_total: forward + backward + recompute FLOPs (`torch.utils.flop_counter.FlopCounterMode`,
  with `memtrain.memory.flops`' formulas for CPU flash attention and MoE `aten._grouped_mm` added);
* recompute_overhead: flops_total / flops_total(none) - 1;
* max_grad_rel_err: max over parameters of ||g - g_none|| / ||g_none|| (fp32, same seed).
"""
from __future__ import annotations

import csv
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn
from tqdm import tqdm

from memtrain.config.recipe import DEFAULT_OP_SAVE
from memtrain.recompute.policy import OP, ACPlan, plan_for
from memtrain.recompute.hooks import apply_plan, observe_recompute
from memtrain.memory.flops import flop_counter
from memtrain.errors import UserError, cli_entry
from memtrain.tools.flags import AC_PROFILE_SEQ_LEN, ac_profile_parser
from memtrain.recompute.meter import ActivationMeter, StepTracker
from memtrain.config.recipe import load_recipe
from memtrain.model.build import build_config, build_model, decoder_layers
from memtrain.model.data import build_tokenizer

COLUMNS = ("policy", "layers", "activation_bytes", "peak_backward_bytes", "flops_total", "recompute_overhead",
           "max_grad_rel_err", "note")  # note: why a policy is n/a for this model


@dataclass
class StepCost:
    """One measured training step. `grads` are the parameters' own .grad tensors (the next
    `measure_step` sets .grad to None first, so earlier results stay valid)."""

    activation_bytes: int
    peak_backward_bytes: int
    flops_total: int
    loss: float
    grads: dict[str, torch.Tensor]


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


def measure_step(model: nn.Module, plan: ACPlan, input_ids: torch.Tensor, *, seed: int = 0,
                 loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = causal_lm_loss) -> StepCost:
    """Install `plan` on `model` (a causal LM or its decoder-layer list) and measure one
    forward+backward from `seed` (same seed, same dropout masks)."""
    apply_plan(model, plan)
    model.train()
    model.zero_grad(set_to_none=True)
    meter = ActivationMeter()
    torch.manual_seed(seed)
    with flop_counter() as flops:
        with meter.measure(keep=True):
            loss = loss_fn(model, input_ids)
        # the backward's live set: what the forward saved, plus whatever each recompute makes
        live = StepTracker()
        for storage in meter.storages():
            live.adopt(storage)
        meter.release()
        with observe_recompute(lambda: live):
            loss.backward()
        live.sweep()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return StepCost(meter.bytes, max(live.curve()), flops.get_total_flops(), loss.item(), grads)


def max_rel_err(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    if grads.keys() != ref.keys():
        return math.inf
    worst = 0.0
    for name, g in grads.items():
        denom = ref[name].norm().item()
        diff = (g - ref[name]).norm().item()
        worst = max(worst, diff / denom if denom else diff)
    return worst


# --------------------------------------------------------------------------- CLI

def _plans(policies: Optional[list[str]], section, num_layers: int) -> list[ACPlan]:
    """'none' first; by default a representative set, including torchtitan's op-level variant."""
    half = max(1, num_layers // 2)
    specs = [(p, section) for p in ["none", *(policies or ["full", "every:2", f"first:{half}", "sqrt",
                                                            "selective:attn", "selective:mlp", "op"])]]
    if policies is None:
        specs += [("op", section.model_copy(update={"op_save": ["matmul/2", "attention"]})),
                  (f"op+first:{half}", section)]
    plans = [plan_for(p, num_layers, s, backend="torch") for p, s in specs if p]
    return list({label(p): p for p in plans}.values())  # each once


def label(plan: ACPlan) -> str:
    """The policy, with op-level's save list when it is not the default."""
    custom = OP in plan.layers and plan.op_save != DEFAULT_OP_SAVE
    return plan.policy + (f" [{','.join(plan.op_save)}]" if custom else "")


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def format_table(rows: list[dict]) -> str:
    head = ["policy", "layers", "act MiB", "peak bwd MiB", "GFLOP", "recompute", "max grad err"]
    def cells(r):
        return [r["policy"], r["layers"], _fmt_bytes(r["activation_bytes"]), _fmt_bytes(r["peak_backward_bytes"]),
                f"{r['flops_total'] / 1e9:,.2f}", f"{r['recompute_overhead']:+.1%}", f"{r['max_grad_rel_err']:.1e}"]

    body = [cells(r) if r["layers"] != "n/a" else [r["policy"], "n/a: " + r["note"]] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *(b for b in body if len(b) == len(head)))]
    widths[0] = max([widths[0]] + [len(b[0]) for b in body])
    line = lambda cells: "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    body = [line(b) if len(b) == len(head) else f"{b[0].ljust(widths[0])}  {b[1]}" for b in body]
    return "\n".join([line(head), line(["-" * w for w in widths]), *body])


def profile(recipe, policies: Optional[list[str]], seq_len: int, batch: int) -> tuple[list[dict], str]:
    """Measure each policy (after 'none', the reference) on the recipe's model; rows + header line."""
    config = build_config(recipe.model, build_tokenizer(recipe.data.tokenizer).vocab_size, seq_len)
    section = recipe.activation_checkpointing
    L = config.num_hidden_layers
    plans = _plans(policies, section, L)
    torch.manual_seed(recipe.train.seed)
    model = build_model(recipe.model.model_copy(update={"dtype": "float32"}), config)
    decoder_layers(model)  # a model without a decoder-layer list fails here, with one line
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    h = config.hidden_size
    header = (f"recipe {recipe.name}: {config.model_type}, {L} layers, hidden {h}, vocab {config.vocab_size}; "
              f"one step at batch {batch} x seq {seq_len}, fp32, CPU; one layer's hidden state "
              f"4*s*b*h = {_fmt_bytes(4 * seq_len * batch * h)} MiB (2*s*b*h in 16-bit)")
    rows, ref, ref_grads = [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        for plan in tqdm(plans, desc="ac-profile", unit="policy", file=sys.stderr, dynamic_ncols=True):
            try:
                cost = measure_step(model, plan, ids, seed=recipe.train.seed)
            except UserError as e:  # a policy this model cannot take (OPT has no MLP sublayer): one row says why
                if ref is None:
                    raise
                rows.append({"policy": label(plan), "layers": "n/a", "note": str(e).split(": ", 1)[-1]})
                continue
            if ref is None:  # the reference gradients wait on disk (memory-mapped): a 1B model's are 4 GiB
                torch.save(cost.grads, Path(tmp) / "ref.pt")
                ref, ref_grads = cost, torch.load(Path(tmp) / "ref.pt", mmap=True)
                cost.grads = ref_grads
            rows.append({"policy": label(plan), "layers": plan.layer_marks().replace(" ", ""),
                         "activation_bytes": cost.activation_bytes, "peak_backward_bytes": cost.peak_backward_bytes,
                         "flops_total": cost.flops_total,
                         "recompute_overhead": cost.flops_total / ref.flops_total - 1,
                         "max_grad_rel_err": max_rel_err(cost.grads, ref_grads)})
            del cost
    return rows, header


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


@cli_entry
def main(argv: Optional[list[str]] = None) -> None:
    args = ac_profile_parser().parse_args(argv)
    recipe = load_recipe(args.recipe, args.overrides)
    seq_len = args.seq_len or min(recipe.data.seq_len, AC_PROFILE_SEQ_LEN)
    if seq_len <= 0 or args.batch <= 0:
        raise UserError("--seq-len/--batch: must be positive")
    policies = [p.strip() for p in args.policies.split(",")] if args.policies else None
    rows, header = profile(recipe, policies, seq_len, args.batch)
    print(header)
    print(format_table(rows))
    write_csv(rows, Path(args.out))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
