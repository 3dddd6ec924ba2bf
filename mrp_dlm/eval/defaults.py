"""How much work `mrp eval`, `mrp bench` and `mrp demo` do unless told: batch sizes and
problem counts, in a module that imports nothing, so that the CLI builds its help (and
answers `--help` and argument errors) without importing torch.

Deliberately not here: the grid of modes (see `grid.py`) and the Pareto sweep's sizes
(`pareto.py`, itself light).
"""

EVAL_BATCH_SIZE = 16  # `mrp eval`: prompts per decode call
BENCH_BATCH_SIZE = 1  # `mrp bench`: prompts per decode call; speedups are judged at batch 1
DEMO_PROBLEMS = 20  # `mrp demo`: held-out problems per task
