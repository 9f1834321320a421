"""The scenario space, generated from its dimensions, each cell compared bitwise to a ground truth.

A cell is one value per dimension (:data:`DIMENSIONS`):

* ``frontend``: how the recompute happens: ``none`` (no checkpoint), torch's non-reentrant and reentrant
  ``checkpoint``, ``checkpoint_wrapper`` (outside ``fully_shard``), the composable ``checkpoint``, selective
  activation checkpointing, three hand-written ``autograd.Function`` checkpoints (one restores autocast,
  one does not, one recomputes with autocast disabled) and, where installed, DeepSpeed's two;
* ``precision``: ``MixedPrecisionPolicy`` with bf16 parameters, fp32 parameters (autocast does the casting),
  bf16 parameters with ``output_dtype`` fp32, and bf16 parameters with ``cast_forward_inputs=False``;
* ``autocast``: CPU autocast bf16, fp16, off, or bf16 with its cast cache off;
* ``backward``: inside the forward's autocast state or outside any;
* ``history``: what runs between or around a forward and its recompute: nothing; an eval ``no_grad`` forward
  (no autocast) before the step, on other data or on the step's own input; one inside the step's autocast
  region before its forward; one between forward and backward; two micro-batches each in its own autocast
  region, both forwards first, an eval forward between their backwards; two steps with an eval forward between
  them; ``backward(retain_graph=True)``, an eval forward, a second backward; two forwards under different
  autocast states before one backward; two forwards in one autocast region, then two backwards
  (``same_region``) or one backward of their sum (``two_passes``, two views of a batch), or with an eval
  ``no_grad`` forward under the region's autocast between them (``eval_between_passes``); an eval ``no_grad``
  forward under the region's autocast after the step's forward (``eval_in_region_after``); a forward and backward
  of the step's input without checkpoint, under another autocast state, between the step's forward and its
  backward (``plain_pass``: an auxiliary loss on the same batch);
* ``hooks``: user hooks on every sharded module: forward pre-hook registered before / after sharding /
  after sharding with ``prepend=True``, forward hook before / after sharding, or one after sharding that
  returns a bf16 tensor; a global module forward pre-hook or forward hook (``register_module_forward_pre_hook``,
  ``register_module_forward_hook``: they run before, and after, every module's own) that changes what the
  sharded modules get or give; a full backward hook (``register_full_backward_hook``, which wraps the call's
  inputs and outputs in autograd functions of its own) that scales the gradients it passes on;
* ``topology``: a sharded root module checkpointed whole; sharded layers in a sharded root, one checkpoint
  per layer; root -> layer -> sub-layer, one checkpoint per layer; ``fully_shard([a, b])`` in a sharded
  root, one checkpoint around the pair; ``fully_shard([a, b])``, one checkpoint around each;
* ``region``: what each checkpointed function runs: the sharded unit itself; unsharded ops, then the unit;
  two sharded units one after the other; one unit twice; the unit in a checkpoint nested in another; the unit
  in two regions one after the other;
* ``signature``: how every sharded module is called: on one tensor; on a tensor shared by every call (a mask)
  then the input; by keyword only; on a tuple; on a dict; on views of one batch;
* ``route``: how every sharded module is entered: its ``forward`` (``__call__``), or a method registered with
  ``register_fsdp_forward_method`` (``encode``: FSDP's pre- and post-forward run, no module hook);
* ``params``: the parameters trainable, all frozen (``requires_grad=False``: a critic, a reward model; the
  inputs' gradients still flow through), or a frozen part inside each trainable block (its biases).

Each cell runs in a mode: ``stock`` (the positive control), ``apply`` (before sharding), ``late_apply``
(after sharding and after the hooks), ``patched_fully_shard``. The ground truth (:func:`truth`) is the same
cell without checkpoint, stock, with autocast's cache as the cell has it, on the unsharded model (fp32
parameters) or FSDP2 (its own mixed precision), itself checked against FSDP1 and against FSDP2 without the
cache (``tests/test_grid.py``). Every patched mode must equal it bitwise; what stock does is recorded.
:meth:`Cell.valid` leaves out duplicates and what torch itself cannot make bitwise, each with its reason.

Needs a process group (world size 1); everything runs on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
import random
import typing
from collections.abc import Iterator
from dataclasses import astuple, dataclass, fields
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fsdp_autocast_fix
from fsdp_autocast_fix import _compat

DIM = 16
BF16 = torch.bfloat16
MODES = ("stock", "apply", "late_apply", "patched_fully_shard")
PATCHED_MODES = MODES[1:]


@functools.lru_cache(maxsize=None)
def deepspeed_available() -> bool:
    """Whether DeepSpeed's checkpoints can be used here (its CPU accelerator on a machine without CUDA)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed import checkpointing  # noqa: F401
    except Exception:
        return False
    return True


SIGNATURES = ("tensor", "shared_first", "kwargs", "tuple", "dict", "views")
#: Histories with two training forward passes backwarded together.
TWO_PASSES = ("mixed_states", "two_passes", "eval_between_passes")
FRONTENDS = ("none", "torch", "torch_reentrant", "wrapper", "composable", "selective",
             "fn_restore", "fn_no_restore", "fn_disable", "deepspeed", "deepspeed_non_reentrant")
#: Front ends whose checkpoint does not restore the forward's autocast state in the recompute.
NOT_RESTORING = ("fn_no_restore", "fn_disable", "deepspeed", "deepspeed_non_reentrant")
#: Histories whose backwards accumulate into the same gradients more than once.
MULTI_BACKWARD = ("micro_batches", "same_region", "eval_between_steps", "retain_graph", "plain_pass")
#: Front ends whose recompute runs in a backward of its own (an autograd.Function's backward).
REENTRANT = ("torch_reentrant", "fn_restore", "fn_no_restore", "fn_disable", "deepspeed")
DIMENSIONS: dict[str, tuple[str, ...]] = {
    "frontend": FRONTENDS,
    "precision": ("bf16_params", "fp32_params", "output_fp32", "no_input_cast"),
    "autocast": ("bf16", "fp16", "off", "bf16_no_cache"),
    "backward": ("inside", "outside"),
    "history": ("none", "eval_before", "eval_before_same_input", "eval_in_region", "eval_between", "micro_batches",
                "eval_between_steps", "retain_graph", "mixed_states", "same_region", "two_passes", "plain_pass",
                "eval_in_region_after", "eval_between_passes"),
    "hooks": ("none", "pre_before", "pre_after", "pre_after_prepend", "post_before", "post_after",
              "post_after_bf16", "global_pre", "global_post", "full_backward"),
    "topology": ("root", "layers", "nested", "grouped", "grouped_each"),
    "region": ("module", "pre_ops", "two_modules", "twice", "nested", "across"),
    "signature": SIGNATURES,
    "route": ("forward", "method"),
    "params": ("trainable", "frozen", "frozen_part"),
}


@dataclass(frozen=True)
class Cell:
    """One point of the scenario space (see the module docstring)."""

    frontend: str
    precision: str
    autocast: str
    backward: str
    history: str
    hooks: str
    topology: str
    region: str = "module"
    signature: str = "tensor"
    route: str = "forward"
    params: str = "trainable"

    @property
    def name(self) -> str:
        return "-".join(astuple(self))

    def recomputes_per_backward(self) -> int:
        """How many checkpointed regions run the same sharded module before one backward."""
        return (2 if self.region == "across" else 1) * (2 if self.history in TWO_PASSES else 1)

    def runs_a_module_twice(self) -> bool:
        """Whether a sharded module runs forward twice before one backward: several passes, or a region that
        calls it twice or checkpoints it in two regions."""
        return self.history in TWO_PASSES or self.region in ("twice", "across")

    def needs_preserve_autocast(self) -> bool:
        """Whether the patch needs :func:`fsdp_autocast_fix.preserve_autocast` around the checkpoint here: the
        region runs unsharded ops before its first sharded call, whose input nothing recorded then names, and the
        checkpoint does not restore autocast itself (documented; the patched modes wrap it). A global forward
        pre-hook that changes the input is such an op: it runs before any hook of the module. So is the training
        batch run again without checkpoint under another autocast state (``plain_pass``): a call with grad enabled
        is recorded whether or not a checkpoint runs it, so the recompute finds two states on its input and
        replays the most recent (documented), also under a checkpoint that restores autocast itself."""
        if self.history == "plain_pass" and self.frontend in ("fn_restore",) + NOT_RESTORING:
            return True
        return (self.region == "pre_ops" or self.hooks == "global_pre") and self.frontend in NOT_RESTORING

    def shares_a_cast(self) -> bool:
        """Whether autocast's cache gives two uses of one parameter one cast here, so that its gradient is summed
        in low precision before the cast's backward: the only cells where the cache changes gradient bits."""
        return self.cache() and self.casts_parameters() and (
            self.region in ("twice", "across") or self.history in TWO_PASSES[1:])

    def cache(self) -> bool:
        """Whether autocast's cast cache is on in this cell."""
        return self.autocast in ("bf16", "fp16")

    def casts_parameters(self) -> bool:
        """Whether autocast casts the parameters here (fp32 ones, or bf16 ones under fp16 autocast)."""
        return self.autocast != "off" and (self.precision == "fp32_params" or self.autocast == "fp16")

    def valid(self) -> bool:
        """Cells that are not duplicates or impossible by construction, and none that torch itself cannot make
        bitwise (each rule says why)."""
        if self.autocast == "off" and self.backward == "inside":
            return False  # the same as outside
        if self.frontend == "none" and self.history == "plain_pass":
            return False  # without a checkpoint, the same computation as "mixed_states" on one input
        if self.region == "two_modules" and self.topology not in ("layers", "nested", "grouped_each"):
            return False  # needs two sharded units one after the other
        if self.frontend == "none" and self.region in ("nested", "across"):
            return False  # without a checkpoint, the same computation as "module" / "twice"
        if self.frontend in ("wrapper", "composable") and self.region not in ("module", "across"):
            return False  # these checkpoint a module's every call: a region is one call
        if self.history == "same_region" and self.casts_parameters() and self.cache():
            return False  # FSDP2, stock or patched: two forward passes of one module in one autocast region share
            # the cast cache's casts of its parameters; backwarded separately, the second backward's gradients
            # through them arrive after FSDP's post-backward hook and are lost. Whether the passes will be
            # backwarded together (then sharing is exact: see "two_passes") is not known at the second forward.
        if self.precision == "no_input_cast" and self.autocast == "off":
            return False  # fp32 inputs into bf16 parameters: fails without any checkpoint
        if self.frontend == "selective" and self.casts_parameters() and self.cache() and (
                self.region == "across" or self.history in TWO_PASSES[1:]):
            return False  # torch: selective checkpointing needs the recompute to run the forward's ops; a region
            # whose forward took a parameter's cast from the cache (cast by an earlier region of the same autocast
            # region) casts it afresh in its recompute ("... not found in storage"), stock or patched
        if (self.frontend == "selective" and self.history == "mixed_states" and self.region == "across"
                and self.autocast == "off" and self.precision == "fp32_params"
                and not _compat.load().needs_cast_replay):
            return False  # torch 2.13+: the same, for the second forward, which runs under bf16 with the cache
            # ("aten._to_copy.default invocation index 2 ... not found in storage"), stock or patched
        if self.topology.startswith("grouped") and not fsdp_supports("grouped"):
            return False  # torch 2.4: fully_shard takes one module, no fully_shard([a, b])
        if self.frontend == "selective" and not fsdp_supports("selective"):
            return False  # torch 2.4: no selective activation checkpointing
        if self.frontend == "composable" and self.signature == "kwargs" and not fsdp_supports("composable_kwargs"):
            return False  # torch 2.4: the composable checkpoint's recompute drops keyword arguments
        if self.topology == "grouped_each" and self.region in ("twice", "across"):
            return False  # FSDP2: a module of fully_shard([a, b]) run again before the other one is run once
            # breaks the group's pass ("a, a, b, b"), with or without a checkpoint
        if self.frontend in REENTRANT and self.recomputes_per_backward() > 1 and (
                self.precision != "fp32_params" or self.topology != "root" or self.recomputes_per_backward() > 2
                or self.history in MULTI_BACKWARD or self.shares_a_cast()):
            return False  # torch: each reentrant recompute runs a backward of its own, so the gradient of a
            # module recomputed in several regions of one backward is accumulated once per region instead of
            # summed once (and, with bf16 parameters, reduced once per region in bf16; with the cache on, once
            # per region through the cast the regions share): not bitwise comparable, with or without autocast,
            # stock or patched. Compared where the sums agree: fp32 parameters, one sharded module, two
            # regions, one backward, no shared cast.
        if self.frontend in ("composable", "selective") and self.history == "retain_graph":
            return False  # torch: neither recomputes twice (a spent context manager; "backward once" for SAC)
        if self.frontend == "composable" and self.hooks in ("pre_after_prepend", "global_pre"):
            return False  # torch: the composable checkpoint's region starts in its own pre-hook, after this
            # hook in the forward, but its recompute runs the module call with every hook: never comparable
        if (self.frontend == "selective" and self.hooks in ("post_after", "post_after_bf16")
                and not _compat.load().needs_cast_replay):
            return False  # torch 2.13+: FSDP's output cast in the recompute runs ops (a profiler range, a copy)
            # that selective checkpointing counts; with a forward hook after FSDP's the recompute's op sequence
            # differs from the forward's ("... not found in storage"), stock or patched
        if self.topology == "grouped_each" and self.frontend in REENTRANT:
            return False  # torch: FSDP runs a group's hooks for the pass of all its modules; a reentrant
            # recompute of one of them alone leaves the other's parameters sharded ("mixed torch.Tensor and
            # DTensor"), stock or patched
        if (self.topology == "grouped_each" and self.hooks.startswith("post_after")
                and (self.precision == "output_fp32" or (self.precision == "bf16_params" and self.autocast == "fp16"))
                and _compat.load().needs_cast_replay):
            return False  # torch 2.5-2.12: a forward hook after FSDP's that saves tensors makes the recompute of
            # one module of the group run before its pre-backward hook, as a forward of its own, and FSDP's group
            # closure then casts that module's output (output_fp32), or its fp16 input to bf16, which it did not in
            # the group's forward: "Recomputed values ... have different metadata", stock or patched
        if self.route == "method" and (self.frontend in ("wrapper", "composable") or self.hooks != "none"
                                       or self.topology.startswith("grouped")):
            return False  # a registered method runs no module hook: the checkpoints that live in the module's
            # call and user hooks see nothing (the same cell as without them); fully_shard([a, b]) runs its
            # group's pass in its hooks, which a method of a member bypasses
        if self.frontend == "deepspeed" and self.history == "retain_graph":
            return False  # DeepSpeed's reentrant checkpoint frees its saved inputs in the first backward
        if self.frontend.startswith("deepspeed") and not deepspeed_available():
            return False
        return True


#: The named cases (issues 9, 15, 37 and 38), with what stock torch does in it: ``broken`` on every torch, ``buggy
#: torch`` only where torch skips FSDP's casts in the recompute (2.4-2.12), ``resharding torch`` only where its
#: recompute leaves parameters resharded since the forward sharded (before 2.11), ``fine`` where stock is right
#: and the patch must keep it so. Always part of :func:`sample`; tested by name in tests/test_regressions.py.
NAMED: dict[str, tuple[Cell, str]] = {
    # 1. The replay is per call, not per module.
    "eval_pass_before_training_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "eval_before", "none", "root"), "broken"),
    "eval_pass_between_two_steps_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "eval_between_steps", "none", "root"), "broken"),
    "micro_batches_eval_between_backwards_torch_checkpoint":
        (Cell("torch", "fp32_params", "bf16", "outside", "micro_batches", "none", "root"), "fine"),
    "retain_graph_eval_then_second_backward_torch_checkpoint":
        (Cell("torch", "fp32_params", "bf16", "outside", "retain_graph", "none", "root"), "fine"),
    "several_autocast_states_before_one_backward_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "mixed_states", "none", "root"), "broken"),
    # 2. The casts sit at FSDP's place among the user's hooks (what each hook sees: test_hooks_see_...).
    # A forward hook that saves tensors makes torch recompute before FSDP's pre-backward hook runs, so
    # stock casts as in the forward: these cells are right stock, and the patch must keep them so.
    "output_dtype_user_forward_hook_after_sharding":
        (Cell("torch", "output_fp32", "bf16", "outside", "none", "post_after", "root"), "fine"),
    "user_forward_hook_returning_bf16":
        (Cell("torch", "output_fp32", "bf16", "outside", "none", "post_after_bf16", "root"), "fine"),
    "user_pre_hook_after_sharding":
        (Cell("torch", "bf16_params", "bf16", "outside", "none", "pre_after", "root"), "buggy torch"),
    "user_pre_hook_prepended_after_sharding":
        (Cell("torch", "bf16_params", "bf16", "outside", "none", "pre_after_prepend", "root"), "buggy torch"),
    # 3. Autocast's weight-cast cache (pytorch issue 158232).
    "reentrant_checkpoint_backward_inside_autocast":
        (Cell("torch_reentrant", "fp32_params", "bf16", "inside", "none", "none", "root"), "broken"),
    "custom_checkpoint_recomputing_with_autocast_disabled_in_open_region":
        (Cell("fn_disable", "fp32_params", "bf16", "inside", "none", "none", "root"), "broken"),
    "eval_forward_in_autocast_region_then_training_no_checkpoint":
        (Cell("none", "fp32_params", "bf16", "inside", "eval_in_region", "none", "root"), "broken"),
    "two_forwards_in_one_autocast_region_one_backward_no_checkpoint":
        (Cell("none", "fp32_params", "bf16", "inside", "two_passes", "none", "root"), "fine"),
    # 4. A call is all it was given, and a recompute shares what its forward shared (issue 15).
    "shared_first_tensor_micro_batches_eval_between_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "micro_batches", "none", "root", "module",
              "shared_first"), "broken"),
    "inputs_in_a_tuple_micro_batches_eval_between_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "micro_batches", "none", "root", "module",
              "tuple"), "broken"),
    "block_twice_in_one_reentrant_checkpoint":
        (Cell("torch_reentrant", "fp32_params", "bf16", "outside", "none", "none", "root", "twice"), "fine"),
    "block_twice_in_one_checkpoint_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "none", "none", "root", "twice"), "broken"),
    "block_twice_no_checkpoint":
        (Cell("none", "fp32_params", "bf16", "outside", "none", "none", "root", "twice"), "fine"),
    "layers_twice_in_one_torch_checkpoint_backward_inside":
        (Cell("torch", "fp32_params", "bf16", "inside", "none", "none", "layers", "twice"), "fine"),
    "preprocessing_before_the_sharded_call_torch_checkpoint":
        (Cell("torch", "bf16_params", "bf16", "outside", "none", "none", "layers", "pre_ops"), "fine"),
    "two_sharded_blocks_in_one_torch_checkpoint":
        (Cell("torch", "bf16_params", "bf16", "outside", "none", "none", "layers", "two_modules"), "fine"),
    "one_block_across_two_torch_checkpoints":
        (Cell("torch", "fp32_params", "bf16", "inside", "none", "none", "root", "across"), "fine"),
    "keyword_arguments_only_eval_before_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "eval_before", "none", "layers", "module",
              "kwargs"), "broken"),
    "views_of_one_batch_micro_batches_reentrant_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "micro_batches", "none", "root", "module",
              "views"), "broken"),
    # 5. Issue 37: no harm where stock is right; every route into FSDP's forward.
    "frozen_model_eval_between_two_passes_in_one_autocast_region_no_checkpoint":
        (Cell("none", "fp32_params", "bf16", "inside", "eval_between_passes", "none", "root", params="frozen"),
         "fine"),
    "trainable_model_eval_between_two_passes_in_one_autocast_region_no_checkpoint":
        (Cell("none", "fp32_params", "bf16", "inside", "eval_between_passes", "none", "root"), "fine"),
    "trainable_model_eval_between_two_passes_in_one_autocast_region_torch_checkpoint":
        (Cell("torch", "fp32_params", "bf16", "inside", "eval_between_passes", "none", "layers"), "fine"),
    "eval_after_the_forward_in_its_autocast_region_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "eval_in_region_after", "none", "root"), "broken"),
    "frozen_model_eval_in_the_training_autocast_region_no_checkpoint":
        (Cell("none", "fp32_params", "bf16", "inside", "eval_in_region", "none", "root", params="frozen"), "fine"),
    "frozen_biases_eval_in_the_training_autocast_region_no_checkpoint":
        (Cell("none", "fp32_params", "bf16", "inside", "eval_in_region", "none", "root", params="frozen_part"),
         "broken"),
    "registered_method_torch_checkpoint":
        (Cell("torch", "bf16_params", "bf16", "outside", "none", "none", "root", route="method"), "buggy torch"),
    "registered_method_custom_checkpoint":
        (Cell("fn_no_restore", "fp32_params", "bf16", "outside", "none", "none", "root", route="method"), "broken"),
    # 6. Issue 38: a module run twice before one backward finds its parameters gathered in its recompute.
    "module_run_twice_before_one_backward_composable_checkpoint":
        (Cell("composable", "fp32_params", "off", "outside", "two_passes", "none", "nested"), "resharding torch"),
    "module_run_twice_before_one_backward_torch_checkpoint":
        (Cell("torch", "fp32_params", "off", "outside", "two_passes", "none", "nested"), "resharding torch"),
    "stack_run_twice_before_one_backward_bf16_policy_torch_checkpoint":
        (Cell("torch", "bf16_params", "bf16", "outside", "two_passes", "none", "nested"), "resharding torch"),
}
if deepspeed_available():
    NAMED.update({
        "eval_pass_before_training_deepspeed_checkpoint":
            (Cell("deepspeed", "fp32_params", "bf16", "outside", "eval_before", "none", "root"), "broken"),
        "deepspeed_checkpoint_backward_inside_autocast":
            (Cell("deepspeed", "fp32_params", "bf16", "inside", "none", "none", "root"), "broken"),
        "deepspeed_non_reentrant_checkpoint_backward_outside_autocast":
            (Cell("deepspeed_non_reentrant", "fp32_params", "bf16", "outside", "none", "none", "root"), "broken"),
    })


@functools.lru_cache(maxsize=None)
def fsdp_supports(feature: str) -> bool:
    """Whether this torch has ``feature``: ``grouped`` (``fully_shard`` of a list of modules, 2.5+), one of
    ``fully_shard``'s keyword arguments (``ignored_params``: 2.7+), ``selective`` (selective activation
    checkpointing, 2.5+) or ``composable_kwargs`` (the composable checkpoint replays keyword arguments, 2.5+)."""
    if feature == "selective":  # selective activation checkpointing: torch 2.5+
        return hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts")
    if feature == "composable_kwargs":  # the composable checkpoint replays keyword arguments: torch 2.5+
        from torch.distributed._composable import checkpoint_activation

        return "with_kwargs=True" in inspect.getsource(checkpoint_activation)
    fully_shard = _compat.fsdp_package().fully_shard
    parameters = inspect.signature(fully_shard).parameters
    if feature == "grouped":  # the module argument takes a list (where fully_shard is overloaded, an overload's)
        overloads = getattr(typing, "get_overloads", lambda f: [])(inspect.unwrap(fully_shard))
        annotations = [parameters["module"].annotation] + [
            inspect.signature(overload).parameters["module"].annotation for overload in overloads]
        return any("list" in str(annotation).lower() for annotation in annotations)
    return feature in parameters


def all_cells() -> list[Cell]:
    """The whole product of :data:`DIMENSIONS`, valid cells only."""
    cells = (Cell(*values) for values in itertools.product(*DIMENSIONS.values()))
    return [c for c in cells if c.valid()]


def sample(n: int, seed: int = 0) -> list[Cell]:
    """``n`` cells: the named ones, then every value of every dimension at least once, then valid cells drawn
    uniformly from the product with ``seed`` (the product is millions of cells: it is never listed)."""
    rng = random.Random(seed)
    chosen: list[Cell] = list(dict.fromkeys(cell for cell, _ in NAMED.values()))
    seen = set(chosen)

    def draw(**fixed: str) -> Cell | None:
        for _ in range(10_000):
            cell = Cell(**{f.name: fixed.get(f.name) or rng.choice(DIMENSIONS[f.name]) for f in fields(Cell)})
            if cell.valid() and cell not in seen:
                seen.add(cell)
                return cell
        return None  # no valid cell with this value (say, DeepSpeed's front ends where it is not installed)

    for f in fields(Cell):  # cover each value first
        for value in DIMENSIONS[f.name]:
            if not any(getattr(c, f.name) == value for c in chosen):
                cell = draw(**{f.name: value})
                if cell is not None:
                    chosen.append(cell)
    while len(chosen) < n:
        cell = draw()
        if cell is None:
            break
        chosen.append(cell)
    return chosen


# -- modules and call signatures -----------------------------------------------------------------------

def invoke(module: Callable[..., torch.Tensor], x: torch.Tensor, s: torch.Tensor | None,
           signature: str) -> torch.Tensor:
    """Call ``module`` on input ``x`` and shared tensor ``s`` the way ``signature`` says, through its ``encode``
    where its ``route`` is a registered method."""
    if getattr(module, "route", "forward") == "method":
        module = module.encode  # type: ignore[union-attr]
    if signature in ("tensor", "views"):
        return module(x)
    if signature == "shared_first":
        return module(s, x)
    if signature == "kwargs":
        return module(x=x, s=s)
    if signature == "tuple":
        return module((x, s))
    if signature == "dict":
        return module({"x": x, "s": s})
    raise ValueError(signature)


def unpack(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(x, s)`` from any call :func:`invoke` makes."""
    if kwargs:
        return kwargs["x"], kwargs.get("s")
    first, *rest = args
    if isinstance(first, tuple):
        return first[0], first[1]
    if isinstance(first, dict):
        return first["x"], first["s"]
    return (rest[0], first) if rest else (first, None)


class _Unit(nn.Module):
    """A grid module: ``encode`` is its ``forward`` by another name, the route ``register_fsdp_forward_method``
    takes (``route``: how :func:`invoke` enters it)."""

    route = "forward"

    def encode(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.forward(*args, **kwargs)  # type: ignore[no-any-return]


class Block(_Unit):
    """``gelu``, ``log_softmax``, a linear layer: its recompute notices a lost input cast (gelu in another
    dtype), lost autocast (log_softmax runs in fp32 under autocast, the linear layer in the low precision) and
    a lost output cast (the linear layer's output is low precision). The shared tensor, where given, is added
    first."""

    def __init__(self, signature: str = "tensor") -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.signature = signature

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, s = unpack(args, kwargs)
        if s is not None:
            x = x + 0.5 * s
        return self.lin(F.log_softmax(F.gelu(x), dim=-1).to(self.lin.weight.dtype))


class Outer(_Unit):
    """A layer holding a sharded sub-layer."""

    def __init__(self, signature: str = "tensor") -> None:
        super().__init__()
        self.sub = Block(signature)
        self.lin = nn.Linear(DIM, DIM)
        self.signature = signature

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, s = unpack(args, kwargs)
        h = invoke(self.sub, F.gelu(x), s, self.signature)
        return self.lin(h.to(self.lin.weight.dtype))


class Pair(_Unit):
    """Two blocks one after the other: ``fully_shard([pair.a, pair.b])`` makes them one group."""

    def __init__(self, signature: str = "tensor") -> None:
        super().__init__()
        self.a, self.b = Block(signature), Block(signature)
        self.signature = signature

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, s = unpack(args, kwargs)
        return invoke(self.b, invoke(self.a, x, s, self.signature), s, self.signature)


class Stack(_Unit):
    """Runs its units in order, or through :attr:`body` (the cell's checkpointed regions) where set."""

    def __init__(self, units: list[nn.Module], signature: str = "tensor") -> None:
        super().__init__()
        self.units = nn.ModuleList(units)
        self.signature = signature
        self.body: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        x, s = unpack(args, kwargs)
        if self.body is not None:
            return self.body(x, s)
        for unit in self.units:
            x = invoke(unit, x, s, self.signature)
        return x


def _build(topology: str, signature: str = "tensor", route: str = "forward", params: str = "trainable") -> nn.Module:
    """The model of ``topology``, every module entered by ``route``, its parameters as ``params`` says."""
    if topology == "root":
        model: nn.Module = Block(signature)
    elif topology in ("layers", "grouped_each"):
        model = Stack([Block(signature), Block(signature)], signature)
    elif topology == "nested":
        model = Stack([Outer(signature), Outer(signature)], signature)
    else:
        model = Stack([Pair(signature)], signature)  # grouped: fully_shard([a, b]) around the pair
    for module in model.modules():
        if isinstance(module, _Unit):
            module.route = route
        if isinstance(module, nn.Linear) and params == "frozen":
            module.requires_grad_(False)
        elif isinstance(module, nn.Linear) and params == "frozen_part":
            module.bias.requires_grad_(False)
    return model


def _members(pair: nn.Module) -> list[nn.Module]:
    return [pair.a, pair.b]


def _policy(precision: str) -> dict[str, Any]:
    return {
        "bf16_params": {"param_dtype": BF16},
        "fp32_params": {},
        "output_fp32": {"param_dtype": BF16, "output_dtype": torch.float32},
        "no_input_cast": {"param_dtype": BF16, "cast_forward_inputs": False},
    }[precision]


def _shard(model: nn.Module, topology: str, fully_shard: Callable[..., Any], policy: Any) -> list[nn.Module]:
    """Shard as the topology says; return the sharded modules (hooks go on each)."""
    if topology == "root":
        fully_shard(model, mp_policy=policy)
        return [model]
    sharded: list[nn.Module] = []
    if topology == "grouped_each":  # fully_shard([a, b]), a checkpoint around each
        fully_shard(list(model.units), mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return list(model.units) + [model]
    for unit in model.units:
        if topology == "nested":
            fully_shard(unit.sub, mp_policy=policy)
            fully_shard(unit, mp_policy=policy)
            sharded += [unit.sub, unit]
        elif topology == "grouped":
            fully_shard(_members(unit), mp_policy=policy)
            sharded += _members(unit)
        else:
            fully_shard(unit, mp_policy=policy)
            sharded.append(unit)
    fully_shard(model, mp_policy=policy)
    return sharded + [model]


# -- checkpoint front ends ----------------------------------------------------------------------------


class _FunctionCheckpoint(torch.autograd.Function):
    """A hand-written reentrant-style checkpoint; ``mode`` says what the recompute's autocast state is."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], mode: str, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.mode = fn, mode
        ctx.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                        torch.is_autocast_cache_enabled())
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return fn(*tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        enabled, dtype, cache = ctx.autocast
        if ctx.mode == "restore":
            context: Any = torch.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=cache)
        elif ctx.mode == "disable":
            context = torch.autocast("cpu", enabled=False)
        else:  # "no_restore": whatever the backward runs under
            context = contextlib.nullcontext()
        with torch.enable_grad(), context:
            out = ctx.fn(*tensors)
        torch.autograd.backward(out, grad)
        return (None, None, *(t.grad for t in tensors))


def _selective(fn: Callable[..., Any], *tensors: torch.Tensor) -> torch.Tensor:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    context_fn = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    return checkpoint(fn, *tensors, use_reentrant=False, context_fn=context_fn)


def _deepspeed(non_reentrant: bool) -> Callable[..., torch.Tensor]:
    from deepspeed import checkpointing as ds

    return ds.non_reentrant_checkpoint if non_reentrant else ds.checkpoint


def frontend_fn(frontend: str) -> Callable[..., torch.Tensor]:
    """``run(fn, *tensors)`` for a front end that wraps a call; a plain call for the module-level ones."""
    if frontend in ("none", "wrapper", "composable"):
        return lambda fn, *tensors: fn(*tensors)
    if frontend == "torch":
        return lambda fn, *tensors: checkpoint(fn, *tensors, use_reentrant=False)
    if frontend == "torch_reentrant":
        return lambda fn, *tensors: checkpoint(fn, *tensors, use_reentrant=True)
    if frontend == "selective":
        return _selective
    if frontend.startswith("fn_"):
        mode = frontend[3:]
        return lambda fn, *tensors: _FunctionCheckpoint.apply(fn, mode, *tensors)
    if frontend.startswith("deepspeed"):
        return _deepspeed(frontend.endswith("non_reentrant"))
    raise ValueError(frontend)


# -- regions: what a checkpointed function runs -------------------------------------------------------

Step = Callable[[torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def _pre(x: torch.Tensor) -> torch.Tensor:
    """Unsharded ops before the sharded call, inside the region (a norm, a residual)."""
    return x + 0.5 * torch.tanh(x)


def _regions(units: list[Step], region: str) -> list[Step]:
    """The functions one forward checkpoints, in order, each from ``(x, s)`` to the next ``x``."""
    if region in ("module", "nested"):  # nested: each run inside a checkpoint of its own (see _body)
        return list(units)
    if region == "pre_ops":
        return [lambda x, s, u=u: u(_pre(x), s) for u in units]
    if region == "twice":
        return [lambda x, s, u=u: u(u(x, s), s) for u in units]
    if region == "two_modules":
        first, second = units
        return [lambda x, s: second(first(x, s), s)]
    if region == "across":
        return [u for u in units for _ in range(2)]
    raise ValueError(region)


def _body(steps: list[Step], run: Callable[..., torch.Tensor], nested: bool) -> Step:
    """Run ``steps`` one after the other, each through the front end ``run`` (twice over if ``nested``)."""
    def through(step: Step, x: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        if s is None:
            return run(lambda h: step(h, None), x)
        return run(step, x, s)

    def body(x: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
        for step in steps:
            x = through((lambda h, t, step=step: through(step, h, t)) if nested else step, x, s)
        return x

    return body


def _forward(model: nn.Module, outer: nn.Module, cell: Cell, s: torch.Tensor | None,
             preserve: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """Set the cell's front end and regions up on the model (``outer``: what wraps it, if anything); return the
    call that runs one step's forward. ``preserve``: the front end through ``preserve_autocast``."""
    signature, topology, frontend = cell.signature, cell.topology, cell.frontend
    units = [outer] if topology == "root" else list(model.units)
    views = units
    if frontend == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        views = [checkpoint_wrapper(u) for u in units]  # views, not submodules: sharded after
    steps = [functools.partial(lambda u, x, t: invoke(u, x, t, signature), u) for u in views]
    run = frontend_fn(frontend)
    body = _body(_regions(steps, cell.region), fsdp_autocast_fix.preserve_autocast(run) if preserve else run,
                 cell.region == "nested")
    if topology == "root":
        return lambda x: body(x, s)
    model.body = body
    return lambda x: invoke(outer, x, s, signature)


def _composable(model: nn.Module, topology: str) -> None:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    for unit in ([model] if topology == "root" else list(model.units)):
        composable_checkpoint(unit)


# -- hooks --------------------------------------------------------------------------------------------


def _mix(t: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A change that depends on ``t``'s dtype (tanh keeps it) and on autocast (a matmul), as a real hook's might."""
    product = t @ (weight if torch.is_autocast_enabled("cpu") else weight.to(t.dtype))
    return t + 0.25 * torch.tanh(t) * product


def _register_hooks(modules: list[nn.Module], hooks: str, weight: torch.Tensor) -> list[Any]:
    """Put the cell's hooks on ``modules``; return the handles of the global ones (process-wide: the caller removes
    them)."""
    if hooks in ("global_pre", "global_post"):
        ids = {id(m) for m in modules}

        def global_pre(m: nn.Module, args: tuple[Any, ...]) -> Any:
            if id(m) in ids and args:  # a global pre-hook gets the positional arguments only
                return _map_x(args, {}, lambda x: _mix(x, weight))[0]
            return None

        def global_post(m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
            return _mix(out, weight) if id(m) in ids else None

        return [torch.nn.modules.module.register_module_forward_pre_hook(global_pre) if hooks == "global_pre"
                else torch.nn.modules.module.register_module_forward_hook(global_post)]
    for module in modules:
        if hooks.startswith("pre"):
            module.register_forward_pre_hook(lambda m, args, kwargs: _map_x(args, kwargs, lambda x: _mix(x, weight)),
                                             prepend=hooks.endswith("prepend"), with_kwargs=True)
        elif hooks == "post_after_bf16":
            module.register_forward_hook(lambda m, args, out: _mix(out, weight).to(BF16))
        elif hooks.startswith("post"):
            module.register_forward_hook(lambda m, args, out: _mix(out, weight))
        elif hooks == "full_backward":
            module.register_full_backward_hook(
                lambda m, grad_in, grad_out: tuple(None if g is None else 0.75 * g for g in grad_in))
    return []


def _map_x(args: tuple[Any, ...], kwargs: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A pre-hook's result: the call's arguments with its input ``x`` (wherever the signature puts it) mapped."""
    if kwargs:
        return args, {**kwargs, "x": fn(kwargs["x"])}
    first, *rest = args
    if isinstance(first, tuple):
        return ((fn(first[0]), first[1]),), kwargs
    if isinstance(first, dict):
        return ({**first, "x": fn(first["x"])},), kwargs
    if rest:
        return (first, fn(rest[0])), kwargs
    return (fn(first),), kwargs


# -- steps --------------------------------------------------------------------------------------------


def _autocast(autocast: str, cache: bool = True) -> Any:
    """The cell's autocast context; ``cache=False`` turns its cast cache off (the ground truth)."""
    if autocast == "off":
        return torch.autocast("cpu", enabled=False)
    dtype = torch.float16 if autocast == "fp16" else BF16
    return torch.autocast("cpu", dtype=dtype, cache_enabled=cache and autocast != "bf16_no_cache")


def _other_autocast(autocast: str, cache: bool) -> Any:
    """Another autocast state than the cell's (for ``mixed_states`` and ``plain_pass``)."""
    return _autocast("off" if autocast != "off" else "bf16", cache)


def _step(cell: Cell, forward: Callable[[torch.Tensor], torch.Tensor], model: nn.Module,
          call: Callable[[torch.Tensor], Any], inputs: list[torch.Tensor], cache: bool,
          reference: bool) -> None:
    """Run the cell's history around its training step(s): forwards through the checkpoint, backwards, evals.

    ``call`` runs the model's own calls on some data (no checkpoint: eval passes, ``plain_pass``).
    ``backward == "inside"`` runs each backward in the autocast region of its forward where the history
    keeps that region open, else in a fresh region with the same state. ``reference``: the ground truth's run,
    where a cast cached by the eval forward inside the training's autocast region is dropped after it, as plain
    PyTorch must not reuse it (pytorch issue 158232; a no-op for the unsharded model from torch 2.12).
    """
    ac = functools.partial(_autocast, cell.autocast, cache)
    inside = cell.backward == "inside"
    x, x2, x_eval = inputs

    def plain(data: torch.Tensor) -> Any:
        """A forward of the model's own calls, no checkpoint."""
        body = getattr(model, "body", None)
        try:
            if body is not None:
                model.body = None
            return call(data)
        finally:
            if body is not None:
                model.body = body

    def eval_forward(data: torch.Tensor | None = None, autocast: bool = False, first: bool = True) -> None:
        """An eval pass; ``autocast``: under the region's state; ``first``: before any training pass of the region
        (else its casts are those the training pass cached, with autograd history, which plain PyTorch reuses)."""
        with torch.no_grad(), contextlib.nullcontext() if autocast else torch.autocast("cpu", enabled=False):
            plain(x_eval if data is None else data)
        if reference and autocast and first:
            torch.clear_autocast_cache()

    def backward(out: torch.Tensor, fresh_region: bool = True, **kwargs: Any) -> None:
        with ac() if inside and fresh_region else contextlib.nullcontext():
            out.float().pow(2).sum().backward(**kwargs)

    history = cell.history
    if history == "plain_pass":  # the step's input again, without checkpoint, under another state, backwarded
        with ac():  # before the step's backward
            out = forward(x)
        with _other_autocast(cell.autocast, cache):
            out2 = plain(x)
        backward(out2)
        backward(out)
        return
    if history == "eval_before":
        eval_forward()
    if history == "eval_before_same_input":
        eval_forward(x)
    if history in ("micro_batches", "mixed_states"):
        with ac():
            out = forward(x)
        with ac() if history == "micro_batches" else _other_autocast(cell.autocast, cache):
            out2 = forward(x2)
        if history == "mixed_states":
            backward(out.float() + out2.float())
        else:
            backward(out)
            eval_forward()
            backward(out2)
        return
    with ac():
        if history == "eval_in_region":
            eval_forward(autocast=True)
        out = forward(x)
        if history == "eval_between_passes":
            eval_forward(autocast=True, first=False)
        if history in ("same_region", "two_passes", "eval_between_passes"):
            out2 = forward(x2)
        if history in ("two_passes", "eval_between_passes"):  # two forward passes in one region, one backward
            out = out.float() + out2.float()
        if history == "eval_in_region_after":
            eval_forward(autocast=True, first=False)
        if inside:
            if history == "eval_between":
                eval_forward()
            backward(out, fresh_region=False, retain_graph=history == "retain_graph")
            if history == "same_region":
                backward(out2, fresh_region=False)
    if not inside:
        if history == "eval_between":
            eval_forward()
        backward(out, retain_graph=history == "retain_graph")
        if history == "same_region":
            backward(out2)
    if history == "retain_graph":
        eval_forward()
        backward(out)
    if history == "eval_between_steps":
        eval_forward()
        with ac():
            out2 = forward(x2)
            if inside:
                backward(out2, fresh_region=False)
        if not inside:
            backward(out2)


# -- running ------------------------------------------------------------------------------------------


@dataclass
class Result:
    """Gradients of one run: each input's, then each parameter's (full tensors), or the error raised."""

    grads: list[torch.Tensor | None] | None = None
    error: BaseException | None = None

    def same_as(self, other: Result) -> bool:
        """Bitwise equality of every gradient, dtypes included; a missing gradient equals only a missing one."""
        if self.grads is None or other.grads is None or len(self.grads) != len(other.grads):
            return False
        return all((a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                                   and torch.equal(a, b)) for a, b in zip(self.grads, other.grads))

    def verdict(self, truth: Result) -> str:
        """``bitwise``, ``wrong gradients`` or ``fails (<error>)``."""
        if self.error is not None:
            return f"fails ({type(self.error).__name__})"
        return "bitwise" if self.same_as(truth) else "wrong gradients"


def full_grad(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _inputs(seed: int, signature: str) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """``[x, x2, x_eval]``, the tensors whose gradients are compared, and the shared tensor (``None`` for one
    tensor). ``views``: the three are views of one batch (its gradient is compared)."""
    gen = torch.Generator().manual_seed(seed + 1)
    if signature == "views":
        batch = torch.randn(12, DIM, generator=gen, requires_grad=True)
        return [batch[:4], batch[4:8], batch.detach()[8:]], [batch], None
    inputs = [torch.randn(4, DIM, generator=gen, requires_grad=i < 2) for i in range(3)]
    shared = None if signature == "tensor" else torch.randn(4, DIM, generator=gen)
    return inputs, inputs[:2], shared


@contextlib.contextmanager
def in_mode(mode: str) -> Iterator[Callable[..., Any]]:
    """The ``fully_shard`` to use in ``mode``, with ``apply()`` in force where the mode says, removed after."""
    fully_shard = _compat.fsdp_package().fully_shard
    try:
        if mode == "apply":
            fsdp_autocast_fix.apply()
        yield fsdp_autocast_fix.patched_fully_shard if mode == "patched_fully_shard" else fully_shard
    finally:
        fsdp_autocast_fix.remove()


def run(cell: Cell, mode: str, *, cache: bool = True, sharding: str = "fsdp2", seed: int = 0,
        reference: bool = False, preserve: bool | None = None) -> Result:
    """One run of ``cell`` in ``mode``; ``sharding`` ``fsdp1`` / ``none`` for the references (see :func:`truth`).
    ``preserve``: the front end through ``preserve_autocast`` (by default in the patched modes where the cell
    needs it)."""
    torch.manual_seed(seed)
    # The route is FSDP2's (a registered method); the references enter the same computation through forward.
    model = _build(cell.topology, cell.signature, cell.route if sharding == "fsdp2" else "forward", cell.params)
    weight = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(seed + 7)) / DIM
    inputs, compared, shared = _inputs(seed, cell.signature)
    policy_cls = _compat.fsdp_package().MixedPrecisionPolicy
    with in_mode(mode) as fully_shard:
        if cell.frontend == "composable":
            _composable(model, cell.topology)
        if cell.hooks.endswith("before"):
            _register_hooks(_hookable(model, cell.topology), cell.hooks, weight)
        outer = model
        if sharding == "fsdp2":
            sharded = _shard(model, cell.topology, fully_shard, policy_cls(**_policy(cell.precision)))
            if cell.route == "method":
                for module in sharded:
                    _compat.fsdp_package().register_fsdp_forward_method(module, "encode")
        else:
            sharded = _hookable(model, cell.topology)
            if sharding == "fsdp1":
                outer = _fsdp1(model, cell.topology)
        global_hooks = [] if cell.hooks.endswith("before") or cell.hooks == "none" else \
            _register_hooks(sharded, cell.hooks, weight)
        if mode == "late_apply":
            fsdp_autocast_fix.apply()
        if preserve is None:
            preserve = mode != "stock" and cell.needs_preserve_autocast()
        forward = _forward(model, outer, cell, shared, preserve=preserve)
        try:
            _step(cell, forward, model, lambda data: invoke(outer, data, shared, cell.signature), inputs, cache,
                  reference)
        except Exception as e:  # the positive control's failure, or a patched mode's
            return Result(error=e)
        finally:
            for handle in global_hooks:
                handle.remove()
    return Result(grads=[full_grad(x.grad) for x in compared] + [full_grad(p.grad) for p in model.parameters()])


def _hookable(model: nn.Module, topology: str) -> list[nn.Module]:
    """The modules that get (or would get) FSDP state, in sharding order: where user hooks go."""
    if topology == "root":
        return [model]
    if topology == "grouped_each":
        return list(model.units) + [model]
    modules: list[nn.Module] = []
    for unit in model.units:
        modules += [unit.sub, unit] if topology == "nested" else _members(unit) if topology == "grouped" else [unit]
    return modules + [model]


def _fsdp1(model: nn.Module, topology: str) -> nn.Module:
    """FSDP1 (``FullyShardedDataParallel``) around each unit and the root, fp32 parameters: a second reference."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if topology != "root":
        for i, unit in enumerate(model.units):
            model.units[i] = FSDP(unit, device_id=torch.device("cpu"), use_orig_params=True)  # type: ignore[index]
    return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)


def reference_sharding(cell: Cell) -> str:
    """What the ground truth runs on: the unsharded model, or FSDP2 itself for FSDP2's own mixed precision."""
    return "none" if cell.precision == "fp32_params" else "fsdp2"


def truth(cell: Cell) -> Result:
    """The ground truth for ``cell``: the same cell without checkpoint, stock, autocast's cache as the cell has it.

    It runs on the unsharded model where FSDP2 changes no arithmetic (fp32 parameters), else on FSDP2 (its
    ``MixedPrecisionPolicy`` has no other implementation), dropping the cast cached by an eval forward inside the
    training's autocast region after it (see :func:`_step`). tests/test_grid.py checks it against FSDP1 and
    FSDP2 without the cache where their arithmetic is the same (each weight cast once per region).
    """
    return run(dataclasses.replace(cell, frontend="none"), "stock", sharding=reference_sharding(cell),
               reference=True)
