"""doctor, demo, auto-apply (in subprocesses) and the value-level recompute check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import scenarios as S
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

import fsdp_autocast_fix
from fsdp_autocast_fix import _autoapply, _compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != _autoapply.ENV_VAR}
    full_env["PYTHONPATH"] = os.pathsep.join([ROOT, full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-W", "ignore", *args], capture_output=True, text=True, env=full_env,
                          timeout=600, cwd=ROOT, **kwargs)


def test_doctor_json_and_exit_code() -> None:
    proc = _python("-m", "fsdp_autocast_fix", "doctor", "--json")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["torch"] == torch.__version__
    assert report["needs_cast_replay"] is _compat.load().needs_cast_replay
    assert report["patch_active_in_this_process"] is False
    probe = {r["checkpoint"] + ":" + r["pattern"]: r for r in report["probe"]}
    assert all(r["patched"] == "ok" for r in probe.values())
    custom = next(r for r in report["probe"] if r["checkpoint"] == "custom")
    assert custom["stock"] == "wrong gradients"  # on every torch
    seed = report["probe"][0]
    assert (seed["stock"] != "ok") is _compat.load().needs_cast_replay
    # Something needs doing and the patch is not active in the doctor's own process: non-zero, one line of advice.
    assert proc.returncode == report["exit_code"] == 1
    assert "apply()" in report["advice"]


def test_doctor_exit_0_when_the_patch_is_active(tmp_path) -> None:
    """With auto-apply on, the doctor's own process is patched, and the patch covers every pattern."""
    proc = _python("-m", "fsdp_autocast_fix", "autoapply", "install", "--target", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    code = textwrap.dedent(f"""
        import site, sys
        site.addsitedir({str(tmp_path)!r})
        import torch.distributed.fsdp
        from fsdp_autocast_fix.__main__ import main
        sys.exit(main(["doctor"]))
    """)
    proc = _python("-c", code, env={_autoapply.ENV_VAR: "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "patch active in this process: True" in proc.stdout


def test_demo() -> None:
    proc = _python("-m", "fsdp_autocast_fix", "demo")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if not line.startswith("[Gloo]")]  # gloo 2.8-2.10 prints
    assert lines[0] == f"torch {torch.__version__}"
    assert all(line.rstrip().endswith("| ok") for line in lines[2:]), proc.stdout


UNAWARE_SCRIPT = textwrap.dedent("""
    # A training script that knows nothing of fsdp_autocast_fix.
    import site, socket, sys
    if len(sys.argv) > 1:
        site.addsitedir(sys.argv[1])
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.utils.checkpoint import checkpoint
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
    m = nn.Sequential(nn.GELU(), nn.Linear(8, 8))
    fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    x = torch.randn(4, 8, requires_grad=True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            checkpoint(m, x, use_reentrant=False).sum().backward()
        print("RESULT ok")
    except Exception as e:
        print("RESULT", type(e).__name__)
    print("PATCHED", "fsdp_autocast_fix" in sys.modules and sys.modules["fsdp_autocast_fix"].status().patched_globally)
    dist.destroy_process_group()
""")


@pytest.mark.skipif(not hasattr(_compat.fsdp_package(), "MixedPrecisionPolicy")
                    or _compat.fsdp_package().__name__ != "torch.distributed.fsdp",
                    reason="the unaware script imports fully_shard from torch.distributed.fsdp (torch >= 2.6)")
def test_autoapply_without_editing_the_script(tmp_path) -> None:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    script = tmp_path / "train.py"
    script.write_text(UNAWARE_SCRIPT)
    assert _python("-m", "fsdp_autocast_fix", "autoapply", "install", "--target", str(site_dir)).returncode == 0
    pth = site_dir / _autoapply.PTH_NAME
    assert pth.read_text() == _autoapply.pth_line()

    off = _python(str(script), str(site_dir))
    on = _python(str(script), str(site_dir), env={_autoapply.ENV_VAR: "1"})
    zero = _python(str(script), str(site_dir), env={_autoapply.ENV_VAR: "0"})
    assert "PATCHED True" in on.stdout and "RESULT ok" in on.stdout, on.stdout + on.stderr
    assert "PATCHED False" in off.stdout and "PATCHED False" in zero.stdout  # off by default; not imported
    expected_stock = "RESULT CheckpointError" if _compat.load().needs_cast_replay else "RESULT ok"
    assert expected_stock in off.stdout, off.stdout + off.stderr

    proc = _python("-m", "fsdp_autocast_fix", "autoapply", "uninstall", "--target", str(site_dir))
    assert proc.returncode == 0 and not pth.exists()


def test_pth_line_imports_nothing_without_the_variable(tmp_path) -> None:
    (tmp_path / _autoapply.PTH_NAME).write_text(_autoapply.pth_line())
    code = (f"import site, sys; site.addsitedir({str(tmp_path)!r}); "
            "print(sorted(m for m in sys.modules if m.startswith(('wrapt', 'torch', 'fsdp_autocast_fix'))))")
    assert _python("-c", code).stdout.strip() == "[]"


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
