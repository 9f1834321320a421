"""Command line: ``python -m fsdp_autocast_fix {demo,doctor,autoapply}`` (also ``fsdp-autocast-fix``)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

FIX = ("call fsdp_autocast_fix.apply() before training (or shard with patched_fully_shard); without editing "
       "the script: `fsdp-autocast-fix autoapply install`, then run it with FSDP_AUTOCAST_FIX=1")


def _probe_in_subprocess() -> tuple[list[dict[str, str]] | None, str | None]:
    """The probe in a fresh interpreter (auto-apply off), so that it sees what stock torch does."""
    from ._autoapply import ENV_VAR

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

    print(f"torch {report['torch']}; skips FSDP's casts in the recompute: {report['needs_cast_replay']}")
    print(f"patch active in this process: {report['patch_active_in_this_process']} "
          f"({report['covered_modules']} sharded modules covered)")
    if report["probe"] is not None:
        print(_probe.table(report["probe"]))
    else:
        print(f"live probe not run: {report['probe_skipped'] or report.get('probe_error')}")
    print(report["advice"])


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen command."""
    parser = argparse.ArgumentParser(prog="fsdp-autocast-fix", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the seed report's patterns, stock and patched, side by side (CPU or CUDA)")
    doc = sub.add_parser("doctor", help="does this torch need the patch, and is it active? (exit 0: all good)")
    doc.add_argument("--json", action="store_true", help="print one JSON object")
    sub.add_parser("probe", help=argparse.SUPPRESS)
    auto = sub.add_parser("autoapply", help="install or remove the .pth that applies the patch when "
                                            "FSDP_AUTOCAST_FIX=1 is set")
    auto.add_argument("action", choices=["install", "uninstall"])
    auto.add_argument("--target", help="the site-packages folder (default: this interpreter's)")
    args = parser.parse_args(argv)

    if args.command == "autoapply":
        from . import _autoapply

        if args.action == "install":
            print(f"wrote {_autoapply.install(args.target)}; set {_autoapply.ENV_VAR}=1 to apply the patch "
                  "when torch.distributed.fsdp is imported")
        else:
            path = _autoapply.uninstall(args.target)
            print(f"removed {path}" if path else "nothing to remove")
        return 0
    if args.command == "doctor":
        report = doctor()
        if args.json:
            print(json.dumps(report))
        else:
            _print_doctor(report)
        return int(report["exit_code"])

    from . import _probe

    reason = _probe.can_probe()
    if reason is not None:
        print(f"cannot run the probe here: {reason}", file=sys.stderr)
        return 1
    results = _probe.run()
    if args.command == "probe":
        print(json.dumps(results))
        return 0
    import torch

    print(f"torch {torch.__version__}")
    print(_probe.table(results))
    return 0 if all(r["patched"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
