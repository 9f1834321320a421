"""Nothing kept alive: the captured state holds no tensors, and nothing outlives backward or the model.

And nothing in the project names a path of the machines it was built on.
"""

from __future__ import annotations

import gc
import re
import subprocess
import weakref
from pathlib import Path

import pytest
import scenarios as S
import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from conftest import _strong_state_registry

import fsdp_autocast_fix
from fsdp_autocast_fix import _patch

pytestmark = pytest.mark.usefixtures("pg")
ROOT = Path(__file__).resolve().parent.parent


def _no_tensors(value: object) -> bool:
    if isinstance(value, torch.Tensor):
        return False
    if isinstance(value, (tuple, list)):
        return all(_no_tensors(v) for v in value)
    return value is None or isinstance(value, (bool, int, str, torch.dtype))


def _patched_layer() -> torch.nn.Module:
    fully_shard, policy_cls = S._fsdp()
    fsdp_autocast_fix.apply()
    layer = S.GeluLinear()
    fully_shard(layer, mp_policy=policy_cls(param_dtype=S.BF16, output_dtype=torch.float32))
    return layer


def test_records_hold_no_tensors() -> None:
    """What a forward call leaves: a weak reference to its input and a few scalars, gone with the input."""
    layer = _patched_layer()
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    cover = _patch._covers[id(fsdp_autocast_fix._compat.load().state_of(layer))]
    (module_cover,) = cover.modules
    (record,) = module_cover.log.by_key.values()
    (ref,), (version,), calls = record
    assert isinstance(ref, weakref.ref) and ref() is x
    assert isinstance(version, int) and calls and _no_tensors(calls)
    assert module_cover.replayer.replays == []
    del x
    gc.collect()
    assert len(module_cover.log) == 0  # the record died with its input
    module_cover.log.sweep()
    assert not module_cover.log.by_key and not module_cover.log.index.indexed and not module_cover.log.index.by_memory


def test_no_activation_or_input_alive_after_backward() -> None:
    layer = _patched_layer()
    x = torch.randn(4, S.DIM, requires_grad=True)
    seen: list[weakref.ref[torch.Tensor]] = []
    layer.register_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))  # forward and recompute outputs
    with torch.autocast("cpu", dtype=S.BF16), set_checkpoint_early_stop(False):
        out = checkpoint(layer, x, use_reentrant=False)
        out.sum().backward()
    refs = [weakref.ref(x), weakref.ref(out)] + seen
    assert len(seen) == 2
    del x, out
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_model_is_freed_and_uncovered_after_del() -> None:
    before = fsdp_autocast_fix.status().covered_modules
    layer = _patched_layer()
    x = torch.randn(4, S.DIM, requires_grad=True)
    with torch.autocast("cpu", dtype=S.BF16):
        checkpoint(layer, x, use_reentrant=False).sum().backward()
    ref = weakref.ref(layer)
    assert fsdp_autocast_fix.status().covered_modules == before + 1
    registry = _strong_state_registry()
    if registry is not None:  # torch 2.4-2.5 itself keeps every sharded module (2.6+ lets it go): drop its hold
        registry.pop(layer)
    del layer
    gc.collect()
    assert ref() is None
    assert fsdp_autocast_fix.status().covered_modules == before


#: An absolute path of a build machine: its work and tool folders, the temporary folder, home directories.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|opt|tmp|root|home|Users)/")
#: Generated results (they may record where they were measured), and what building or testing leaves behind.
SKIPPED_DIRS = ("benchmarks/results/", "matrix/", ".git/", ".nox/", ".venv/", ".matrix/", "build/", "dist/")


def project_files(root: Path = ROOT) -> list[str]:
    """The files the project consists of: tracked by git, or, outside a checkout (an unpacked sdist), all."""
    if (root / ".git").exists():
        listed = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True)
        paths = listed.stdout.splitlines()
    else:
        paths = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    return sorted(p for p in paths if not p.startswith(SKIPPED_DIRS) and "__pycache__/" not in p
                  and ".egg-info/" not in p)


def machine_paths(root: Path = ROOT) -> list[str]:
    """``path:line: text`` for each line of a project file that names a build machine's absolute path."""
    found = []
    for path in project_files(root):
        try:
            text = (root / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError):  # binary (a chart), or deleted but not yet committed
            continue
        found += [f"{path}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1)
                  if MACHINE_PATH.search(line)]
    return found


def test_no_project_file_names_a_build_machine_path() -> None:
    assert machine_paths() == []


def test_the_path_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    folders = ("work", "opt", "tmp", "root", "home", "Users")  # spelled apart so that this file passes itself
    (tmp_path / "README.md").write_text("see\n" + "".join(f"/{d}/x\n" for d in folders))
    (tmp_path / "notes.py").write_text(f'ok = "a/{folders[0]}/b, ~/{folders[2]}/c and /usr/bin/env"\n')  # relative
    (tmp_path / "matrix").mkdir()
    (tmp_path / "matrix" / "results.json").write_text(f'{{"where": "/{folders[0]}/x"}}')  # generated: not checked
    assert machine_paths(tmp_path) == [f"README.md:{n}: /{d}/x" for n, d in enumerate(folders, 2)]
