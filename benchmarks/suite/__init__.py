"""`pipeshard bench`: the suites, and the paper's five experiments
in one run (`pipeshard bench paper`, the default).

``cli`` picks the suite (the table of suites is there); ``experiments`` parses the paper run's
options and writes its report; ``context`` holds what the experiments share
(the stage processes, the pinning, the prompts, the draft); ``parity``, ``users``,
``speculation``, ``latency`` and ``ttft`` are the experiments, each a ``run(bench)`` that
returns its raw rounds and summary and a ``table(result, bench)`` that lays them out beside the
paper's numbers (``paper``); ``plots`` draws the PNGs.
"""
