"""comm.observability: exact figures from many threads, and resets that hold."""

import threading

import comm
from comm.observability import count_staged

THREADS, CALLS = 8, 2_000


def _count_from_threads(op):
    def worker():
        for _ in range(CALLS):
            count_staged(op, 2, 4, 0.5)

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_counts_from_many_threads_are_exact_and_reset_to_zero():
    comm.reset_stats()
    _count_from_threads("test_op")
    calls = THREADS * CALLS
    assert comm.stats()["test_op"] == {
        "staged_calls": calls, "transfers": 2 * calls, "bytes_staged": 4 * calls, "staging_seconds": 0.5 * calls,
    }
    comm.reset_stats()
    assert "test_op" not in comm.stats()
    _count_from_threads("test_op")
    assert comm.stats()["test_op"]["staged_calls"] == calls
    comm.reset_stats()
