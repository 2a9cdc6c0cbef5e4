"""Speed measurements of pipeshard, one tool: `pipeshard bench SUITE` (`pipeshard bench --help`
lists the suites, see ``suite.cli``). Each suite is a module here (or the paper
run, ``suite/``) with a ``main(argv)``; the others (``processes``, ``report``, ``workers``,
``latency_proxy``) are what the suites share.
"""
