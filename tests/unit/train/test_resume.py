"""A run stopped by a signal and resumed equals an uninterrupted run, bit for bit (2 CPU ranks, launcher).

Attention dropout is on, so every step draws from the torch RNG: a resume that did not restore the
RNG streams would draw other masks and lose bit-equality from the first resumed step. The first test's layers are
compiled (train.compile), whose dropout draws inside the compiled region."""
import time




def test_a_timed_save_is_asked_for_once(tmp_path):
    """Rank 0's clock says a save is due: the ranks agree on it one step later, and rank 0's clock starts again at
    that agreement, so the step after asks for no second save (it did: every timed save ran twice in a row)."""
    import torch.distributed as dist

    from memtrain.train.signals import StopAgreement

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        agreement = StopAgreement(2, save_every_s=3600.0, rank=0)  # world 2: the all-reduce path, on a group of one
        agreement.last_save = time.monotonic() - 7200  # an hour and more since the last save
        due = []
        for _ in range(4):
            agreement.step()
            due.append(agreement.save_due)
        agreement.close()
        single = StopAgreement(1, save_every_s=3600.0)
        single.last_save = time.monotonic() - 7200
        single_due = [single.step() is not None and single.save_due for _ in range(3)]
    finally:
        dist.destroy_process_group()
    assert due == [False, True, False, False] and single_due == [True, False, False]
