"""Command line: ``python -m fsdp_autocast_fix {doctor,autoapply}`` (also ``fsdp-autocast-fix``).

Each command documents its exit codes in its ``--help``; README lists them too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

from ._autoapply import ENV_VAR

FIX = ("call fsdp_autocast_fix.apply() before training (or shard with patched_fully_shard); without editing "
       "the script: `fsdp-autocast-fix autoapply install`, then run it with FSDP_AUTOCAST_FIX=1")


def _probe_in_subprocess() -> tuple[list[dict[str, str]] | None, str | None]:
    """Run the probe in a fresh interpreter with auto-apply off, so that it sees stock torch. Returns (results,
    None), or (None, the last line of stderr) where it failed."""
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "fsdp_autocast_fix", "probe"],
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        return None, (proc.stderr.strip().splitlines() or ["probe failed"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def doctor() -> dict[str, Any]:
    """Everything ``doctor`` reports, with ``exit_code`` and one line of ``advice``."""
    from . import _probe, status

    s = status()
    report: dict[str, Any] = {"torch": s.torch_version, "needs_cast_replay": s.needs_cast_replay,
                              "needs_param_gather": s.needs_param_gather,
                              "unsupported": s.unsupported, "patch_active_in_this_process": s.patched_globally,
                              "covered_modules": s.covered_modules, "probe": None, "probe_skipped": None}
    if s.unsupported:
        report.update(exit_code=2, advice=f"this torch is not supported: {s.unsupported}")
        return report
    report["probe_skipped"] = _probe.can_probe()
    if report["probe_skipped"] is None:
        report["probe"], report["probe_error"] = _probe_in_subprocess()
    probe = report["probe"]
    if probe is None:  # judge by the code check alone
        needed = ["FSDP's casts in the recompute (code check; no live probe)"] if s.needs_cast_replay else []
        if s.needs_param_gather:
            needed.append("the gather of resharded parameters in the recompute (code check; no live probe)")
        unfixed: list[str] = []
    else:
        needed = [r["pattern"] for r in probe if r["stock"] != "ok"]
        unfixed = [r["pattern"] for r in probe if r["patched"] != "ok"]
    if unfixed:
        report.update(exit_code=2, advice=f"the patch does not fix {unfixed} on this torch: please report it")
    elif not needed:
        report.update(exit_code=0, advice="nothing to do: this torch recomputes these patterns exactly")
    elif s.patched_globally:
        report.update(exit_code=0, advice="the patch is active in this process and covers every pattern")
    else:
        report.update(exit_code=1, advice=f"{FIX} (needed for: {'; '.join(needed)})")
    return report


def _print_doctor(report: dict[str, Any]) -> None:
    from . import _probe

    print(f"torch {report['torch']}; skips FSDP's casts in the recompute: {report['needs_cast_replay']}; leaves "
          f"resharded parameters sharded in the recompute: {report['needs_param_gather']}")
    print(f"patch active in this process: {report['patch_active_in_this_process']} "
          f"({report['covered_modules']} sharded modules covered)")
    if report["probe"] is not None:
        print(_probe.table(report["probe"]))
    else:
        print(f"live probe not run: {report['probe_skipped'] or report.get('probe_error')}")
    print(report["advice"])
    print(REPORT_HINT)


#: The doctor speaks for its own probe; the report tells what the patch did in the user's own run.
REPORT_HINT = ("for your own run: FSDP_AUTOCAST_FIX_REPORT=1 prints at exit what the patch changed there "
               "(fsdp_autocast_fix.report()); if it changed nothing on the torch you upgrade to, you may unpin it")

DESCRIPTION = ("Make a checkpointed fully_shard (FSDP2) module recompute exactly what its forward computed "
               "(pytorch issue 148831). Run a command with --help for what it does and its exit codes.")
EPILOG = "exit codes: those of the command; 2 also for a bad command line"
DOCTOR_HELP = ("does this torch need the patch, and is it active in this process? A live probe runs the seed "
               "report's patterns stock and patched side by side in a subprocess (world size 1: gloo on CPU, NCCL "
               "with CUDA); one line of advice")
DOCTOR_EXIT = ("exit codes: 0 nothing to do, or the patch is active and fixes every pattern; 1 the patch is "
               "needed and not active (the advice says how); 2 this torch is not supported, or the patch does "
               "not fix a pattern")
AUTOAPPLY_HELP = (f"install or remove a .pth file that applies the patch in every process of this Python that "
                  f"runs with {ENV_VAR}=1, without editing the training script")
AUTOAPPLY_EXIT = "exit codes: 0 done (also when there was nothing to remove); 1 the folder cannot be written"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-autocast-fix", description=DESCRIPTION, epilog=EPILOG)
    # metavar lists the public commands; "probe" (doctor's subprocess) has no help, so it is not listed.
    sub = parser.add_subparsers(dest="command", required=True, metavar="{doctor,autoapply}")
    doc = sub.add_parser("doctor", help=DOCTOR_HELP, description=DOCTOR_HELP, epilog=DOCTOR_EXIT)
    doc.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_parser("probe", description="the doctor's live probe as JSON (run by the doctor in a subprocess)")
    auto = sub.add_parser("autoapply", help=AUTOAPPLY_HELP, description=AUTOAPPLY_HELP, epilog=AUTOAPPLY_EXIT)
    auto.add_argument("action", choices=["install", "uninstall"], help="write the .pth file, or remove it")
    auto.add_argument("--target", help="the folder for the .pth file, created if missing (default: this "
                                       "interpreter's site-packages)")
    return parser


def _autoapply_command(action: str, target: str | None) -> int:
    from . import _autoapply

    if action == "uninstall":
        path = _autoapply.uninstall(target)
        print(f"removed {path}" if path else "nothing to remove")
        return 0
    try:
        path = _autoapply.install(target)
    except OSError as e:
        print(f"fsdp-autocast-fix: cannot write {_autoapply.pth_path(target)}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {path}; set {ENV_VAR}=1 to apply the patch in processes that use FSDP")
    if not _autoapply.is_site_dir(path.parent):
        print(f"note: {path.parent} is not one of this interpreter's site directories, so Python reads the "
              "file there only if that folder is added with site.addsitedir")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command; return its exit code."""
    args = _parser().parse_args(argv)
    if args.command == "autoapply":
        return _autoapply_command(args.action, args.target)
    if args.command == "doctor":
        report = doctor()
        if args.json:
            print(json.dumps(report))
        else:
            _print_doctor(report)
        return int(report["exit_code"])

    from . import _autoapply, _probe, remove, status

    if _autoapply.cancel() or status().patched_globally:  # "stock" must mean stock torch
        remove()
    reason = _probe.can_probe()
    if reason is not None:
        print(f"cannot run the probe here: {reason}", file=sys.stderr)
        return 1
    print(json.dumps(_probe.run()))  # the "probe" command: the doctor's subprocess
    return 0


if __name__ == "__main__":
    sys.exit(main())
