"""doctor, auto-apply (in subprocesses) and the value-level recompute check."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import scenarios as S
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

import fsdp_autocast_fix
from fsdp_autocast_fix import _autoapply, _compat, _probe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != _autoapply.ENV_VAR}
    full_env["PYTHONPATH"] = os.pathsep.join([ROOT, full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-W", "ignore", *args], capture_output=True, text=True, env=full_env,
                          timeout=600, cwd=ROOT, **kwargs)


@pytest.fixture(scope="module")
def doctor_run() -> tuple[subprocess.CompletedProcess, dict]:
    """One ``doctor --json`` in a fresh interpreter (its live probe takes seconds), and the report it printed."""
    proc = _python("-m", "fsdp_autocast_fix", "doctor", "--json")
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_doctor_json_and_exit_code(doctor_run) -> None:
    proc, report = doctor_run
    assert report["torch"] == torch.__version__
    assert report["needs_cast_replay"] is _compat.load().needs_cast_replay
    assert report["patch_active_in_this_process"] is False
    if _probe.can_probe() is not None:  # torch 2.4-2.6 without CUDA: the code check alone says it is needed
        assert report["probe"] is None and report["probe_skipped"] == _probe.can_probe()
        assert proc.returncode == report["exit_code"] == 1 and "apply()" in report["advice"]
        return
    probe = {r["checkpoint"] + ":" + r["pattern"]: r for r in report["probe"]}
    assert all(r["patched"] == "ok" for r in probe.values())
    custom = next(r for r in report["probe"] if r["checkpoint"] == "custom")
    assert custom["stock"] == "wrong gradients"  # on every torch
    seed = report["probe"][0]
    assert (seed["stock"] != "ok") is _compat.load().needs_cast_replay
    # Something needs doing and the patch is not active in the doctor's own process: non-zero, one line of advice.
    assert proc.returncode == report["exit_code"] == 1
    assert "apply()" in report["advice"]


def test_doctor_points_to_the_report_for_the_users_own_run(doctor_run, monkeypatch, capsys) -> None:
    """The plain-text doctor, given the report of the run above, ends with the pointer to the run's own report."""
    from fsdp_autocast_fix import __main__ as cli

    _proc, report = doctor_run
    monkeypatch.setattr(cli, "doctor", lambda: report)
    assert cli.main(["doctor"]) == report["exit_code"] == 1
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-2] == report["advice"] and printed[-1] == cli.REPORT_HINT
    assert "FSDP_AUTOCAST_FIX_REPORT=1" in cli.REPORT_HINT


@pytest.mark.parametrize("command", [[], ["doctor"], ["autoapply"]])
def test_help_documents_every_command_and_its_exit_codes(command: list[str], capsys) -> None:
    from fsdp_autocast_fix.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    text = " ".join(out.split())
    assert "SUPPRESS" not in text
    if command:
        assert f"usage: fsdp-autocast-fix {command[0]} " in text and "exit codes: 0 " in text
    else:  # the doctor's subprocess command "probe" stays hidden
        assert "{doctor,autoapply}" in text and "exit codes: " in text
        assert not re.search(r"^\s+probe\b", out, re.M), out


def test_pth_line_imports_nothing_without_the_variable(tmp_path) -> None:
    (tmp_path / _autoapply.PTH_NAME).write_text(_autoapply.pth_line())
    code = (f"import site, sys; site.addsitedir({str(tmp_path)!r}); "
            "print(sorted(m for m in sys.modules if m.startswith(('wrapt', 'torch', 'fsdp_autocast_fix'))))")
    # (not the suite's own CPU stand-ins either, which tests/helpers/standins_site would bring in on torch 2.4-2.6)
    assert _python("-c", code, env={"FSDP_AUTOCAST_FIX_TEST_CPU_STANDINS": ""}).stdout.strip() == "[]"


@pytest.mark.usefixtures("pg")
def test_value_check_catches_the_silent_case() -> None:
    """Stock torch passes the x.float() case's metadata check; the value check raises, naming the tensor."""
    scenario = S.SCENARIOS["float_first"]
    stock = S.run(scenario, "stock")
    assert stock.error is None  # no error from torch's own check, on any torch
    with fsdp_autocast_fix.check_recompute():
        checked = S.run(scenario, "stock")
    if _compat.load().needs_cast_replay:  # the recompute computes other values: caught
        assert isinstance(checked.error, CheckpointError)
        assert "tensor at position" in str(checked.error) and "checksum" in str(checked.error)
    else:  # torch recomputes exactly: no false alarm
        assert checked.error is None
    assert S.run(scenario, "stock").error is None  # the default is restored after the block


@pytest.mark.usefixtures("pg")
def test_value_check_passes_exact_recomputes() -> None:
    with fsdp_autocast_fix.check_recompute():
        result = S.run(S.SCENARIOS["float_first"], "patched_fully_shard")
    assert result.error is None


def test_value_check_as_determinism_check() -> None:
    name = fsdp_autocast_fix.register_value_check()
    assert name == fsdp_autocast_fix.VALUE_CHECK
    lin = torch.nn.Linear(4, 4)
    calls = []

    def changing(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return torch.tanh(lin(x) * (1.0 + 1e-3 * len(calls)))  # recompute: other values, same metadata

    x = torch.randn(2, 4, requires_grad=True)
    checkpoint(changing, x, use_reentrant=False).sum().backward()  # torch's default check: passes
    calls.clear()
    with fsdp_autocast_fix.check_recompute(), pytest.raises(CheckpointError, match="checksum"):
        checkpoint(changing, x, use_reentrant=False).sum().backward()
    calls.clear()
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint(changing, x, use_reentrant=False, determinism_check=name).sum().backward()
