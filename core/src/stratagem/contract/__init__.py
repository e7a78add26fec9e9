"""The contract suite: ``pytest --pyargs stratagem.contract --stratagem-strategy NAME`` (or ``stratagem
contract NAME``), and the pytest plugin that runs it (:mod:`stratagem.contract.plugin`, registered under
``pytest11``).

Each ``test_*`` module here is one group of checks. They assert on the results of two real multi-process runs
per strategy (see :mod:`stratagem.contract._workers`), launched once and shared through session fixtures of
the plugin. A check that the strategy's declared capabilities do not promise is skipped, with the capability
named as the reason. The private modules are the runner (``_runner``), what runs in the workers
(``_workers``, ``_model``, ``_recorder``) and the comparisons (``_comparisons``); launchers have their section
(``test_launcher``), callbacks and loggers theirs (``test_callback``). ``--stratagem-report FILE`` writes the
run's certificate (``_certificate_writer``; the schema ``certificate.schema.json``; the verdict ``_certificate``).
"""

#: The file name under which a plugin ships its certificate, beside its entry-point module. Here rather than in
#: ``_certificate`` so that a listing can look for it without importing anything.
CERTIFICATE_FILE = "stratagem-certificate.json"
