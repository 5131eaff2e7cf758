"""What a plain run imports (#40: the ranks' imports are the largest share of start-up): make train's preflight
and a rank's trainer, in one fresh interpreter, import no package that only another path needs."""
import json
import subprocess
import sys

from conftest import ROOT, _env

# Each is imported where its path runs: a store's build (datasets, pandas), LoRA, QLoRA, plots, op builds
# (cpp_extension, setuptools), the TensorBoard writer (the run's first log), the tools; DeepSpeed's Muon imports
# torch's inductor (compile_fx) in deepspeed.initialize, never before.
DEFERRED = ("datasets", "pandas", "scipy", "peft", "bitsandbytes", "matplotlib", "torch.utils.cpp_extension",
            "setuptools", "torch.utils.tensorboard", "torch._inductor.compile_fx", "memtrain.tools")
NEEDED = ("torch", "deepspeed", "transformers", "memtrain.train.preflight", "memtrain.train.trainer")

PROBE = """import json, sys
from memtrain.__main__ import main
main(["preflight", "--world-size", "2", "--set", "data.random_tokens=true", "--set", f"data.cache_dir={sys.argv[1]}"])
import memtrain.train.main, memtrain.train.trainer  # src/train.py's entry, and what it imports once its flags parse
print(json.dumps(sorted(name for name in sys.argv[2:] if name in sys.modules)))
"""


def test_a_plain_run_imports_nothing_it_does_not_need(tmp_path):
    """The default recipe and JSON (torch's AdamW, nothing offloaded), random tokens, a fresh profile store."""
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "cache"), *DEFERRED, *NEEDED], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.splitlines()[-1])
    assert imported == sorted(NEEDED), f"a plain run imported {sorted(set(imported) - set(NEEDED))}"
