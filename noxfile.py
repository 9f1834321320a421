"""Test sessions, one per torch release; run ``python3 -m nox`` (see README).

Environments are made with uv and reused between runs. A CPU build of torch that
lies on this machine's disk (``/opt/wheels``) is preferred when present.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

BUGGY = ["2.12.1"]
FIXED = ["2.13.0"]
LOCAL_WHEELS = "/opt/wheels"


def _install_torch(session: nox.Session, version: str) -> None:
    args = [f"torch=={version}"]
    if os.path.isdir(LOCAL_WHEELS):
        args += ["--find-links", LOCAL_WHEELS]
    session.install(*args)


@nox.session(python="3.11")
@nox.parametrize("torch", BUGGY + FIXED, ids=BUGGY + FIXED)
def tests(session: nox.Session, torch: str) -> None:
    """The whole suite against one torch release."""
    _install_torch(session, torch)
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """Install the project beside torch 2.12.1 (has the bug) and show the failure and the fix."""
    _install_torch(session, "2.12.1")
    session.install(".")
    session.run("python", "-W", "ignore", "-m", "fsdp_autocast_fix", "demo")


@nox.session(python="3.11")
@nox.parametrize("torch", BUGGY + FIXED, ids=BUGGY + FIXED)
def table(session: nox.Session, torch: str) -> None:
    """Print the scenario table (stock / apply / late apply / patched_fully_shard) for one torch."""
    _install_torch(session, torch)
    session.install("-e", ".[test]")
    session.run("python", "tests/scenarios.py")
