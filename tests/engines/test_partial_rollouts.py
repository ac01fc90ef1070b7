"""Partial rollouts in the HF engine: a weight update that lands between two decoding steps of a generate
call either lets the rows decode on with the new weights, each token recording the version that produced it
(``keep``), or stops them (``abort``)."""

from __future__ import annotations

import threading

import pytest
import torch

from engines.inference.hf import HFInferenceEngine
from engines.types import SamplingParams
from engines.weight_sync import pack_buckets

PROMPTS = ["1+2=", "3+4=", "10+20=", "7+8="]
STEPS = 6


class UpdatedAtStep(HFInferenceEngine):
    """Applies ``update()`` just before its ``at``-th forward pass of a generate call (1: the prefill), on the
    generating thread: deterministically between two decoding steps."""

    at, update = 0, None

    def _step(self):
        self.forwards = getattr(self, "forwards", 0) + 1
        if self.forwards == self.at:
            self.update()
        return super()._step()


def _new_weights(engine: HFInferenceEngine):
    """Buckets of the engine's weights, each moved by a little noise (seed 0)."""
    generator = torch.Generator().manual_seed(0)
    moved = [(name, p.detach() + 0.05 * torch.randn(p.shape, generator=generator)) for name, p in engine.model.named_parameters()]
    return pack_buckets(moved, 1 << 20)


def _engine(tiny_model_dir, at: int) -> UpdatedAtStep:
    engine = UpdatedAtStep(tiny_model_dir)
    buckets = _new_weights(engine)
    engine.at, engine.update = at, lambda: engine.update_weights(1, buckets)
    return engine


def _sampling(on_update: str) -> SamplingParams:
    # no stop token: every row decodes all STEPS tokens unless the update stops it
    return SamplingParams(max_new_tokens=STEPS, temperature=1.0, seed=3, stop_token_ids=(10**9,), on_weight_update=on_update)


def test_keep_decodes_on_with_the_new_weights_and_records_each_tokens_version(tiny_model_dir):
    plain = HFInferenceEngine(tiny_model_dir).generate(PROMPTS, _sampling("keep"))
    engine = _engine(tiny_model_dir, at=3)  # forwards 1 (prefill) and 2 give tokens 0 and 1 with v0
    out = engine.generate(PROMPTS, _sampling("keep"))
    assert out.weights_version == 0 and engine.weights_version() == 1
    assert out.token_versions.tolist() == [[0, 0, 1, 1, 1, 1]] * len(PROMPTS)
    assert out.finish_reasons == ["length"] * len(PROMPTS)
    # tokens 0-1 as without an update (same seed, same weights); from token 2 the new weights' logprobs
    torch.testing.assert_close(out.logprobs[:, :2], plain.logprobs[:, :2], rtol=0, atol=0)
    assert torch.equal(out.response_ids[:, :2], plain.response_ids[:, :2])
    assert not torch.equal(out.logprobs[:, 2:], plain.logprobs[:, 2:])
    # a call without an update records no versions
    again = engine.generate(PROMPTS, _sampling("keep"))
    assert again.token_versions is None and again.weights_version == 1


def test_abort_stops_the_rows_still_decoding(tiny_model_dir):
    engine = _engine(tiny_model_dir, at=3)
    out = engine.generate(PROMPTS, _sampling("abort"))
    assert out.finish_reasons == ["abort"] * len(PROMPTS)
    assert out.response_lengths.tolist() == [2] * len(PROMPTS)  # the tokens of v0, nothing after
    assert out.token_versions is None and out.weights_version == 0


@pytest.mark.invariant
def test_updates_from_another_thread_land_between_steps(tiny_model_dir):
    # A threaded actor's case: generations and updates on two threads, timing left to the scheduler.
    engine = HFInferenceEngine(tiny_model_dir)
    buckets = _new_weights(engine)
    outs, errors = [], []

    def generate():
        try:
            for seed in range(6):
                outs.append(engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, seed=seed, stop_token_ids=(10**9,))))
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    thread = threading.Thread(target=generate)
    thread.start()
    version = 0
    while thread.is_alive():  # updates keep landing while the calls decode
        version += 1
        engine.update_weights(version, buckets)
    thread.join()
    assert not errors and len(outs) == 6
    assert any(out.token_versions is not None for out in outs)
    for out in outs:
        versions = out.token_versions if out.token_versions is not None else torch.full(out.response_ids.shape, out.weights_version)
        assert (versions[:, 0] == out.weights_version).all()
        assert (versions[:, 1:] >= versions[:, :-1]).all()  # never older than the token before
        assert (versions[0] == versions).all()  # the rows of a call decode in step: the same version per step


def test_joined_rollouts_keep_each_rows_token_versions(tiny_model_dir):
    from engines.batches import concat_rollouts

    engine = _engine(tiny_model_dir, at=3)
    partial = engine.generate(PROMPTS[:2], _sampling("keep"))  # tokens 0-1 from v0, then v1
    whole = engine.generate(PROMPTS[2:], _sampling("keep"))  # all v1
    joined = concat_rollouts([partial, whole], [[1], [0, 1]])
    assert joined.weights_version == 0  # the oldest weights that sampled a row
    assert joined.token_versions.tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6, [1] * 6]
