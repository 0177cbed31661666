"""verl backend on a GPU: the FSDP2 workers on NCCL and the sampler on the GPU (needs CUDA).

`bash bench/gpu/run_gpu_check.sh ... test` runs these on the device machine
(docs/backends/verl.md, "GPU check: how to run it"); everywhere else they are skipped.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.verl.backend import VerlBackend
from tests.test_verl_backend import countdown_config, max_gap, rollout_groups, sampled
from unified import UnifiedTrainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


async def test_weight_sync_on_the_gpu_makes_the_sampler_score_like_the_workers(
    tmp_path: Path,
) -> None:
    config = countdown_config(
        tmp_path, verl={"device": "cuda", "num_workers": 1, "param_dtype": "fp32"}
    )
    backend = VerlBackend()
    await backend.setup(config)
    try:
        groups = await rollout_groups(backend, seed=1)
        await backend.forward_backward(groups)
        await backend.optim_step()
        await backend.on_policy_updated(1)
        after = await rollout_groups(backend, seed=2)
        assert max_gap(await backend.score(after), sampled(after)) < 1e-3, (
            "after the sync the GPU sampler scores like the GPU workers"
        )
        # The pinned, asynchronous staging on the GPU: a bf16 sync is the master weights cast.
        full = backend.group.export_weights(backend.tied)
        halved = backend.group.export_weights(backend.tied, torch.bfloat16)
        assert all(torch.equal(halved[n], full[n].to(torch.bfloat16)) for n in full)
    finally:
        await backend.shutdown()


def test_countdown_trains_on_the_gpu_in_bf16_with_the_kl_reference_and_checkpoints(
    tmp_path: Path,
) -> None:
    # verl's GPU defaults: bf16 mixed precision, torch.compile, the reference offloaded to pinned
    # host memory; the trainer's own loop around them.
    config = countdown_config(tmp_path, verl={"device": "cuda", "num_workers": 1})
    config.trainer.kl_coef = 0.05
    result = UnifiedTrainer(config).fit()

    assert result.steps == 2
    for key in ("train/loss", "train/kl_reference", "time/sync"):
        assert key in result.metrics, f"{key} missing from the last step's metrics"
    assert result.metrics["train/grad_norm"] > 0, "the GPU worker computed a gradient"
    actor = result.run_dir / "checkpoints" / "step_000002" / "backend" / "global_step_2" / "actor"
    assert (actor / "model_world_size_1_rank_0.pt").exists(), "verl's checkpoint shard on disk"
