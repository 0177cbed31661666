"""verl backend on a GPU: the FSDP2 workers on NCCL and the sampler on the GPU (needs CUDA)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends.verl.backend import VerlBackend
from tests.test_verl_backend import countdown_config, max_gap, rollout_groups, sampled

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
    finally:
        await backend.shutdown()
