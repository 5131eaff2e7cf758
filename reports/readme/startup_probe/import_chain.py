"""CPU (user + sys) and wall seconds of each link of a rank's import chain, in the order a rank meets them.
Usage, from the repository root: PYTHONPATH=src .venv/bin/python reports/readme/startup_probe/import_chain.py"""
import importlib
import os
import sys
import time

steps = [("torch", ["torch"]), ("deepspeed", ["deepspeed"]),
         ("transformers' modeling_utils (MoE, torch._dynamo, DTensor, sympy)", ["transformers.modeling_utils"]),
         ("the Llama model", ["transformers.models.llama.modeling_llama"]),
         ("memtrain's trainer (on top)", ["memtrain.train.main", "memtrain.train.trainer"]),
         ("TensorBoard writer", ["torch.utils.tensorboard"]),
         ("DeepSpeed's Muon (torch._inductor.compile_fx, functorch)", ["deepspeed.runtime.zero.muon.muon_optimizer"])]
out = []
for label, mods in steps:
    c, t = os.times(), time.time()
    for m in mods:
        importlib.import_module(m)
    c2 = os.times()
    out.append(f"{label}\t{c2.user + c2.system - c.user - c.system:.2f}\t{time.time() - t:.2f}")
c = os.times()
print("\n".join(out))
print(f"total\t{c.user + c.system:.2f}\t-\t{len(sys.modules)} modules")
