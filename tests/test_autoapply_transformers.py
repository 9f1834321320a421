"""Auto-apply when Hugging Face transformers or accelerate is imported first (each in a fresh interpreter).

transformers 4.x imports ``torch._dynamo`` before FSDP, which is how the auto-apply used to crash the
training script at import. Runs in the nox sessions ``transformers(<torch>, <transformers>)``, which install
transformers and accelerate; the other sessions ignore this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_autoapply import site_dir, train  # noqa: F401 - site_dir is a fixture

from fsdp_autocast_fix import _autoapply

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

ORDERS = {
    "transformers_model": "from transformers import LlamaForCausalLM",
    "transformers_trainer": "from transformers import Trainer",
    "accelerate": "from accelerate import Accelerator",
}


@pytest.mark.parametrize("order", ORDERS)
def test_import_order_applies_before_the_first_fully_shard(site_dir: Path, order: str) -> None:  # noqa: F811
    report = train(site_dir, ORDERS[order], env={_autoapply.ENV_VAR: "1"})
    assert report == {"in_force_at_first_shard": True, "torch_checkpoint": "bitwise",
                      "custom_checkpoint": "bitwise", "patched_globally": True}
