"""The differential fuzzer (tests/fuzz.py): seeded cases of every call comm stages, each checked on every rank
against the reference the rank computes from every rank's regenerated inputs, staged and in a served-only control.

``make test`` runs a slice (seed 1), ``make test-integration`` thousands (seed 2); ``COMM_FUZZ_CASES`` sets how
many, ``COMM_FUZZ_SEED`` another seed, and ``COMM_FUZZ_CASE=seed:index`` replays one case (docs/testing.md).
"""

import collections
import os
from typing import Dict, List, Sequence, Tuple

import pytest

import comm

import fuzz
from multiproc import gloo_lacks_all_to_all, run_ranks

pytestmark = pytest.mark.skipif(comm.unavailable_reason() is not None, reason=str(comm.unavailable_reason()))

SLICE = (1, 300)  # seed and cases of make test
THOUSANDS = (2, 4000)  # of make test-integration
REPLAY = "COMM_FUZZ_CASE"


def _cases(seed: int, indices: Sequence[int]) -> List[fuzz.Case]:
    names = fuzz.ops(lacks_all_to_all=gloo_lacks_all_to_all() is not None)
    return [fuzz.draw_case(seed, index, names) for index in indices]


def _tier(seed: int, count: int) -> List[fuzz.Case]:
    """A tier's cases: its seed and count, unless COMM_FUZZ_SEED or COMM_FUZZ_CASES say otherwise."""
    seed = int(os.environ.get("COMM_FUZZ_SEED", seed))
    return _cases(seed, range(int(os.environ.get("COMM_FUZZ_CASES", count))))


def _run(cases: Sequence[fuzz.Case]) -> Dict[Tuple[str, str], List[Tuple[int, dict]]]:
    """Every case, staged and control, in one run_ranks per simulation and world size; each run's reports by rank."""
    batches: Dict[Tuple[str, int], List[fuzz.Case]] = collections.defaultdict(list)
    for case in cases:
        batches[case.simulation, case.world].append(case)
    reports: Dict[Tuple[str, str], List[Tuple[int, dict]]] = collections.defaultdict(list)
    for (simulation, world), batch in sorted(batches.items()):
        options = fuzz.SIMULATIONS[simulation]
        results = run_ranks(fuzz.rank_main, world, backend=options["backend"], simulate=options, args=(batch,),
                            timeout=60 + 2 * len(batch), pg_timeout=fuzz.TIMEOUT.total_seconds())
        for rank, rank_reports in enumerate(results):
            for case_id, variant, report in rank_reports:
                reports[case_id, variant].append((rank, report))
    return reports


def _failures(cases: Sequence[fuzz.Case]) -> List[str]:
    """What went wrong, one line per case and variant, naming the case and how to replay it."""
    reports = _run(cases)
    failures = []
    for case in cases:
        for variant in ("staged", "control"):
            ranks = reports[case.id, variant]
            problems = [f"rank {rank}: {problem}" for rank, report in ranks for problem in report["problems"]]
            if sorted(rank for rank, _ in ranks) != case.group_ranks():
                problems.append(f"reports came from ranks {sorted(rank for rank, _ in ranks)} only")
            refused = sorted(rank for rank, report in ranks if report["outcome"] is not None)
            if refused and len(refused) != len(ranks):
                problems.append(f"refused on ranks {refused} only")
            if problems:
                failures.append(f"case {case.id} {variant}: {case.describe()}\n    " + "\n    ".join(problems)
                                + f"\n    replay: {REPLAY}={case.id} .venv/bin/python -m pytest -q -p no:xdist "
                                  "tests/test_fuzz.py -k replay")
    return failures


def _check(cases: Sequence[fuzz.Case]) -> None:
    failures = _failures(cases)
    assert not failures, f"{len(failures)} of {2 * len(cases)} runs failed:\n" + "\n".join(failures[:20])


def test_a_slice_of_cases():
    _check(_tier(*SLICE))


@pytest.mark.integration
def test_thousands_of_cases():
    _check(_tier(*THOUSANDS))


def exclusion_counts(cases: Sequence[fuzz.Case]) -> Dict[str, int]:
    """How many of ``cases`` each row of fuzz.EXCLUSIONS redrew."""
    counts = dict.fromkeys(fuzz.EXCLUSIONS, 0)
    for case in cases:
        for name in case.excluded:
            counts[name] += 1
    return counts


def test_the_exclusions_are_counted():
    """Every exclusion is in fuzz.EXCLUSIONS and redraws some of the integration tier's cases, none of them more
    than a tenth: a row that redraws nothing is dead, one that redraws much hides too much. The counts, per tier,
    are in docs/testing.md."""
    for seed, count in (SLICE, THOUSANDS):
        cases = _cases(seed, range(count))
        counts = exclusion_counts(cases)
        assert set(counts) == set(fuzz.EXCLUSIONS), counts
        assert all(n <= count / 10 for n in counts.values()), counts
        if (seed, count) == THOUSANDS:
            assert all(n > 0 for n in counts.values()), counts
        print(f"seed {seed}, {count} cases: {counts}")


@pytest.mark.skipif(REPLAY not in os.environ, reason=f"replays the case {REPLAY}=seed:index names")
def test_replay():
    seed, index = (int(part) for part in os.environ[REPLAY].split(":"))
    _check(_cases(seed, [index]))

