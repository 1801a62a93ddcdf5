"""launch.heap.settle_heap, in a fresh interpreter (it changes process-wide GC state)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_settled_heap_is_frozen_and_new_cycles_are_still_collected() -> None:
    script = textwrap.dedent("""
        import gc, weakref
        from helios_logprobs.launch.heap import YOUNG_THRESHOLD, settle_heap
        assert gc.get_freeze_count() == 0
        settle_heap()
        assert gc.get_freeze_count() > 1000, gc.get_freeze_count()
        assert gc.get_threshold()[0] == YOUNG_THRESHOLD
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # a cycle: reference counting alone keeps it
        gc.collect()
        assert gone() is None
        settle_heap()  # repeating is harmless
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
