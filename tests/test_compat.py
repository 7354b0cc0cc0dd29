"""framework/compat/ holds every patch of a third-party internal. For each patch target the thing
it replaces or reads still exists with the signature the patch was written against (an upgrade of
torch, torchtitan, Triton or Hydra that moves one fails here, naming it, rather than in a run);
each patch function is idempotent; the private names apiary reads are listed there and exist; and
no module outside it patches a third-party module or class, or imports ``hydra._internal``."""

from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from framework import compat, contracts
from framework.compat import originals as compat_originals
from framework.compat import torchtitan_patches

from conftest import ROOT

# target -> the parameter names the patch expects (None: an attribute whose presence is the contract)
SIGNATURES = {
    "torch.cuda.memory:_set_allocator_settings": ["env"],
    "torchtitan.trainer:time": None,  # the module global no_closing_sleep swaps (test_the_attribute_targets_...)
    "torch.cpu:current_device": [],
    "torch._utils:_get_available_device_type": [],
    "torch.distributed.tensor.experimental._context_parallel._attention:_compiled_create_block_mask": None,
    "torch.distributed.tensor.experimental._context_parallel._attention:_cp_options.enable_load_balance": None,
    "torchtitan.models.common.attention:_compiled_create_block_mask": None,
    "torchtitan.models.common.attention:FlexAttention._compiled_flex_attn": None,
    "torchtitan.models.common.attention:FlexAttention.inductor_configs": None,
    "torchtitan.distributed.utils:set_determinism": ["parallel_dims", "device", "debug_config",
                                                     "distinct_seed_mesh_dims"],
    "torchtitan.protocols.model:BaseModel.init_weights": ["self", "kwargs"],
    "torchtitan.distributed.utils:clip_grad_norm_": ["parameters", "max_norm", "norm_type", "error_if_nonfinite",
                                                     "foreach", "pp_mesh", "ep_enabled"],
    "torch.nn.utils:clip_grads_with_norm_": ["parameters", "max_norm", "total_norm", "foreach"],
    "torchtitan.distributed.fsdp:apply_fsdp_to_decoder": None,
    "torchtitan.trainer:Trainer.train": ["self"],
    "torchtitan.components.optimizer:OptimizersContainer.step": ["self", "closure"],
    "torchtitan.components.optimizer.lr_scheduler:LRSchedulersContainer.step": ["self"],
    "torchtitan.components.optimizer:OptimizersContainer.load_state_dict": ["self", "state_dict"],
    "torchtitan.components.optimizer.lr_scheduler:LRSchedulersContainer.load_state_dict": ["self", "state_dict"],
    "torchtitan.models.common.token_dispatcher:LocalTokenDispatcher.combine": ["self", "routed_output_RD", "metadata",
                                                                              "x_TD"],
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher.combine": ["self", "routed_output_RD",
                                                                                 "metadata", "x_TD"],
    "torchtitan.protocols.module:Module._sharding_config": None,
    "torchtitan.models.common.decoder:Decoder._skip_lm_head": None,
    "torch.optim.lr_scheduler:LambdaLR.get_lr": ["self"],
    "torch.nn.modules.module:Module.__call__": None,
    "torchtitan.components.checkpointer.dcp:CheckpointManager.dcp_save":
        ["self", "state_dict", "checkpoint_id", "async_mode", "enable_garbage_collection", "to_hf"],
    "torchtitan.components.checkpointer.dcp:CheckpointManager.save": ["self", "curr_step", "last_step"],
    "torchtitan.trainer:Trainer.should_continue_training": ["self"],
    "torchtitan.components.checkpointer.base:ModelWrapper._get_state_dict": ["self"],
    "torchtitan.components.checkpointer.base:_shares_storage": ["a", "b"],
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._dispatch_token_exchange":
        ["self", "routed_input_ND", "pg", "output_splits", "input_splits"],
    "torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._combine_token_exchange":
        ["self", "routed_output_RD", "pg", "input_splits", "output_splits"],
    "torchtitan.protocols.module:Module._spmd_distribute_state":
        ["self", "parallel_dims", "name", "tensor", "layout", "is_param"],
    "triton.runtime.autotuner:Autotuner.prune_configs": ["self", "kwargs"],
    "triton.runtime.autotuner:Autotuner.check_disk_cache": ["self", "tuning_key", "configs", "bench_fn"],
    "triton.knobs:autotuning.listener": None,
    "triton.runtime.autotuner:Autotuner": None,
    "rich.console:Console.on_broken_pipe": ["self"],
    "hydra._internal.utils:get_args_parser": [],
    "hydra._internal.hydra:Hydra.create_main_hydra2": ["task_name", "config_search_path"],
    "hydra._internal.utils:create_config_search_path": ["search_path_dir"],
    "hydra._internal.hydra:Hydra.get_sanitized_hydra_cfg": ["src_cfg"],
    "hydra._internal.core_plugins.basic_sweeper:BasicSweeper.split_arguments": ["overrides", "max_batch_size"],
}
THIRD_PARTY = ("torch", "torchtitan", "triton", "hydra", "omegaconf", "fla", "torchao", "transformer_engine",
               "deep_ep")
INSTANCE_PATCHES = ("guard_trainer_steps", "wrap_checkpoint_saves", "gate_training_loop", "observe_checkpoint_saves",
                    "after_state_load", "replace_token_combine", "add_state_shardings", "hidden_states_only",
                    "hold_final_rate", "module_forward")  # one object, not a class
PATCHES = sorted(n for n in compat.TARGETS if not n.startswith("hydra_") and n not in INSTANCE_PATCHES)


def _split(target: str):
    """(the object holding the last attribute, its name) of "module:a.b.c"."""
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    *parents, attr = path.split(".")
    for p in parents:
        obj = getattr(obj, p)
    return obj, attr


def test_every_target_is_checked_here():
    targets = {t for ts in compat.TARGETS.values() for t in ts}
    assert targets == set(SIGNATURES), "compat.TARGETS and this file's SIGNATURES list different targets"
    public = {n for n, f in vars(compat).items() if inspect.isfunction(f) and not n.startswith("_")
              and f.__module__.startswith(compat.__name__ + ".")} - {"original"}
    assert public == set(compat.TARGETS), "every compat function names its targets in compat.TARGETS"
    for name in compat.TARGETS:
        doc = inspect.getdoc(getattr(compat, name)) or ""
        assert any(v in doc for v in ("torch 2.14.1", "torchtitan 0.3.0", "Triton 3.8.0", "hydra-core 1.3.8", "rich 15.0.0")), \
            f"compat.{name}'s docstring names no version it targets"


@pytest.mark.parametrize("target", sorted(SIGNATURES))
def test_target_exists_with_the_expected_signature(target):
    holder, attr = _split(target)
    assert hasattr(holder, attr), f"{target} is gone: compat's patch of it must be revisited"
    expected = SIGNATURES[target]
    if expected is None:
        return
    fn = compat.original(target)  # the library's own, not apiary's wrapper
    params = list(inspect.signature(fn).parameters)
    assert params == expected, f"{target}{inspect.signature(fn)}: the patch expects parameters {expected}"


def test_the_attribute_targets_hold_what_the_patches_assume():
    from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options
    from torchtitan.models.common.attention import FlexAttention
    from triton.runtime.autotuner import Autotuner

    assert isinstance(_cp_options.enable_load_balance, bool)
    import time

    import torchtitan.trainer as tt

    # no_closing_sleep: the module's time is the time module, and train() sleeps through it once
    assert tt.time is time and inspect.getsource(tt.Trainer.train).count("time.sleep(") == 1
    assert {"max_autotune", "coordinate_descent_tuning"} <= set(FlexAttention.inductor_configs)
    assert "self.cache_results" in inspect.getsource(Autotuner.__init__)
    assert callable(compat.original("torchtitan.distributed.fsdp:apply_fsdp_to_decoder"))
    # the instance patches' targets: what the class reads on the object
    from torch.optim.lr_scheduler import LambdaLR
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.protocols.module import Module

    assert "self.lr_lambdas" in inspect.getsource(LambdaLR.get_lr)
    assert "self.forward" in inspect.getsource(__import__("torch").nn.Module._call_impl)
    assert "self._skip_lm_head" in inspect.getsource(Decoder.forward)
    assert "state_shardings" in inspect.getsource(Module) and "_sharding_config" in inspect.getsource(Module)


@pytest.mark.parametrize("name", sorted({**compat.PRIVATE_NAMES, **compat.PRIVATE_OVERRIDES}))
def test_private_names_read_still_exist(name):
    holder, attr = _split(name)
    files, _why = {**compat.PRIVATE_NAMES, **compat.PRIVATE_OVERRIDES}[name]
    # an instance attribute (a module's _parameters) is there when its class's module sets it by name
    assert hasattr(holder, attr) or (inspect.isclass(holder)
                                     and f'"{attr}"' in inspect.getsource(inspect.getmodule(holder))), \
        f"{name} (read by {', '.join(files)}) is gone"


def _sources():
    for top in ("framework", "components", "toolkit"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if ROOT / "framework" / "compat" not in path.parents:
                yield path, ast.parse(path.read_text(), str(path))


def test_every_private_third_party_import_is_listed_in_compat():
    missing = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] in THIRD_PARTY:
                private_module = any(p.startswith("_") for p in node.module.split("."))
                for a in node.names:
                    name = f"{node.module}:{a.name}"
                    if (private_module or a.name.startswith("_")) and name not in compat.PRIVATE_NAMES:
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in THIRD_PARTY and any(p.startswith("_") for p in a.name.split(".")):
                        missing.append(f"{path.relative_to(ROOT)}:{node.lineno} import {a.name}")
    assert not missing, "private third-party names not in compat.PRIVATE_NAMES (or patched outside compat):\n" \
        + "\n".join(missing)


def test_no_module_outside_compat_patches_a_third_party_module_or_class():
    """An assignment to an attribute of a name imported from a third-party package (a module, class
    or function of it), or setattr on one, is a patch: it belongs in framework/compat/."""
    found = []
    for path, tree in _sources():
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mod = getattr(node, "module", None) or ""
                for a in node.names:
                    top = (a.name if isinstance(node, ast.Import) else mod).split(".")[0]
                    if top in THIRD_PARTY and not getattr(node, "level", 0):
                        imported.add((a.asname or a.name).split(".")[0])
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                    and node.args:
                targets = [ast.Attribute(value=node.args[0], attr="?")]
            for t in targets:
                base = t
                while isinstance(base, ast.Attribute):
                    base = base.value
                if t is not base and isinstance(base, ast.Name) and base.id in imported:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(t)}")
    assert not found, "patches of third-party internals outside framework/compat/:\n" + "\n".join(found)


def test_hydra_internal_is_imported_only_by_compat():
    found = [f"{p.relative_to(ROOT)}:{n.lineno}" for p, tree in _sources() for n in ast.walk(tree)
             if isinstance(n, (ast.Import, ast.ImportFrom)) and "hydra._internal" in ast.unparse(n)]
    assert not found, found


# ---------------------------------------------------------------------------- idempotence
def _unpatched(monkeypatch, name):
    """Put ``name``'s targets back to the library's own (restored after the test) and forget what
    compat recorded, so the test sees a first application."""
    monkeypatch.setattr(compat_originals, "_ORIGINALS", dict(compat_originals._ORIGINALS))
    for target in compat.TARGETS[name]:
        holder, attr = _split(target)
        monkeypatch.setattr(holder, attr, compat.original(target))
        compat_originals._ORIGINALS.pop(target, None)


def _state(name):
    out = []
    for target in compat.TARGETS[name]:
        holder, attr = _split(target)
        out.append(getattr(holder, attr))
    return out


def _apply(name, monkeypatch):
    import torch
    from torchtitan.components.checkpointer import base

    fn = getattr(compat, name)
    if name == "patch_torch_cpu_module":
        for attr in ("current_device", "get_device_name", "get_device_properties", "reset_peak_memory_stats",
                     "empty_cache", "memory_stats", "max_memory_reserved", "manual_seed", "manual_seed_all"):
            monkeypatch.setattr(torch.cpu, attr, getattr(torch.cpu, attr, None), raising=False)
        monkeypatch.delattr(torch.cpu, "_apiary_shims", raising=False)
        return fn, ()
    if name == "plain_checkpoint_state_dict":
        monkeypatch.delattr(base.ModelWrapper, "_apiary_plain", raising=False)
        return fn, (lambda v: v, compat.original("torchtitan.components.checkpointer.base:_shares_storage"))
    args = {
        "set_cp_block_mask_load_balance": (True,),
        "hook_trainer_train": (lambda trainer: None,),
        "route_token_exchange": (lambda *a: None, lambda *a: None),
        "prune_autotune_configs": (lambda original: (lambda self, kwargs: original(self, kwargs)),),
        "lock_autotune_disk_cache": (lambda original: (lambda self, *a: original(self, *a)),),
        "set_autotuning_listener": (lambda **kw: None,),
        "route_broken_pipe": (lambda console: None,),
    }
    return fn, args.get(name, ())


@pytest.mark.parametrize("name", [n for n in PATCHES if n not in ("fsdp_wrappers_disabled", "compile_flex_attention",
                                                                   "plain_cuda_segments", "no_closing_sleep")])
def test_each_patch_is_idempotent(name, monkeypatch):
    _unpatched(monkeypatch, name)
    fn, args = _apply(name, monkeypatch)
    first_result = fn(*args)
    first = _state(name)
    assert fn(*args) == first_result
    second = _state(name)
    assert all(a is b or a == b for a, b in zip(first, second)), f"a second compat.{name}() changed its targets"


def test_flex_attention_recompiles_only_when_its_options_change(monkeypatch):
    from torchtitan.models.common.attention import FlexAttention

    from framework import devices

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", FlexAttention._compiled_flex_attn)
    monkeypatch.setattr(devices, "FLEX_COMPILE_OPTIONS", None)
    devices.set_flex_autotune(False)
    once = FlexAttention._compiled_flex_attn
    devices.set_flex_autotune(False)
    assert FlexAttention._compiled_flex_attn is once


def test_fsdp_wrappers_disabled_nests_and_puts_the_originals_back():
    import torchtitan.distributed.fsdp as fsdp

    own = fsdp.apply_fsdp_to_decoder
    with compat.fsdp_wrappers_disabled():
        assert fsdp.apply_fsdp_to_decoder is not own and fsdp.apply_fsdp_to_decoder(None) is None
        with compat.fsdp_wrappers_disabled():
            assert fsdp.apply_fsdp_to_decoder(None) is None
        assert fsdp.apply_fsdp_to_decoder is not own
    assert fsdp.apply_fsdp_to_decoder is own


# ---------------------------------------------------------------------------- the one clip_grad_norm_ wrapper
def test_clip_grad_norm_is_wrapped_once_and_records_the_norm(monkeypatch):
    import torch
    from torchtitan.distributed import utils as dist_utils

    _unpatched(monkeypatch, "patch_clip_grad_norm")
    torchtitan_clip = dist_utils.clip_grad_norm_
    monkeypatch.setattr(torchtitan_patches, "LAST_GRAD_NORM", [None])
    compat.patch_clip_grad_norm()  # the trainer's call
    wrapper = dist_utils.clip_grad_norm_
    compat.patch_clip_grad_norm()  # a state backend's call
    assert dist_utils.clip_grad_norm_ is wrapper and compat.original(
        "torchtitan.distributed.utils:clip_grad_norm_") is torchtitan_clip

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    norm = dist_utils.clip_grad_norm_([p], 1.0)
    assert torch.isclose(norm, torch.tensor(6.0)) and torchtitan_patches.LAST_GRAD_NORM[0] is norm
    assert torch.allclose(p.grad, torch.full((4,), 0.5), atol=1e-5)  # torchtitan's clipping ran

    class Owner:
        def clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite):
            self.args = (max_norm, norm_type, error_if_nonfinite)
            return torch.tensor(42.0)

    owner = Owner()
    contracts.own_gradients(p, clip=owner)
    norm = dist_utils.clip_grad_norm_((q for q in [p]), 2.0, foreach=True)
    assert float(norm) == 42.0 and torchtitan_patches.LAST_GRAD_NORM[0] is norm and owner.args == (2.0, 2.0, False)

    class Scaler:  # GRAD_SCALE_OWNER: torchtitan's norm, the gradients left unscaled for the owner
        def scale_grads_(self, max_norm, total_norm):
            self.args = (max_norm, total_norm)

    q = torch.nn.Parameter(torch.ones(4))
    q.grad = torch.full((4,), 3.0)
    scaler = Scaler()
    contracts.own_gradients(q, scale=scaler)
    norm = dist_utils.clip_grad_norm_([q], 1.0)
    assert torch.isclose(norm, torch.tensor(6.0)) and scaler.args == (1.0, norm)
    assert torchtitan_patches.LAST_GRAD_NORM[0] is norm
    assert torch.equal(q.grad, torch.full((4,), 3.0))  # not scaled on the device
    assert torch.nn.utils.clip_grads_with_norm_ is compat.original("torch.nn.utils:clip_grads_with_norm_")


# ------------------------------------------------------------------ instance-level patches
class _Container:
    def __init__(self):
        self.calls = []

    def step(self, *args, **kwargs):
        self.calls.append("own")
        return "own"

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.calls.append(("log", step, extra_metrics))

    def dcp_save(self, *args, **kwargs):
        self.calls.append("dcp_save")

    def save(self, curr_step, last_step=False):
        self.calls.append(("save", curr_step))


def test_instance_patches_change_the_object_once_and_never_its_class():
    from types import SimpleNamespace

    trainer = SimpleNamespace(optimizers=_Container(), lr_schedulers=_Container())
    seen = []

    def guard(original, *a, **k):
        seen.append("guard")
        return original(*a, **k)

    first = compat.guard_trainer_steps(trainer, guard, guard)
    again = compat.guard_trainer_steps(trainer, guard, guard)  # a second trainer build on the same objects
    assert again == first and len(first) == 2
    assert trainer.optimizers.step() == "own" and seen == ["guard"]  # wrapped once, not twice
    trainer.lr_schedulers.step()
    assert seen == ["guard", "guard"] and trainer.optimizers.calls == ["own"]
    assert _Container.step is not trainer.optimizers.step and "step" not in vars(_Container()).keys()

    ck = _Container()
    saved = []
    originals = compat.wrap_checkpoint_saves(ck, lambda *a, **k: saved.append("atomic dcp"),
                                             lambda *a, **k: saved.append("atomic save"))
    assert compat.wrap_checkpoint_saves(ck, None, None) == originals
    ck.dcp_save({}, "id", None)
    ck.save(2)
    assert saved == ["atomic dcp", "atomic save"] and ck.calls == []
    originals[1](5)
    assert ck.calls == [("save", 5)]
    seen_saves = []
    compat.observe_checkpoint_saves(ck, lambda step, written: seen_saves.append((step, written)))
    compat.wrap_checkpoint_saves(ck, None, None)  # already below: not wrapped again
    compat.observe_checkpoint_saves(ck, lambda *a: seen_saves.append("twice"))
    ck.save(7)
    assert saved[-1] == "atomic save" and seen_saves == [(7, None)]

    loop = SimpleNamespace(should_continue_training=lambda: True)
    compat.gate_training_loop(loop, lambda original: original() and False)
    compat.gate_training_loop(loop, lambda original: True)
    assert loop.should_continue_training() is False


def test_no_module_outside_compat_replaces_a_method_of_a_library_object():
    """``obj.step = ...`` on an object torchtitan built (optimizers, schedulers, the metrics processor,
    the checkpointer) is an instance-level patch: it goes through compat's functions above."""
    methods = {t.rsplit(".", 1)[1] for n in INSTANCE_PATCHES for t in compat.TARGETS[n]}
    found = []
    for path, tree in _sources():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in methods
                      and not (isinstance(t.value, ast.Name) and t.value.id == "self")]  # own state (a step count)
    assert not found, "methods of library objects replaced outside framework/compat/:\n" + "\n".join(found)


def test_the_new_instance_patches_change_one_object_once():
    import dataclasses
    from types import SimpleNamespace

    import torch

    calls = []
    box = _Container()
    box.load_state_dict = lambda sd: calls.append(("load", sd))
    compat.after_state_load(box, lambda: calls.append("then"))
    compat.after_state_load(box, lambda: calls.append("twice"))
    box.load_state_dict({"a": 1})
    assert calls == [("load", {"a": 1}), "then"]
    compat.after_state_load([], lambda: None)  # a plain list: left alone

    d = SimpleNamespace(combine=lambda *a: "own")
    assert compat.replace_token_combine(d, lambda original: (lambda *a: "lean:" + original(*a))) is True
    assert compat.replace_token_combine(d, lambda original: (lambda *a: "again")) is False
    assert d.combine(1, 2, 3) == "lean:own"

    @dataclasses.dataclass
    class Sc:
        state_shardings: dict

    m = SimpleNamespace(_sharding_config=Sc({"w": "shard0"}))
    compat.add_state_shardings(m, ["lora_A", "lora_B"], "w")
    assert m._sharding_config.state_shardings == {"w": "shard0", "lora_A": "shard0", "lora_B": "shard0"}

    dec = SimpleNamespace(_skip_lm_head=False)
    with compat.hidden_states_only(dec):
        assert dec._skip_lm_head is True
    assert dec._skip_lm_head is False

    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - 0.1 * s)
    compat.hold_final_rate(sch, 3)
    compat.hold_final_rate(sch, 1)  # held already: unchanged
    assert [f(s) for f in sch.lr_lambdas for s in (2, 3, 9)] == pytest.approx([0.8, 0.7, 0.7])

    lin = torch.nn.Linear(2, 2)
    with compat.module_forward(lin, lambda x: "head"):
        assert lin(torch.ones(2)) == "head"
    assert "forward" not in lin.__dict__ and lin(torch.ones(2)).shape == (2,)
