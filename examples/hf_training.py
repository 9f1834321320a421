"""A Hugging Face training loop on FSDP2 with gradient checkpointing (transformers 4.x), fixed.

    pip install 'fsdp-autocast-fix[transformers]'
    torchrun --nproc-per-node 2 examples/hf_training.py

A tiny Llama built from a config (random weights, nothing downloaded), ``fully_shard`` on every decoder
layer and the root, autocast bf16. transformers 4.x checkpoints each decoder layer's ``__call__``, which
on torch <= 2.12 loses FSDP's casts in the recompute; ``fsdp_autocast_fix.apply()`` restores them.
"""

import os

import torch
import torch.distributed as dist
import transformers
try:  # torch 2.6+
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.4-2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_autocast_fix


def main() -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    fsdp_autocast_fix.apply()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    model.train()
    for step in range(3):
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        print(f"[rank {dist.get_rank()}] step {step} loss {loss.item():.4f}")
    print(f"[rank {dist.get_rank()}] {fsdp_autocast_fix.status()}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
