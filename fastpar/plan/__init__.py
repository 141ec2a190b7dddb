"""``python -m fastpar plan``: which layout to run a model in on a cluster, how fast, and in
how much memory per rank (docs/design.md, "The planner").

Files: ``cluster.py`` (the machine), ``model.py`` (the model: preset, flags, HF config),
``layouts.py`` (a layout, its name, the candidates, why one cannot run), ``costs.py`` (seconds
of each piece), ``predict.py`` (one layout: the pipeline's timeline, memory per rank),
``search.py`` (every layout, ranked), ``calibrate.py`` (this machine's speeds), ``cli.py``.
"""
