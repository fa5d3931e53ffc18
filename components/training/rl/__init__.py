"""The RL loop: `trainer.py` (the loop), `learner.py` (the engines on every rank and their messages), the one
algorithm step, and what the loop uses (buffer, checkpoints, the collapse guard, recording and replay)."""
