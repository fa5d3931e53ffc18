"""The config walk's counts (tools/config_walk.py), by hand on a made-up walk."""

from tools.config_walk import summary, walks


def test_rooms_moves_and_returns_count_stays_not_calls():
    calls = [("a.py", "f"), ("a.py", "g"), ("b.py", "h"), ("a.py", "i"), ("c.py", "j"), ("b.py", "k"), ("b.py", "l")]
    result = summary(calls)
    # stays: a, b, a, c, b -> 3 rooms, 4 moves, 2 returns (into a, then into b)
    assert result["stays"] == ["a.py", "b.py", "a.py", "c.py", "b.py"]
    assert (result["rooms"], result["moves"], result["returns"]) == (3, 4, 2)
    assert summary([]) | {"calls": []} == {"rooms": 0, "moves": 0, "returns": 0, "stays": [], "calls": []}


def test_a_helper_given_a_section_leaves_the_whole_configs_walk_only():
    calls = [("a.py", "f", True), ("b.py", "section_helper", False), ("a.py", "g", True)]
    both = walks(calls)
    assert both["config"]["stays"] == ["a.py"] and both["config"]["returns"] == 0
    assert both["sections"]["stays"] == ["a.py", "b.py", "a.py"] and both["sections"]["returns"] == 1
