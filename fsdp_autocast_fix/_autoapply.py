"""Auto-apply for training scripts that cannot be edited: a one-line ``.pth`` file and an environment variable.

``python -m fsdp_autocast_fix autoapply install`` writes ``fsdp_autocast_fix_autoapply.pth`` into site-packages.
At interpreter start it reads ``FSDP_AUTOCAST_FIX``; only when that is set (``1``, ``true``, ``yes``, ``on``)
does it import ``wrapt`` and register :func:`on_fsdp_import` as a post-import hook for ``torch.distributed.fsdp``.
Nothing else is imported at start, and nothing happens without the variable.

The hook runs inside whatever import brought FSDP in, which may be torch's own (``torch._dynamo`` imports FSDP
while half initialised) or this package's. So it applies the patch only when no such import is under way, and
otherwise leaves it pending until the first ``FSDPState.init`` (through :mod:`._init_hook`, so that state is
covered before ``fully_shard`` returns), :func:`fsdp_autocast_fix.status`, or the ``doctor``. It never raises:
where the patch cannot be applied, it logs one warning and training runs on stock torch.
"""

from __future__ import annotations

import logging
import os
import site
import sys
import sysconfig
import threading
from pathlib import Path
from typing import Any

from . import _init_hook

logger = logging.getLogger("fsdp_autocast_fix")

ENV_VAR = "FSDP_AUTOCAST_FIX"
PTH_NAME = "fsdp_autocast_fix_autoapply.pth"
#: Modules whose import triggers the auto-apply: the public FSDP package (all versions import it).
TRIGGERS = ("torch.distributed.fsdp",)
_HOOK = "fsdp_autocast_fix._autoapply:on_fsdp_import"

_lock = threading.Lock()
_pending = False
_HOLDER = "auto-apply"


def pth_line() -> str:
    """The ``.pth`` line: a no-op unless ``FSDP_AUTOCAST_FIX`` is set."""
    registrations = ", ".join(f"__import__('wrapt').register_post_import_hook({_HOOK!r}, {t!r})" for t in TRIGGERS)
    return (f"import os; os.environ.get({ENV_VAR!r}, '').strip().lower() in ('1', 'true', 'yes', 'on') "
            f"and ({registrations},)\n")


def on_fsdp_import(module: Any) -> None:
    """wrapt post-import hook: apply the patch now if that is safe, else as soon as it is. Never raises."""
    global _pending
    try:
        with _lock:
            _pending = True
        if not settle(importing=getattr(module, "__name__", None)):
            _wait_for_init()
    except Exception as e:  # pragma: no cover - a bug here must not break someone else's import
        logger.warning("fsdp_autocast_fix: auto-apply failed (%s: %s); training runs on stock torch",
                       type(e).__name__, e)


def settle(importing: str | None = None) -> bool:
    """Apply a pending auto-apply unless an import of torch or of this package is under way (``importing``, the
    hook's trigger, is finishing and ignored). False while the apply must wait, True once nothing is pending."""
    global _pending
    with _lock:
        if not _pending:
            return True
        if _imports_under_way(importing):
            return False
        _pending = False
    try:
        import fsdp_autocast_fix

        fsdp_autocast_fix.apply()
    except Exception as e:
        logger.warning("fsdp_autocast_fix: %s=%s is set, but the patch is not applied, training runs on stock "
                       "torch: %s", ENV_VAR, os.environ.get(ENV_VAR), e)
    else:
        logger.info("fsdp_autocast_fix applied automatically (%s=%s)", ENV_VAR, os.environ.get(ENV_VAR))
    finally:
        _init_hook.release(_HOLDER)  # after apply() took its own hold: the wrapper stays on
    return True


def cancel() -> bool:
    """Drop a pending auto-apply (for commands that must see stock torch); True if one was pending."""
    global _pending
    with _lock:
        was, _pending = _pending, False
    _init_hook.release(_HOLDER)
    return was


def _imports_under_way(ignore: str | None) -> list[str]:
    """Modules of torch or of this package whose import has started and not finished (except ``ignore``)."""
    return [name for name, module in list(sys.modules.items())
            if name != ignore and name.partition(".")[0] in ("torch", "fsdp_autocast_fix")
            and getattr(getattr(module, "__spec__", None), "_initializing", False)]


def _wait_for_init() -> None:
    """Settle the pending apply right after the first ``FSDPState.init`` (it then covers that state too)."""
    from . import _compat

    found = next((getattr(sys.modules[name], "FSDPState", None) for name in _compat._STATE_MODULES
                  if name in sys.modules), None)
    if not isinstance(found, type) or "init" not in vars(found):  # status() still settles it
        logger.debug("fsdp_autocast_fix: FSDPState.init not found; the auto-apply waits for status()")
        return
    with _lock:
        if _pending:
            _init_hook.hold(found, _HOLDER, lambda state: settle())


def _site_dirs() -> list[Path]:
    dirs = [*site.getsitepackages(), site.getusersitepackages(), sysconfig.get_paths()["purelib"]]
    return [Path(d).resolve() for d in dirs]


def pth_path(target: str | None = None) -> Path:
    """Where :func:`install` writes the ``.pth`` file: in ``target``, or this interpreter's site-packages."""
    return Path(target or sysconfig.get_paths()["purelib"]) / PTH_NAME


def install(target: str | None = None) -> Path:
    """Write the ``.pth`` file into ``target`` (default: this interpreter's site-packages); return its path.

    The folder is created if missing. Raises ``OSError`` (with the reason) if it cannot be created or written.
    """
    path = pth_path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(pth_line())
    return path


def is_site_dir(folder: Path) -> bool:
    """Whether Python reads ``.pth`` files in ``folder`` at start (this interpreter's site directories)."""
    return folder.resolve() in _site_dirs()


def uninstall(target: str | None = None) -> Path | None:
    """Remove the ``.pth`` file; return its path, or None if there was none."""
    path = pth_path(target)
    if not path.exists():
        return None
    path.unlink()
    return path
