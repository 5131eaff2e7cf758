"""final/'s weights streamed shard by shard (memtrain.train.final_weights) on 2 gloo ranks (two small worker
processes, torch's own process group, no DeepSpeed engine): a disk too slow to write the whole model within the
collective timeout still ends with both ranks done, rank 0 never held the whole model, and transformers loads exactly
the model that was streamed."""
import subprocess
import sys


from conftest import ROOT, _env
from memtrain.train.ports import free_port

TIMEOUT_S = 4.0  # the ranks' collective timeout
RATE = 6e6  # bytes/s of rank 0's slowed fsync: the 41 MB model takes ~7 s, the first shard ~2 s


def test_slow_disk_streams_within_the_collective_timeout(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests"))
    from final_weights_worker import model

    out, port = tmp_path / "final", free_port()
    worker = ROOT / "tests" / "final_weights_worker.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(r), str(port), str(out), str(TIMEOUT_S), str(RATE)],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)

    want = model()
    total = sum(p.numel() * p.element_size() for p in want.parameters())
    assert total / RATE > 1.5 * TIMEOUT_S  # the whole model's write would outlast the timeout
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists() and not list(out.glob(".shard-*"))
    assert max(s.stat().st_size for s in shards) < total / 2  # rank 0 held a shard, never the model
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    got = loaded.state_dict()
    assert set(got) == set(want.state_dict())
    for name, value in want.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
