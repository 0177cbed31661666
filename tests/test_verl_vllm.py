"""The verl backend sampling on vLLM (`verl.engine: vllm`): verl's CPU workers train, their
weights go to the real vLLM engine at every sync, and vLLM then samples what the workers score."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.verl.backend import VerlBackend
from tests.test_verl_backend import countdown_config, max_gap, rollout_groups, sampled
from torchkit.vllm_engine import VllmSampler

pytest.importorskip("vllm")

VLLM = {"kv_cache_gb": 0.25, "max_num_seqs": 16}


async def test_verl_workers_weights_reach_vllm_which_samples_what_they_score(
    tmp_path: Path,
) -> None:
    config = countdown_config(
        tmp_path, verl={"num_workers": 1, "forward_batch_size": 4, "engine": "vllm", "vllm": VLLM}
    )
    backend = VerlBackend()
    await backend.setup(config)
    try:
        assert isinstance(backend.sampler, VllmSampler)
        before = await rollout_groups(backend, seed=1)
        assert max_gap(await backend.score(before), sampled(before)) < 1e-4, (
            "vLLM samples the workers' starting weights"
        )
        await backend.forward_backward(before)
        await backend.optim_step()
        await backend.on_policy_updated(1)
        after = await rollout_groups(backend, seed=2)
        versions = {
            e.trajectories[0].steps[0].output.policy_version for g in after for e in g.episodes
        }
        assert versions == {1}, "sampled on the synced weights"
        assert max_gap(await backend.score(after), sampled(after)) < 1e-4, (
            "after the sync vLLM samples the trained weights: its logprobs are the workers'"
        )
        moved = max_gap(await backend.score(before), sampled(before))
        assert moved > 1e-3, "the update changed the policy (else the check above proves nothing)"
        checkpoint = tmp_path / "checkpoint"
        checkpoint.mkdir()
        await backend.save_checkpoint(checkpoint)
        await backend.load_checkpoint(checkpoint)
        assert backend.sampler.version == 1, "the checkpoint restores vLLM's weights and version"
        again = await rollout_groups(backend, seed=3)
        assert max_gap(await backend.score(again), sampled(again)) < 1e-4
    finally:
        await backend.shutdown()
