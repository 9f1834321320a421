"""Worker for ``test_mesh_2d.py``: the seed's pattern on a 2-D (replicate x shard) mesh of 4 gloo ranks."""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint


def _grads(mesh: Any, mode: str) -> Any:
    import scenarios as S

    import fsdp_autocast_fix
    from fsdp_autocast_fix import _compat

    fsdp = _compat.fsdp_package()
    torch.manual_seed(0)
    model = S.GeluLinear()
    shard = fsdp_autocast_fix.patched_fully_shard if mode == "patched" else fsdp.fully_shard
    # reduce_dtype fp16: FSDP then divides explicitly and reduces with SUM; with fp32/bf16 gradients torch
    # <= 2.8 all-reduces across the replicate dimension with ReduceOp.AVG, which Gloo does not have.
    shard(model, mesh=mesh, mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.float16))
    x = torch.randn(4, S.DIM, generator=torch.Generator().manual_seed(dist.get_rank())).requires_grad_(True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x) if mode == "reference" else checkpoint(model, x, use_reentrant=False)
            out.float().sum().backward()
    except Exception as e:
        return f"{type(e).__name__}: {e} {traceback.format_exc()[-600:]}"
    return [x.grad.clone()] + [p.grad.full_tensor().clone() for p in model.parameters()]


def worker(rank: int, world: int, port: int, out_path: str) -> None:
    """One of 4 ranks: reference, stock and patched on a (2, 2) mesh; rank 0 saves the three results."""
    from ranks import spawned_group

    with spawned_group(rank, world, port):
        try:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            result: dict[str, Any] = {mode: _grads(mesh, mode) for mode in ("reference", "stock", "patched")}
            result["mesh_ndim"] = mesh.ndim
        except Exception:
            result = {"crash": traceback.format_exc()}
        if rank == 0:
            torch.save(result, out_path)
