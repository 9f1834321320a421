"""Hugging Face transformers: a tiny Llama (random weights, nothing downloaded), per-decoder-layer
``fully_shard`` and one on the root, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32,
output_dtype=fp32)``, ``gradient_checkpointing_enable(use_reentrant=False)``, three AdamW steps under CPU
autocast: the losses must be bitwise those of the run without checkpointing.

Runs in the nox sessions ``transformers(<torch>, <transformers>)``; the other sessions do not install
transformers and ignore this file.
"""

from __future__ import annotations

import pytest
import torch

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("pg")
MAJOR = int(transformers.__version__.split(".")[0])


def _losses(mode: str, steps: int = 3) -> list[float] | BaseException:
    fsdp = _compat.fsdp_package()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    if mode != "reference":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    shard = fsdp_autocast_fix.patched_fully_shard if mode == "patched" else fsdp.fully_shard
    policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)
    for layer in model.model.layers:
        shard(layer, mp_policy=policy)
    shard(model, mp_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(steps):
            ids = torch.randint(0, 64, (2, 16), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):  # no KV cache: checkpointing turns it off anyway
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    except Exception as e:
        return e
    return losses


def test_tiny_llama_training_is_bitwise_equal() -> None:
    reference = _losses("reference")
    assert isinstance(reference, list) and len(reference) == 3, reference
    patched = _losses("patched")
    assert patched == reference, patched


def test_tiny_llama_positive_control() -> None:
    """transformers 4.x checkpoints each decoder layer's ``__call__`` (FSDP's hooks inside the checkpoint: the
    bug); 5.x checkpoints inside the layer's call, after FSDP's pre-forward cast (fine stock)."""
    reference = _losses("reference")
    stock = _losses("stock")
    if _compat.load().needs_cast_replay and MAJOR < 5:
        assert stock != reference, "stock should fail with transformers 4.x on this torch"
    else:
        assert stock == reference, stock


def test_hf_training_example() -> None:
    from test_examples import run_example

    proc = run_example("hf_training.py")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("step 2 loss") == 2 and "patched_globally=True" in proc.stdout
