"""Auto-apply (``FSDP_AUTOCAST_FIX=1`` and the ``.pth``) under every import order, each in a fresh interpreter.

The ``.pth`` is installed into a temporary site directory by the CLI and read with ``site.addsitedir``, as
Python reads site-packages at start. Whatever is imported first, the patch must be in force right after the
first ``fully_shard`` call, the checkpointed steps must be bitwise those without checkpointing, and nothing
may raise or print a traceback. The transformers and accelerate orders are in test_autoapply_transformers.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import free_port

from fsdp_autocast_fix import _autoapply, _compat, _probe
from fsdp_autocast_fix.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "scripts" / "unaware_training.py"

#: The first statement of the training script, by name.
ORDERS = {
    "fsdp": "import torch.distributed.fsdp",
    # torch._dynamo's own imports bring FSDP in while dynamo is half initialised.
    "dynamo": "import torch._dynamo",
    "compile": "import torch; torch.compile(torch.nn.Linear(2, 2))",
    # Importing this package imports FSDP while the package itself is half initialised.
    "fsdp_autocast_fix": "import fsdp_autocast_fix",
}


def run_python(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter (this one's), this checkout importable, auto-apply off unless ``env`` sets it."""
    full_env = {k: v for k, v in os.environ.items() if k != _autoapply.ENV_VAR}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), full_env.get("PYTHONPATH", "")])
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=600,
                          cwd=ROOT)


def train(site_dir: Path, first: str, env: dict[str, str] | None = None) -> dict[str, object]:
    """Run tests/scripts/unaware_training.py; its JSON report. Fails on a non-zero exit or a traceback."""
    proc = run_python(str(SCRIPT), str(site_dir), first, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary site directory holding the ``.pth``, written by the CLI (the folder does not exist yet)."""
    folder = tmp_path_factory.mktemp("autoapply") / "site-packages"
    assert main(["autoapply", "install", "--target", str(folder)]) == 0
    assert (folder / _autoapply.PTH_NAME).read_text() == _autoapply.pth_line()
    return folder


@pytest.mark.parametrize("order", ORDERS)
def test_every_import_order_applies_before_the_first_fully_shard(site_dir: Path, order: str) -> None:
    report = train(site_dir, ORDERS[order], env={_autoapply.ENV_VAR: "1"})
    assert report == {"in_force_at_first_shard": True, "torch_checkpoint": "bitwise",
                      "custom_checkpoint": "bitwise", "patched_globally": True}


def test_the_exit_report_under_the_auto_apply(site_dir: Path) -> None:
    """``FSDP_AUTOCAST_FIX_REPORT=1`` beside ``FSDP_AUTOCAST_FIX=1``: the script, which knows nothing of the
    patch, prints at exit what the patch did (the custom checkpoint's recomputes, replayed)."""
    proc = run_python(str(SCRIPT), str(site_dir), ORDERS["fsdp"],
                      env={_autoapply.ENV_VAR: "1", "FSDP_AUTOCAST_FIX_REPORT": "1"})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    report = proc.stderr[proc.stderr.index("fsdp_autocast_fix report:"):].splitlines()
    assert report[-1].startswith("the patch fixed this run: it replayed "), report
    assert "autocast states" in report[-1]


def test_without_the_variable_nothing_is_imported_or_patched(site_dir: Path) -> None:
    """The positive control: the same step is wrong on stock torch (every torch, for this checkpoint)."""
    report = train(site_dir, ORDERS["fsdp"], env={_autoapply.ENV_VAR: "0"})
    assert report["in_force_at_first_shard"] is None and report["patched_globally"] is None
    assert report["custom_checkpoint"] == "differs"
    assert report["torch_checkpoint"] == ("fails: CheckpointError" if _compat.load().needs_cast_replay else "bitwise")


def test_unsupported_torch_logs_one_line_at_the_first_fully_shard(site_dir: Path) -> None:
    """An internal the patch needs is missing: no traceback, one warning when FSDP state is first made."""
    code = textwrap.dedent(f"""
        import site, sys
        site.addsitedir({str(site_dir)!r})
        import torch
        torch.autograd.Variable._execution_engine = object()  # the patch checks for its queue_callback
        import torch._dynamo  # the auto-apply waits for dynamo's import to finish
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch 2.4-2.5
            from torch.distributed._composable.fsdp import fully_shard
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        print("SHARDING", file=sys.stderr, flush=True)
        fully_shard(torch.nn.Linear(4, 4))
        import fsdp_autocast_fix
        s = fsdp_autocast_fix.status()
        print(s.patched_globally, s.unsupported is not None)
        dist.destroy_process_group()
    """)
    proc = run_python("-W", "ignore", "-c", code, env={_autoapply.ENV_VAR: "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["False", "True"]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    # On torch 2.4 the FSDP package's import ends after dynamo's, so the apply (and its warning) comes at once.
    assert len(lines) == 2 and ("SHARDING" in lines), proc.stderr
    lines.remove("SHARDING")
    lines.insert(0, "SHARDING")
    assert lines[1].startswith("fsdp_autocast_fix: FSDP_AUTOCAST_FIX=1 is set, but the patch is not applied")
    assert "does not recognise torch" in lines[1] and "queue_callback" in lines[1]


def test_doctor_runs_and_reports_the_patch_active_under_the_variable(site_dir: Path) -> None:
    """``python -m fsdp_autocast_fix doctor`` imports this package before FSDP: the circular case."""
    code = (f"import runpy, site, sys; site.addsitedir({str(site_dir)!r}); "
            "sys.argv = ['fsdp_autocast_fix', 'doctor', '--json']; "
            "runpy.run_module('fsdp_autocast_fix', run_name='__main__', alter_sys=True)")
    proc = run_python("-c", code, env={_autoapply.ENV_VAR: "1"})
    assert proc.stderr == "", proc.stderr  # no traceback, and nothing of torch's NumPy warning
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["patch_active_in_this_process"] is True
    if _probe.can_probe() is None:
        assert all(row["patched"] == "ok" for row in report["probe"])
    else:  # torch 2.4-2.6 without CUDA: no live probe; judged by the code check
        assert report["probe"] is None and report["probe_skipped"] == _probe.can_probe()
    assert report["exit_code"] == proc.returncode == 0


def test_install_creates_the_folder_or_says_why_not(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "new" / "site-packages"
    assert main(["autoapply", "install", "--target", str(target)]) == 0
    assert (target / _autoapply.PTH_NAME).read_text() == _autoapply.pth_line()
    out = capsys.readouterr().out
    assert "not one of this interpreter's site directories" in out  # Python would not read it at start
    assert main(["autoapply", "uninstall", "--target", str(target)]) == 0
    assert not (target / _autoapply.PTH_NAME).exists()
    assert main(["autoapply", "uninstall", "--target", str(target)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "nothing to remove"

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["autoapply", "install", "--target", str(blocker / "site-packages")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"fsdp-autocast-fix: cannot write {blocker / 'site-packages' / _autoapply.PTH_NAME}: ")
    assert "Traceback" not in err

