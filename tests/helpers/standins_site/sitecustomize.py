"""Test-only: the CPU stand-ins of tests/helpers/cpu_standins.py in every interpreter the tests start.

tests/conftest.py puts this folder on ``PYTHONPATH`` and sets ``FSDP_AUTOCAST_FIX_TEST_CPU_STANDINS=1`` on torch
2.4-2.6 without CUDA; Python imports this module at start, and it installs the stand-ins once FSDP is imported
(a wrapt post-import hook), so torchrun's ranks, spawned ranks and fresh interpreters run FSDP2 as the test
process does. Without the variable it does nothing.
"""

import os
import sys

if os.environ.get("FSDP_AUTOCAST_FIX_TEST_CPU_STANDINS") == "1":
    import wrapt

    def _install(_module: object) -> None:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        import cpu_standins

        if cpu_standins.needed():
            cpu_standins.install()

    for _name in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
        wrapt.register_post_import_hook(_install, _name)
