"""comm.observability: exact counts from many threads, and resets that hold."""

import threading

import comm
from comm.observability import call_counter, count_staging

THREADS, CALLS = 8, 20_000


def _count_from_threads(op):
    count = call_counter(op)  # what the all_reduce fast path holds

    def worker():
        for _ in range(CALLS):
            count()
        count_staging(op, 4, 0.5, new_call=True)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_counts_from_many_threads_are_exact_and_reset_to_zero():
    comm.reset_stats()
    _count_from_threads("test_op")
    assert comm.stats()["test_op"] == {
        "calls": THREADS * CALLS, "staged_calls": THREADS, "bytes_staged": THREADS * 4,
        "staging_seconds": THREADS * 0.5,
    }
    comm.reset_stats()
    assert "test_op" not in comm.stats()
    _count_from_threads("test_op")  # the same counter, held across the reset
    assert comm.stats()["test_op"]["calls"] == THREADS * CALLS
    comm.reset_stats()
