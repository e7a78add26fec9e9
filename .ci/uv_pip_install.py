"""Run `uv pip install ARGS` into this interpreter's environment, from the same sources pip would use.

uv reads none of pip's configuration (pip.conf files, PIP_* variables). This takes pip's own view of it
(`pip config list`) and passes on what decides which files get installed, and from where: the indexes, the
wheel directories, the constraints files, the certificate bundle and the network timeout.
Usage: python .ci/uv_pip_install.py [uv pip install arguments].
"""

import ast
import os
import subprocess
import sys

# pip option -> uv option. The multi-valued ones are whitespace-separated lists in pip's configuration.
_SINGLE = {"index-url": "--index-url"}
_MULTIPLE = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
# Later sections override earlier ones, as in pip (its environment variables show as the ":env:" section).
_SECTIONS = ("global", "install", ":env:")


def pip_options() -> dict[str, str]:
    """pip's effective configuration for `pip install`, by option name."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    by_section: dict[str, dict[str, str]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        section, dot, name = key.rpartition(".")
        if sep and dot:
            by_section.setdefault(section, {})[name] = ast.literal_eval(value)
    options: dict[str, str] = {}
    for section in _SECTIONS:
        options.update(by_section.get(section, {}))
    return options


def uv_command(options: dict[str, str], args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The uv command line and environment equivalent to `pip install ARGS` under OPTIONS."""
    # pip takes the best version found across all its indexes and links; uv by default stops at the first
    # index that has the package at all.
    command = [sys.executable, "-m", "uv", "pip", "install", "--python", sys.executable]
    command += ["--index-strategy", "unsafe-best-match"]
    for name, flag in _SINGLE.items():
        if options.get(name):
            command += [flag, options[name]]
    for name, flag in _MULTIPLE.items():
        for value in options.get(name, "").split():
            command += [flag, value]
    if options.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        command.append("--no-index")
    env = dict(os.environ)
    if options.get("cert"):
        env["SSL_CERT_FILE"] = options["cert"]
    if options.get("default-timeout"):
        env["UV_HTTP_TIMEOUT"] = str(round(float(options["default-timeout"])))
    return command + args, env


if __name__ == "__main__":
    cmd, environment = uv_command(pip_options(), sys.argv[1:])
    sys.exit(subprocess.run(cmd, env=environment).returncode)
