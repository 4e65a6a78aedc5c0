"""The e2e benchmark's interleaved timing alternates the runners' order, so no runner is always the one after."""
from benchmarks.e2e import interleaved


def test_rounds_alternate_the_order_and_every_runner_gets_a_median():
    calls = []
    runners = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    medians = interleaved(runners, rounds=4, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # the warm-up
    assert calls[3:] == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    assert set(medians) == {"a", "b", "c"} and all(v >= 0 for v in medians.values())
