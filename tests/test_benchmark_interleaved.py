"""The e2e benchmark's interleaved timing alternates the runners' order, so no runner is always the one after."""
from benchmarks.e2e import interleaved, interleaved_rounds, paired_ratio


def test_rounds_alternate_the_order_and_every_runner_gets_a_median():
    calls = []
    runners = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    medians = interleaved(runners, rounds=4, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # the warm-up
    assert calls[3:] == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert set(medians) == {"a", "b", "c"} and all(v >= 0 for v in medians.values())


def test_every_round_is_kept_for_the_ratios():
    times = interleaved_rounds({"a": lambda: None, "b": lambda: None}, rounds=5, warmup=0)
    assert [len(t) for t in times.values()] == [5, 5]


def test_paired_ratio_is_taken_round_by_round_not_from_the_medians():
    # the machine's speed moves between rounds: two rounds say 2x, one says 1x; the medians' ratio (3 / 2) says 1.5x
    times = {"slow": [4.0, 2.0, 3.0], "fast": [2.0, 1.0, 3.0]}
    assert paired_ratio(times, "slow", "fast") == (2.0, 1.0, 2.0)
    times = {"slow": [3.0, 4.0, 5.0], "fast": [1.0, 1.0, 1.0]}
    assert paired_ratio(times, "slow", "fast") == (4.0, 3.0, 5.0)
