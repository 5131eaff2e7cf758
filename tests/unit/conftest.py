"""The unit tier: in-process tests on tiny shapes, each on one torch thread (a second thread only adds
synchronisation on such shapes, and spins when the cores are shared, as under pytest-xdist)."""
import pytest


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_autograd_state_left_behind():
    """Each test leaves autograd as it found it (no saved-tensor hooks, no dispatch mode, gradients on),
    transformers' attention functions and torch's global switches (_global_switches) as they were. Either left behind silently changes what later tests in the same
    worker save and measure."""
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = dict(ALL_ATTENTION_FUNCTIONS)
    switches = _global_switches()
    yield
    assert _global_switches() == switches, f"left behind: torch's global switches {switches} -> {_global_switches()}"
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    modes = torch._C._len_torch_dispatch_stack()
    assert hooks is None and modes == 0 and torch.is_grad_enabled(), (
        f"left behind: saved-tensor hooks {hooks is not None}, dispatch modes {modes}, grad {torch.is_grad_enabled()}")
    changed = sorted(k for k in set(attention) | set(ALL_ATTENTION_FUNCTIONS)
                     if attention.get(k) is not ALL_ATTENTION_FUNCTIONS.get(k))
    assert not changed, f"left behind: transformers' attention functions replaced process-wide: {changed}"


def _global_switches() -> dict:
    """Process-wide torch settings that change which kernel runs (and so what it allocates)."""
    import torch
    import torch.utils.checkpoint as ac

    b = torch.backends.cuda
    return {"default dtype": torch.get_default_dtype(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "sdpa flash/efficient/math/cudnn": (b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(),
                                                b.math_sdp_enabled(), b.cudnn_sdp_enabled()),
            "anomaly mode": torch.is_anomaly_enabled(), "recompute early stop": ac._enable_checkpoint_early_stop,
            "recompute determinism": ac._DEFAULT_DETERMINISM_MODE}
