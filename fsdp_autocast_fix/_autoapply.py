"""Auto-apply for training scripts that cannot be edited: a one-line ``.pth`` file and an environment variable.

``python -m fsdp_autocast_fix autoapply install`` writes ``fsdp_autocast_fix_autoapply.pth`` into
site-packages. At interpreter start it reads ``FSDP_AUTOCAST_FIX``; only when that is set (``1``, ``true``,
``yes``, ``on``) does it import ``wrapt`` and register a post-import hook that calls
:func:`fsdp_autocast_fix.apply` once ``torch.distributed.fsdp`` is imported. Nothing else is imported
at start, and nothing happens without the variable.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path
from typing import Any

logger = logging.getLogger("fsdp_autocast_fix")

ENV_VAR = "FSDP_AUTOCAST_FIX"
PTH_NAME = "fsdp_autocast_fix_autoapply.pth"
#: Modules whose import triggers apply(): the public FSDP package (all versions import it).
TRIGGERS = ("torch.distributed.fsdp",)
_HOOK = "fsdp_autocast_fix._autoapply:on_fsdp_import"


def pth_line() -> str:
    """The ``.pth`` line: a no-op unless ``FSDP_AUTOCAST_FIX`` is set."""
    registrations = ", ".join(f"__import__('wrapt').register_post_import_hook({_HOOK!r}, {t!r})" for t in TRIGGERS)
    return (f"import os; os.environ.get({ENV_VAR!r}, '').strip().lower() in ('1', 'true', 'yes', 'on') "
            f"and ({registrations},)\n")


def on_fsdp_import(module: Any) -> None:
    """wrapt post-import hook: apply the patch process-wide (raises if this torch is unsupported)."""
    import fsdp_autocast_fix

    fsdp_autocast_fix.apply()
    logger.info("fsdp_autocast_fix applied automatically (%s=%s)", ENV_VAR, os.environ.get(ENV_VAR))


def install(target: str | None = None) -> Path:
    """Write the ``.pth`` file into ``target`` (default: this interpreter's site-packages); return its path."""
    path = Path(target or sysconfig.get_paths()["purelib"]) / PTH_NAME
    path.write_text(pth_line())
    return path


def uninstall(target: str | None = None) -> Path | None:
    """Remove the ``.pth`` file; return its path, or None if there was none."""
    path = Path(target or sysconfig.get_paths()["purelib"]) / PTH_NAME
    if not path.exists():
        return None
    path.unlink()
    return path
