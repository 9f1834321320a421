"""Training-step benchmark: what the patch costs against the usual workarounds and the upstream fix.

A transformer-like stack on spawned gloo ranks (CPU), autocast bf16 and
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, every layer and the root sharded.
Each variant runs in its own processes, so peak RSS is per variant:

* ``a``: ``patched_fully_shard``, non-reentrant ``checkpoint`` per layer;
* ``b``: stock, ``checkpoint(..., use_reentrant=True)`` per layer (the common workaround);
* ``c``: stock, ``checkpoint_wrapper`` applied before ``fully_shard`` (the torchtitan / NeMo workaround);
* ``d``: stock, no checkpointing (the reference for losses);
* ``e``: stock, non-reentrant ``checkpoint`` per layer: the upstream fix on torch >= 2.13. Before 2.13 it
  is only right while no checkpointed layer's input needs FSDP's cast (true of this stack, whose layer
  inputs are already bf16), so the fair comparison is (a) on 2.12.1 against (e) on 2.13.0
  (``compare_envs.py``).

JSON keys, one object per variant: ``variant``, ``torch``, ``ok``, ``error``, ``step_ms_median``,
``step_ms_all``, ``peak_rss_mib`` (rank 0's peak RSS during the measured steps, ``VmHWM`` reset after
warm-up), ``peak_rss_increase_mib`` (that peak minus the RSS before the steps: independent of the torch
build's library size), ``cuda_max_allocated_mib`` (None on CPU), ``all_gathers_per_step``,
``reduce_scatters_per_step``, ``losses`` (hex of each fp32 loss), ``losses_equal_to_d``, ``params_sha256``
(of the final parameters).

    python benchmarks/step.py [--variants abcde] [--steps 10] [--json out.json] [--smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = "abcde"


class Layer(nn.Module):
    """Pre-norm attention and MLP, as in a small transformer."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attn)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Stack(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, variant: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(layers))
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.variant in "ae":
                x = checkpoint(layer, x, use_reentrant=False)
            elif self.variant == "b":
                x = checkpoint(layer, x, use_reentrant=True)
            else:  # c: checkpoint inside the sharded layer; d: none
                x = layer(x)
        return x


def _count_collectives() -> dict[str, int]:
    """Count FSDP's all-gathers and reduce-scatters by wrapping every name torch has used for them.

    torch <= 2.12 calls ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, 2.13+ the ``*_single``
    forms; only the outermost call is counted, in case one form calls another.
    """
    counts = {"all_gather": 0, "reduce_scatter": 0}
    depth = threading.local()
    names = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter"}
    for name, key in names.items():
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counted(*args: Any, _original: Any = original, _key: str = key, **kwargs: Any) -> Any:
            level = getattr(depth, "level", 0)
            counts[_key] += level == 0
            depth.level = level + 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth.level = level

        setattr(dist, name, counted)
    return counts


def _memory_mib(key: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process from /proc, in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux ``clear_refs`` 5), so the peak is the measured steps'."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(rank: int, world: int, port: int, cfg: dict[str, Any], out_path: str) -> None:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests", "helpers"))
    from ranks import tear_down  # the group torn down in step (gloo's shutdown races otherwise)

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result: dict[str, Any] = {"variant": cfg["variant"], "torch": torch.__version__, "step_ms_median": None,
                              "step_ms_all": [], "peak_rss_mib": None, "peak_rss_increase_mib": None,
                              "cuda_max_allocated_mib": None, "all_gathers_per_step": None,
                              "reduce_scatters_per_step": None, "losses": []}
    _measure(rank, cfg, result)  # what holds the group is freed on its return
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    tear_down(clean=bool(result.get("ok")))


def _measure(rank: int, cfg: dict[str, Any], result: dict[str, Any]) -> None:
    """This rank's steps of ``cfg``'s variant, into ``result`` (``ok`` False and the error where one raised)."""
    try:
        import fsdp_autocast_fix
        from fsdp_autocast_fix import _compat

        fsdp = _compat.fsdp_package()
        counts = _count_collectives()
        variant = cfg["variant"]
        torch.manual_seed(0)
        model = Stack(cfg["layers"], cfg["hidden"], cfg["heads"], variant)
        if variant == "c":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            model.layers = nn.ModuleList(checkpoint_wrapper(layer) for layer in model.layers)
        shard = fsdp_autocast_fix.patched_fully_shard if variant == "a" else fsdp.fully_shard
        policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # output_fp32: each layer returns fp32, so each checkpointed layer's input needs FSDP's cast
        layer_policy = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                 output_dtype=torch.float32) if cfg.get("output_fp32") else policy
        for layer in model.layers:
            shard(layer, mp_policy=layer_policy)
        shard(model, mp_policy=policy)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(1 + rank)
        times, losses = [], []
        baseline_rss = 0.0
        for step in range(cfg["warmup"] + cfg["steps"]):
            if step == cfg["warmup"]:
                _reset_peak_rss()
                baseline_rss = _memory_mib("VmRSS")
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()
            # requires_grad: the reentrant checkpoint (b) needs an input that requires grad; same for all.
            x = torch.randn(cfg["batch"], cfg["seq"], cfg["hidden"], generator=gen).requires_grad_(True)
            dist.barrier()
            before = dict(counts)
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            dist.barrier()
            elapsed = time.perf_counter() - start
            losses.append(loss.item())
            if step >= cfg["warmup"]:
                times.append(elapsed * 1e3)
                per_step = {k: counts[k] - before[k] for k in counts}
        result.update(peak_rss_mib=_memory_mib("VmHWM"), peak_rss_increase_mib=_memory_mib("VmHWM") - baseline_rss,
                      cuda_max_allocated_mib=(torch.cuda.max_memory_allocated() / 2**20
                                              if torch.cuda.is_available() else None))
        digest = hashlib.sha256()
        for _, param in sorted(model.named_parameters()):
            digest.update(bytes(param.full_tensor().detach().clone().untyped_storage()))
        result["params_sha256"] = digest.hexdigest()
        result.update(ok=True, error=None, step_ms_median=statistics.median(times), step_ms_all=times,
                      all_gathers_per_step=per_step["all_gather"], reduce_scatters_per_step=per_step["reduce_scatter"],
                      losses=[float(v).hex() for v in losses])
    except Exception as e:
        result.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                      traceback=traceback.format_exc())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_variant(variant: str, cfg: dict[str, Any], world: int = 2) -> dict[str, Any]:
    """Run one variant on ``world`` spawned ranks; return rank 0's result object."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, _free_port(), dict(cfg, variant=variant), out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def config(smoke: bool, steps: int) -> dict[str, Any]:
    """Sizes: the issue's (8 layers, hidden 256, sequence 128), or tiny ones for the CI smoke run."""
    if smoke:
        return {"layers": 2, "hidden": 32, "heads": 2, "seq": 8, "batch": 2, "warmup": 1, "steps": 2}
    return {"layers": 8, "hidden": 256, "heads": 4, "seq": 128, "batch": 2, "warmup": 3, "steps": steps}


def markdown(results: list[dict[str, Any]]) -> str:
    """A markdown table of the result objects."""
    rows = ["| variant | torch | step ms (median) | peak RSS MiB | peak RSS increase MiB | all-gathers/step "
            "| reduce-scatters/step | losses == (d) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if not r["ok"]:
            rows.append(f"| {r['variant']} | {r['torch']} | fails: {r['error'][:60]} | | | | | |")
            continue
        rows.append(f"| {r['variant']} | {r['torch']} | {r['step_ms_median']:.1f} | {r['peak_rss_mib']:.0f} | "
                    f"{r['peak_rss_increase_mib']:.1f} | "
                    f"{r['all_gathers_per_step']} | {r['reduce_scatters_per_step']} | {r.get('losses_equal_to_d')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the chosen variants one after another; print JSON or write it, and a markdown table."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    cfg = config(args.smoke, args.steps)
    results = [run_variant(v, cfg) for v in args.variants]
    reference = next((r for r in results if r["variant"] == "d" and r["ok"]), None)
    for r in results:
        r["config"] = cfg
        r["losses_equal_to_d"] = (r["losses"] == reference["losses"]) if (reference and r["ok"]) else None
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
