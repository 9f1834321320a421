"""Every private torch name the patch reads goes through ``_compat.load()``: generated from ``_compat``'s own
lists, each name is removed in turn (in one fresh interpreter, the package imported anew after each removal).
Without a required name the package still imports, ``status()`` says why it is unsupported, ``apply()`` raises
``UnsupportedTorchError`` naming it and changes nothing, the auto-apply logs one warning and leaves the run
unpatched, and ``doctor`` exits non-zero with that sentence."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from fsdp_autocast_fix import _compat

_CHILD = r'''
import importlib, json, logging, sys, types
import torch
import torch.distributed.fsdp

results = []
for module, path, label in json.loads(sys.argv[1]):
    owner = importlib.import_module(module)
    *parents, leaf = path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    saved = getattr(owner, leaf)
    delattr(owner, leaf)
    for name in [m for m in sys.modules if m.partition(".")[0] == "fsdp_autocast_fix"]:
        del sys.modules[name]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("fsdp_autocast_fix").addHandler(handler)
    row = {"name": label}
    try:
        import fsdp_autocast_fix
        from fsdp_autocast_fix import __main__ as cli, _autoapply
        row["unsupported"] = fsdp_autocast_fix.status().unsupported
        try:
            fsdp_autocast_fix.apply()
            row["applied"] = True
            fsdp_autocast_fix.remove()
        except fsdp_autocast_fix.UnsupportedTorchError as e:
            row["applied"], row["error"] = False, str(e)
            row["patched_after"] = fsdp_autocast_fix.status().patched_globally
            records.clear()
            _autoapply.on_fsdp_import(types.SimpleNamespace(__name__="torch.distributed.fsdp"))
            row["autoapply_warnings"] = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
            row["patched_after_autoapply"] = fsdp_autocast_fix.status().patched_globally
            doctor = cli.doctor()
            row["doctor"] = [doctor["exit_code"], doctor["advice"]]
    except Exception as e:
        row["crash"] = repr(e)
    finally:
        logging.getLogger("fsdp_autocast_fix").removeHandler(handler)
        setattr(owner, leaf, saved)
    results.append(row)
print(json.dumps(results))
'''


def _names() -> list[tuple[str, str, str]]:
    """``(module, path, label)`` of each name, FSDP's state module as this torch has it."""
    state_module = _compat.resolve(_compat.STATE, "FSDPState").__module__
    return [(state_module if module == _compat.STATE else module, path, _compat.label(module, path))
            for module, path in _compat.PRIVATE_NAMES]


def test_each_private_name_removed_in_turn() -> None:
    names = _names()
    env = {k: v for k, v in os.environ.items() if k != "FSDP_AUTOCAST_FIX"}
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHILD, json.dumps(names)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [row["name"] for row in rows] == [name[2] for name in names]
    for row in rows:
        name = row["name"]
        assert "crash" not in row, row
        assert name in row["unsupported"] and not row["applied"] and name in row["error"], row
        assert row["patched_after"] is False and row["patched_after_autoapply"] is False, row
        assert len(row["autoapply_warnings"]) == 1 and name in row["autoapply_warnings"][0], row
        assert row["doctor"][0] != 0 and name in row["doctor"][1], row
