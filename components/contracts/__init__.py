"""The data contracts every package shares: tasks, teacher traces, trajectories, the training batch and the
chat markers. A leaf: it imports no other package of this project, and everything else imports inward from
it (tests/test_import_graph.py keeps it so). docs/design.md section 5 is the specification of the trajectory."""

from components.contracts.markers import (
    CALL,
    CALL_END,
    END,
    OUTPUT,
    OUTPUT_END,
    SPECIAL_TOKENS,
    observation_text,
    prompt_text,
)
from components.contracts.task import Task
from components.contracts.trace import Trace, Turn
from components.contracts.trajectory import (
    FINISH_REASONS,
    Timings,
    TrainBatch,
    Trajectory,
    read_trajectories,
    to_tensors,
    trajectory_from_dict,
    write_trajectories,
)

__all__ = [
    "CALL",
    "CALL_END",
    "END",
    "FINISH_REASONS",
    "OUTPUT",
    "OUTPUT_END",
    "SPECIAL_TOKENS",
    "Task",
    "Timings",
    "Trace",
    "TrainBatch",
    "Trajectory",
    "Turn",
    "observation_text",
    "prompt_text",
    "read_trajectories",
    "to_tensors",
    "trajectory_from_dict",
    "write_trajectories",
]
