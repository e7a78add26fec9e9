"""The contract suite: ``pytest --pyargs stratagem.contract --stratagem-strategy NAME``.

Each ``test_*`` module here is one group of checks. They assert on the results of two real multi-process runs
per strategy (see :mod:`stratagem.testing._workers`), launched once and shared through session fixtures of
the ``stratagem.testing`` pytest plugin. A check that the strategy's declared capabilities do not promise is
skipped, with the capability named as the reason.
"""
