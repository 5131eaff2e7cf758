"""The compile tests' shared parts: dynamo reset per module, one profiled forward and
backward of a model, and the token ids it reads."""
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from conftest import compiled_calls
from memtrain.recompute.meter import ActivationMeter


@pytest.fixture(scope="module")
def fresh_dynamo():
    """Compiled code of other test modules in this process stays out of the counts (and of dynamo's cache limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def token_ids(seq=32):
    return torch.randint(0, 257, (2, seq), generator=torch.Generator().manual_seed(1))


def profiled_step(model, ids):
    """One forward under the activation meter and its backward, profiled: (loss, gradients, bytes saved, calls into
    compiled code)."""
    model.zero_grad(set_to_none=True)
    meter = ActivationMeter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with meter.measure():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, meter.bytes, compiled_calls(prof)
