"""The fault points' spec: `name@N[:action]` fires once, `name@N+` from the N-th pass on."""

import pytest

from components import faults


@pytest.fixture
def armed(monkeypatch):
    def arm(spec: str) -> None:
        monkeypatch.setattr(faults, "_faults", faults.parse_faults(spec))
        monkeypatch.setattr(faults, "_hits", {})

    return arm


def _fired(passes: int) -> list[int]:
    fired = []
    for hit in range(1, passes + 1):
        try:
            faults.fault_point("weights.bucket")
        except faults.InjectedFault:
            fired.append(hit)
    return fired


def test_a_fault_fires_on_its_hit_or_from_it_on(armed):
    assert faults.parse_faults("weights.bucket@2:raise, store.upload@3") == {
        "weights.bucket": (2, "raise"),
        "store.upload": (3, "kill"),
    }
    assert faults.parse_faults("weights.bucket@2+:raise") == {"weights.bucket": (2, "raise+")}
    armed("weights.bucket@2:raise")
    assert _fired(5) == [2]
    armed("weights.bucket@2+:raise")
    assert _fired(5) == [2, 3, 4, 5]


@pytest.mark.parametrize(
    "spec,message",
    [
        ("weights.bucket@0:raise", "needs a hit number >= 1"),
        ("weights.bucket@+:raise", "needs a hit number >= 1"),
        ("weights.bucket@2:explode", "unknown action 'explode'"),
        ("weights.buckets@2", "unknown fault point 'weights.buckets'"),
    ],
)
def test_a_bad_spec_names_the_entry(spec, message):
    with pytest.raises(ValueError, match=message):
        faults.parse_faults(spec)
