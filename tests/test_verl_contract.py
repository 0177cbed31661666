"""verl backend, API contract: every verl call the backend makes still has the signature it uses.

verl's API moves between minor releases (workers removed in 0.9, `trainer=` renamed `actor_wg=`);
an upgrade must fail here, loudly, rather than deep inside a Ray worker.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import verl
from verl import DataProto
from verl.plugin.platform import PlatformBase, set_platform
from verl.protocol import pad_dataproto_to_divisor
from verl.single_controller.base.decorator import make_nd_compute_dataproto_dispatch_fn, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.trainer.ppo.core_algos import agg_loss, get_adv_estimator_fn, get_policy_loss_fn
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.utils.metric import reduce_metrics
from verl.workers.config import TrainingWorkerConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from backends.verl.config import VERL_VERSION

# (callable, the leading parameter names the backend relies on, in order)
SIGNATURES: list[tuple[Callable[..., Any], list[str]]] = [
    (TrainingWorker.__init__, ["self", "config"]),
    (TrainingWorker.reset, ["self"]),
    (TrainingWorker.set_loss_fn, ["self", "loss_fn"]),
    (TrainingWorker.train_mini_batch, ["self", "data"]),
    (TrainingWorker.infer_batch, ["self", "data"]),
    (
        TrainingWorker.save_checkpoint,
        ["self", "local_path", "hdfs_path", "global_step", "max_ckpt_to_keep"],
    ),
    (TrainingWorker.load_checkpoint, ["self", "local_path", "hdfs_path", "del_local_after_load"]),
    (FSDPEngine.get_per_tensor_param, ["self"]),
    (
        RayResourcePool.__init__,
        ["self", "process_on_nodes", "use_gpu", "name_prefix", "max_colocate_count"],
    ),
    (RayClassWithInitArgs.__init__, ["self", "cls", "args", "kwargs"]),
    (RayWorkerGroup.__init__, ["self", "resource_pool", "ray_cls_with_init"]),
    (register, ["dispatch_mode", "execute_mode", "blocking", "materialize_futures"]),
    (make_nd_compute_dataproto_dispatch_fn, ["mesh_name"]),
    (ppo_loss, ["config", "model_output", "data", "dp_group"]),
    (get_policy_loss_fn, ["name"]),
    (get_adv_estimator_fn, ["name_or_enum"]),
    (agg_loss, ["loss_mat", "loss_mask", "loss_agg_mode", "dp_size", "batch_num_tokens"]),
    (left_right_2_no_padding, ["data"]),
    (no_padding_2_padding, ["tensor", "data"]),
    (pad_dataproto_to_divisor, ["data", "size_divisor"]),
    (DataProto.from_dict, ["tensors", "non_tensors", "meta_info"]),
    (DataProto.to_tensordict, ["self"]),
    (tu.assign_non_tensor, ["tensor_dict", "kwargs"]),
    (tu.get, ["tensordict", "key", "default"]),
    (tu.pop, ["tensordict", "key", "default"]),
    (validate_config, ["config", "use_reference_policy", "use_critic"]),
    (need_critic, ["config"]),
    (need_reference_policy, ["config"]),
    (omega_conf_to_dataclass, ["config"]),
    (reduce_metrics, ["metrics"]),
    (set_platform, ["platform"]),
]


def test_verl_is_the_pinned_version() -> None:
    assert verl.__version__ == VERL_VERSION, "the verl backend is pinned; re-check this file"


@pytest.mark.parametrize(
    ("function", "names"), SIGNATURES, ids=[f.__qualname__ for f, _ in SIGNATURES]
)
def test_verl_call_keeps_its_signature(function: Callable[..., Any], names: list[str]) -> None:
    found = list(inspect.signature(inspect.unwrap(function)).parameters)
    assert found[: len(names)] == names, f"{function.__qualname__}{inspect.signature(function)}"


def test_training_worker_config_has_the_fields_the_backend_sets() -> None:
    fields = {f.name for f in dataclasses.fields(TrainingWorkerConfig)}
    wanted = {
        "model_type",
        "model_config",
        "engine_config",
        "optimizer_config",
        "checkpoint_config",
        "profiler_config",
    }
    assert wanted <= fields, f"missing: {wanted - fields}"


def test_worker_group_still_reads_device_name_and_worker_env_keywords() -> None:
    source = inspect.getsource(RayWorkerGroup.__init__)
    for keyword in ('"device_name"', '"worker_env"'):
        assert keyword in source, f"RayWorkerGroup no longer reads {keyword}"


def test_cpu_platform_implements_every_abstract_platform_method() -> None:
    from backends.verl.cpu_platform import CPUPlatform

    abstract = {n for n, v in vars(PlatformBase).items() if getattr(v, "__isabstractmethod__", 0)}
    assert not inspect.isabstract(CPUPlatform), (
        f"unimplemented: {abstract - set(vars(CPUPlatform))}"
    )
    platform = CPUPlatform()
    assert (platform.device_name, platform.communication_backend_name()) == ("cpu", "gloo")
