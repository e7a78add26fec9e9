"""What an Engine uses when its arguments say ``"auto"`` or nothing: the environment variables ``stratagem run``
sets, and the defaults."""

#: ``stratagem run --strategy S`` sets this; it replaces ``strategy="auto"``.
STRATEGY_ENV = "STRATAGEM_STRATEGY"
#: Names the launcher for ``launcher="auto"`` (``stratagem run --launcher L`` sets it too).
LAUNCHER_ENV = "STRATAGEM_LAUNCHER"
#: The launcher of ``launcher="auto"`` when the environment names none: torch's elastic agent.
DEFAULT_LAUNCHER = "elastic"
#: Seconds a collective may wait before the process group gives up (``Engine(timeout=...)``).
DEFAULT_TIMEOUT_S = 1800.0
