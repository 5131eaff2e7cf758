"""memtrain.startup_gc: the collector held over start-up imports, what they made frozen once, then back on."""
import gc

from memtrain import startup_gc


def test_imports_are_frozen_once_and_the_collector_is_back_on():
    # nothing is unfrozen here: the session's own frozen imports (tests/conftest.py) stay out of the scans
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    try:
        startup_gc.hold()
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # objects the collector tracks, made while it is held
        startup_gc.imports_done()
        assert gc.isenabled()
        frozen = gc.get_freeze_count()  # counted by the interpreter, not by startup_gc
        assert frozen >= frozen_before + len(made)
        later = [[i] for i in range(1000)]  # a second run in the same process: nothing held, nothing frozen
        startup_gc.imports_done()
        # not more than before: a second freeze would add `later`'s 1,000; frozen objects that die since leave the count
        # (one CI run saw 2 fewer)
        assert gc.get_freeze_count() <= frozen and gc.isenabled() and later
    finally:
        gc.enable()
