"""The performance paths against their reference forms: compacting generation vs plain padded
``model.generate``, packed vs padded logprobs and training steps, shared-memory vs bucket weight sync."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from engines.algorithms.objective import SFTObjective
from engines.data.sft import sft_batch
from engines.inference.hf import HFInferenceEngine
from engines.training.logprobs import pack_sequences, packed_token_logprobs, token_logprobs
from engines.training.torch import OptimSpec, TorchTrainEngine
from engines.types import SamplingParams
from engines.weight_sync import SHM_DIR, SharedWeightReader, SharedWeightWriter, weights_checksum

PROMPTS = ["12+3=", "1+1=", "29+30=", "7+8=", "3="]


def test_greedy_generation_equals_padded_model_generate(tiny_model_dir):
    """Rows leave the batch as they stop and groups share one prefill; the tokens must be exactly those of
    HF's padded greedy ``generate`` row by row (which keeps computing finished rows)."""
    engine = HFInferenceEngine(tiny_model_dir)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an untrained model repeats one token; noise makes rows differ
        for param in engine.model.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=gen))
    prompts = [p for p in PROMPTS for _ in range(3)]  # groups of identical prompts, different prompt lengths
    tok = engine.tokenizer
    free = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0))
    # stop at a token that some rows produce and others do not, at different steps
    counts = torch.bincount(free.response_ids[:, 1:].flatten(), minlength=len(tok))
    stop = int(counts.argmax())
    stops = (tok.eos_token_id, stop)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=stops))
    assert len(set(out.response_lengths.tolist())) > 1  # rows stopped at different steps: compaction ran
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        ref = engine.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                    eos_token_id=list(stops), pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        ends = [k for k, t in enumerate(ref) if t in stops]
        if ends:
            ref = ref[: ends[0] + 1]
        n = int(out.response_lengths[i])
        assert out.response_ids[i, :n].tolist() == ref, prompt
        assert out.finish_reasons[i] == ("stop" if ref[-1] in stops else "length")


def test_sampled_generation_is_seeded_and_padded_past_length(tiny_model_dir):
    engine = HFInferenceEngine(tiny_model_dir)
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
    out = engine.generate(PROMPTS * 4, sampling)
    again = engine.generate(PROMPTS * 4, sampling)
    assert torch.equal(out.response_ids, again.response_ids) and torch.equal(out.logprobs, again.logprobs)
    assert out.response_ids.shape[1] == int(out.response_lengths.max())
    for i in range(len(out.completions)):
        n = int(out.response_lengths[i])
        assert (out.response_ids[i, n:] == engine.tokenizer.pad_token_id).all() and (out.logprobs[i, n:] == 0).all()


def _batch(seed=0, rows=9, width=14, vocab=30):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width) < lengths[:, None]).long()
    ids = torch.randint(2, vocab, (rows, width), generator=gen) * mask
    response = ((torch.arange(width) >= 2) & mask.bool()).float()
    return ids, mask, response


def test_pack_sequences_places_every_token_once_without_overlap():
    ids, mask, response = _batch()
    packed = pack_sequences(ids, mask, response)
    rows, width = packed.input_ids.shape
    assert width == int(mask.sum(-1).max()) and rows < ids.shape[0]  # fewer rows than the padded batch
    assert (packed.input_ids != 0).sum() == (ids != 0).sum()  # every real token once
    # each needed token's logit position holds the token before it, in the packed row
    r, c = packed.logit_index
    br, bc = packed.target_index
    assert torch.equal(packed.input_ids[r, c], ids[br, bc - 1]) and torch.equal(packed.input_ids[r, c + 1], ids[br, bc])
    assert torch.equal(packed.position_ids[r, c + 1], bc)  # positions restart per sequence


def _grouped_batch(seed=0, groups=3, group_size=4, vocab=30):
    """GRPO-shaped rows: ``groups`` prompts (lengths 3-7) each with ``group_size`` responses (lengths 1-8)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(groups):
        prompt = torch.randint(2, vocab, (int(torch.randint(3, 8, (), generator=gen)),), generator=gen)
        for _ in range(group_size):
            rows.append((prompt, torch.randint(2, vocab, (int(torch.randint(1, 9, (), generator=gen)),), generator=gen)))
    width = max(len(p) + len(r) for p, r in rows)
    ids, mask, response = (torch.zeros(len(rows), width, dtype=torch.long), torch.zeros(len(rows), width, dtype=torch.long),
                           torch.zeros(len(rows), width))
    for i, (p, r) in enumerate(rows):
        ids[i, :len(p) + len(r)] = torch.cat([p, r])
        mask[i, :len(p) + len(r)] = 1
        response[i, len(p):len(p) + len(r)] = 1
    return ids, mask, response


def test_shared_prompt_packing_keeps_one_prompt_per_group():
    ids, mask, response = _grouped_batch()
    packed = pack_sequences(ids, mask, response, share_prefixes=True)
    prompt_tokens = int((mask - response).sum())
    assert packed.attention_mask is not None and packed.attention_mask.shape[1:] == (1, *[packed.input_ids.shape[1]] * 2)
    assert (packed.input_ids != 0).sum() == mask.sum() - prompt_tokens * 3 // 4  # 3 of each 4 prompt copies gone
    r, c = packed.logit_index
    br, bc = packed.target_index
    assert torch.equal(packed.input_ids[r, c], ids[br, bc - 1])  # the logit position holds the token before
    assert torch.equal(packed.position_ids[r, c], bc - 1)  # at its unshared position
    # each token sees exactly as many tokens as in its unshared row: its prompt and its own response
    lengths, prompt = mask.sum(-1), int((mask - response)[0].sum())
    tails = (packed.input_ids.shape[1] - (packed.input_ids != 0).sum(-1)).tolist()
    expected = sum(n * (n + 1) // 2 for n in lengths.tolist()) + sum(t * (t + 1) // 2 for t in tails)
    expected -= sum(3 * p * (p + 1) // 2 for p in (mask - response)[::4].sum(-1).tolist())
    assert int((packed.attention_mask == 0).sum()) == expected and prompt > 0
    # without repeated prompts nothing is shared: plain position-separated packing
    assert pack_sequences(*_batch(), share_prefixes=True).attention_mask is None


def _placement_by_loop(input_ids, lengths, segments, place, sizes, width, rooms):
    """The reference of ``pack_sequences``' vectorised placement: token by token, segment by segment."""
    rows_out = len(rooms)
    packed_ids = torch.zeros((rows_out, width), dtype=torch.long)
    positions, branch, segment_of = (torch.zeros((rows_out, width), dtype=torch.long) for _ in range(3))
    packed_row, packed_col = torch.zeros(len(lengths), dtype=torch.long), torch.zeros(input_ids.shape, dtype=torch.long)
    for s, ((prefix, rows), (row, offset)) in enumerate(zip(segments, place)):
        packed_ids[row, offset:offset + prefix] = input_ids[rows[0], :prefix]
        positions[row, offset:offset + prefix] = torch.arange(prefix)
        segment_of[row, offset:offset + sizes[s]] = s + 1
        cursor = offset + prefix
        for i in rows:
            own = lengths[i] - prefix
            packed_ids[row, cursor:cursor + own] = input_ids[i, prefix:lengths[i]]
            positions[row, cursor:cursor + own] = torch.arange(prefix, lengths[i])
            branch[row, cursor:cursor + own] = i + 1
            packed_row[i] = row
            packed_col[i, :prefix] = torch.arange(offset, offset + prefix)
            packed_col[i, prefix:lengths[i]] = torch.arange(cursor, cursor + own)
            cursor += own
    for row, room in enumerate(rooms):
        positions[row, width - room:] = torch.arange(room)
    return packed_ids, positions, branch, segment_of, packed_row, packed_col


@pytest.mark.parametrize("share, segment_width", [(False, 512), (True, 512), (True, 0)])  # 0: groups cut into several segments
def test_pack_sequences_places_tokens_as_the_token_by_token_loop(share, segment_width, monkeypatch):
    from engines.training import logprobs

    monkeypatch.setattr(logprobs, "SHARED_SEGMENT_WIDTH", segment_width)
    for seed in range(6):
        ids, mask, response = _grouped_batch(seed, groups=4, group_size=5) if seed % 2 else _batch(seed, rows=11)
        packed = pack_sequences(ids, mask, response, share_prefixes=share)
        lengths = mask.sum(-1).tolist()
        needed = response.bool().clone()
        needed[:, 0] = False
        prefixes = torch.where(needed.any(-1), needed.int().argmax(-1), 0).tolist()
        segments = logprobs._prompt_segments(ids, lengths, prefixes, share)
        if share and seed % 2:
            assert any(len(rows) > 1 for _, rows in segments)  # the case under test: prompts shared
        if segment_width == 0 and seed % 2:
            assert len(segments) > 4  # and groups cut at the longest sequence
        # segments placed as pack_sequences places them; then the loop places their tokens
        sizes = [prefix + sum(lengths[i] - prefix for i in rows) for prefix, rows in segments]
        width, place, rooms = logprobs._place_segments(sizes)
        packed_ids, positions, branch, segment_of, packed_row, packed_col = _placement_by_loop(
            ids, lengths, segments, place, sizes, width, rooms)
        assert torch.equal(packed.input_ids, packed_ids) and torch.equal(packed.position_ids, positions)
        rows, cols = needed.nonzero(as_tuple=True)
        assert torch.equal(packed.logit_index[0], packed_row[rows]) and torch.equal(packed.logit_index[1], packed_col[rows, cols - 1])
        if packed.attention_mask is not None:  # the mask is built from branch and segment ids: same ids, same mask
            assert torch.equal(packed.attention_mask[:, 0] == 0, logprobs._allowed_attention(segment_of, branch))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_prompt_logprobs_entropy_and_gradients_match_padded(tiny_model_dir, temperature):
    from engines.models import load_model

    model = load_model(tiny_model_dir)
    ids, mask, response = _grouped_batch(vocab=len(HFInferenceEngine(tiny_model_dir).tokenizer))
    ref_lp, ref_h = token_logprobs(model, ids, mask, temperature=temperature, with_entropy=True)
    lp, h = packed_token_logprobs(model, ids, mask, response, temperature=temperature, with_entropy=True,
                                  share_prefixes=True)
    assert ((ref_lp - lp) * response).abs().max() < 1e-5 and ((ref_h - h) * response).abs().max() < 1e-5
    grads = []
    for loss in ((ref_lp + ref_h) * response).sum(), (lp + h).sum():
        model.zero_grad()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    assert max((a - b).abs().max() for a, b in zip(*grads)) < 1e-4


def test_packed_logprobs_and_entropy_match_padded(tiny_model_dir):
    from engines.models import load_model

    model = load_model(tiny_model_dir)
    ids, mask, response = _batch(vocab=len(HFInferenceEngine(tiny_model_dir).tokenizer))
    ref_lp, ref_h = token_logprobs(model, ids, mask, temperature=0.7, with_entropy=True)
    lp, h = packed_token_logprobs(model, ids, mask, response, temperature=0.7, with_entropy=True)
    assert ((ref_lp - lp) * response).abs().max() < 1e-5 and ((ref_h - h) * response).abs().max() < 1e-5
    assert (lp * (1 - response)).abs().max() == 0  # only response tokens are computed


def test_packed_train_step_matches_padded(tiny_model_dir):
    """Same loss, gradient norm and updated weights with and without packing (float rounding apart)."""
    engines = [TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), micro_batch_size=3, packing=p) for p in (False, True)]
    batch = sft_batch(tiny_model_dir, ["12+3=", "1+1=", "29+30=", "7+8=", "5+5="], ["15", "2", "59", "15", "10"])
    metrics = [e.train_step(batch, SFTObjective()) for e in engines]
    assert abs(metrics[0]["sft/nll"] - metrics[1]["sft/nll"]) < 1e-5
    assert abs(metrics[0]["train/grad_norm"] - metrics[1]["train/grad_norm"]) < 1e-4
    # AdamW's first step moves each weight by about lr * g / |g|: float rounding of a near-zero gradient
    # can move its weight by a small fraction of lr (1e-4 here is 1% of lr = 1e-2), never by a whole step
    for (name, a), (_, b) in zip(engines[0].model.named_parameters(), engines[1].model.named_parameters()):
        assert (a - b).abs().max() < 1e-4, name


def test_shared_prompt_train_step_matches_padded(tiny_model_dir):
    """A GRPO-shaped batch (each prompt 4 times): same loss and updated weights with prompts shared."""
    engines = [TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), micro_batch_size=8, packing=p, share_prompts=p)
               for p in (False, True)]
    prompts, targets = ["12+3="] * 4 + ["29+30="] * 4, ["15", "1", "105", "5", "59", "9", "5", "599"]
    batch = sft_batch(tiny_model_dir, prompts, targets)
    metrics = [e.train_step(batch, SFTObjective()) for e in engines]
    assert abs(metrics[0]["sft/nll"] - metrics[1]["sft/nll"]) < 1e-5
    assert abs(metrics[0]["train/grad_norm"] - metrics[1]["train/grad_norm"]) < 1e-4
    for (name, a), (_, b) in zip(engines[0].model.named_parameters(), engines[1].model.named_parameters()):
        assert (a - b).abs().max() < 5e-5, name  # Adam's first step is ±lr wherever a gradient is ~0


def test_shared_memory_sync_alternates_slots_and_cleans_up(tiny_model_dir):
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), micro_batch_size=4)
    rollout = HFInferenceEngine(tiny_model_dir)
    with torch.no_grad():
        next(trainer.model.parameters()).add_(1.0)
    checksum_v1 = rollout.update_weights_shared(trainer.export_shared(1))
    assert checksum_v1 == trainer.weights_checksum()
    with torch.no_grad():
        next(trainer.model.parameters()).add_(1.0)
    shared_v2 = trainer.export_shared(2)  # written to the other slot: the rollout engine still serves v1
    assert trainer.exported_checksum() == trainer.weights_checksum()  # hashed while copying
    assert rollout.weights_checksum() == checksum_v1 and rollout.weights_version() == 1
    assert rollout.update_weights_shared(shared_v2) == trainer.weights_checksum() != checksum_v1
    assert rollout.update_weights_shared(None) is None  # nothing shared: the caller sends buckets
    # the bucket path gives the parameters their own memory back before copying into them
    with torch.no_grad():
        next(trainer.model.parameters()).add_(1.0)
    assert rollout.update_weights(3, trainer.export_weights()) == trainer.weights_checksum()
    bucket_checksum = rollout.weights_checksum()
    with torch.no_grad():
        next(trainer.model.parameters()).add_(1.0)
    trainer.export_shared(4)  # slot 0 again, which the engine pointed at before: its own copy must not change
    assert rollout.weights_checksum() == bucket_checksum and rollout.weights_version() == 3
    prefix = trainer._shared_writer.prefix
    trainer.close()
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(f"{prefix}{os.getpid()}-")]


def test_shared_reader_copies_across_dtypes_and_writer_removes_dead_files(tiny_model_dir):
    from engines.models import load_model

    source, target = load_model(tiny_model_dir), load_model(tiny_model_dir, dtype="bfloat16")
    stale = os.path.join(SHM_DIR, "rollflow-test-999999999-0")
    open(stale, "wb").close()
    writer = SharedWeightWriter("test")  # pid 999999999 is not alive: its file goes
    assert not os.path.exists(stale)
    try:
        SharedWeightReader().load(target, writer.write(0, source.named_parameters(), "local"))
        expected = load_model(tiny_model_dir, dtype="bfloat16")
        assert weights_checksum(target) == weights_checksum(expected)  # converted copy, not views
    finally:
        writer.close()


def test_checksum_sees_a_single_flipped_bit(tiny_model_dir):
    from engines.models import load_model

    model = load_model(tiny_model_dir)
    before = weights_checksum(model)
    param = next(model.parameters())
    with torch.no_grad():
        param.view(-1).view(torch.int32)[7] ^= 1
    assert weights_checksum(model) != before


def test_background_copy_hashes_on_the_way_and_the_reader_hashes_behind_it():
    """Above SERIAL_HASH_BYTES the copy splits into groups on threads; a reader started while the copy runs
    returns the same checksum as hashing the source, and a bit changed in the slot shows in it."""
    from concurrent.futures import ThreadPoolExecutor

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    source = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(5)])  # 20 MiB
    target = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(5)])
    writer = SharedWeightWriter("test-stream")
    try:
        shared = writer.write(1, source.named_parameters(), "local", background=True)
        assert len(shared.groups) == 2 and sorted(i for g in shared.groups for i in g) == list(range(len(shared.metas)))
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(SharedWeightReader().load, target, shared).result()
        assert received == writer.wait() == weights_checksum(source) == weights_checksum(target)
        assert all(torch.equal(a, b) for a, b in zip(source.parameters(), target.parameters()))

        shared = writer.write(2, source.named_parameters(), "local")
        slot = _slot_bytes(writer, shared)
        slot[shared.metas[3].offset + 5] ^= 1  # corrupted after the trainer hashed it
        assert SharedWeightReader().load(target, shared) != writer.wait()

        never = type(shared)(4, shared.path, "local", shared.metas, shared.nbytes, shared.groups)  # the slot holds v2
        with pytest.raises(TimeoutError, match="were not complete"):
            SharedWeightReader().load(target, never, timeout_s=0.05)
    finally:
        writer.close()
        torch.set_num_threads(threads)


def _slot_bytes(writer: SharedWeightWriter, shared) -> np.ndarray:
    """The bytes of the writer's slot that ``shared`` lies in."""
    return writer._slots[_slot_of(shared)].numpy()


def _slot_of(shared) -> int:
    return int(shared.path.rsplit("-", 1)[1])


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"weight": torch.full((16, 8), float(value)), "bias": torch.full((16,), float(value))}


def _receiver() -> torch.nn.ParameterDict:
    return torch.nn.ParameterDict({k: torch.nn.Parameter(torch.zeros(v.shape)) for k, v in _weights(0).items()})


def test_receivers_that_take_every_version_need_two_slots():
    writer, reader, receiver = SharedWeightWriter("test-lockstep"), SharedWeightReader(), _receiver()
    try:
        slots = []
        for version in range(1, 7):
            shared = writer.write(version, _weights(version).items(), "local")
            reader.load(receiver, shared)
            reader.check()
            slots.append(_slot_of(shared))
        assert slots == [0, 1, 0, 1, 0, 1] and receiver["bias"].detach()[0].item() == 6.0
    finally:
        writer.close()
        reader.close()


def test_a_receiver_left_behind_keeps_its_slot_and_is_released_when_it_moves_on():
    writer = SharedWeightWriter("test-behind")
    behind, current = (SharedWeightReader(), _receiver()), (SharedWeightReader(), _receiver())
    try:
        first = writer.write(1, _weights(1).items(), "local")
        for reader, receiver in (behind, current):
            reader.load(receiver, first)
        slots = []
        for version in range(2, 7):  # only `current` takes these
            shared = writer.write(version, _weights(version).items(), "local")
            current[0].load(current[1], shared)
            slots.append(_slot_of(shared))
        assert _slot_of(first) == 0 and 0 not in slots and set(slots) == {1, 2}  # a third slot, not v1's
        behind[0].check()  # v1's slot is intact: the receiver left behind still computes with v1
        assert behind[1]["weight"].detach()[0, 0].item() == 1.0 and writer.leased_versions() == {1, 6}
        behind[0].load(behind[1], shared)  # it moves on to the newest: v1's slot is free again
        assert writer.leased_versions() == {6}
        assert _slot_of(writer.write(7, _weights(7).items(), "local")) == 0
    finally:
        writer.close()
        for reader, _ in (behind, current):
            reader.close()


def test_weights_overwritten_under_a_receiver_fail_its_check_and_its_next_load():
    from dataclasses import replace

    writer, reader, receiver = SharedWeightWriter("test-overwrite"), SharedWeightReader(), _receiver()
    try:
        first = writer.write(1, _weights(1).items(), "local")
        reader.load(receiver, first)
        os.unlink(reader._lease.path)  # a receiver the writer cannot see
        writer.write(2, _weights(2).items(), "local")
        writer.write(3, _weights(3).items(), "local")  # into v1's slot, which nothing leases
        with pytest.raises(RuntimeError, match=r"weights v1 in .* were overwritten \(now v3\)"):
            reader.check()
        with pytest.raises(RuntimeError, match="overwritten by v3 before this receiver read them"):
            SharedWeightReader().load(_receiver(), replace(first, lease_prefix=""))
    finally:
        writer.close()
        reader.close()


def test_a_check_during_a_load_waits_for_it_instead_of_judging_a_slot_still_being_written():
    """A generate call that ends while a weight update loads (``partial_rollout: keep``) checks its slot on
    its own thread. The load holds the new version as soon as the parameters view its slot, while the
    writer may still be copying into it (header [0] is -1 until the copy ends): the check waits for the load
    instead of calling the slot overwritten."""
    writer, reader, receiver = SharedWeightWriter("test-race"), SharedWeightReader(), _receiver()
    try:
        reader.load(receiver, writer.write(1, _weights(1).items(), "local"))
        shared = writer.write(2, _weights(2).items(), "local")
        header = writer._slots[_slot_of(shared)][:8].numpy().view(np.int64)
        header[0] = -1  # the writer's copy has not ended yet
        load = threading.Thread(target=reader.load, args=(receiver, shared))
        load.start()
        while reader._held is not shared:  # the parameters view v2's slot; the load waits for the copy
            time.sleep(1e-3)
        errors = []
        check = threading.Thread(target=lambda: _raised(reader.check, errors))
        check.start()
        check.join(timeout=0.2)
        assert check.is_alive() and not errors  # waiting for the load, not judging the slot
        header[0] = 2  # the copy ends
        load.join(timeout=10)
        check.join(timeout=10)
        assert not load.is_alive() and not check.is_alive() and errors == []
        assert receiver["weight"].detach()[0, 0].item() == 2.0
    finally:
        writer.close()
        reader.close()


def _raised(call, errors: list) -> None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 (the test asserts there is none)
        errors.append(error)


def test_slots_run_out_only_when_receivers_hold_every_one_and_dead_leases_do_not_count():
    writer, readers = SharedWeightWriter("test-full"), []
    try:
        for version in range(1, 4):  # three receivers, each stuck on its own version
            readers.append(SharedWeightReader())
            readers[-1].load(_receiver(), writer.write(version, _weights(version).items(), "local"))
        writer.write(4, _weights(4).items(), "local")  # the newest: kept for receivers told to read it
        with pytest.raises(RuntimeError, match=r"all 4 shared-memory weight slots hold versions still in use"):
            writer.write(5, _weights(5).items(), "local")
        dead = os.path.join(SHM_DIR, f"{writer.lease_prefix}999999999-0")  # pid 999999999 is not alive
        np.array([7, -1], dtype=np.int64).tofile(dead)
        assert writer.leased_versions() == {1, 2, 3} and not os.path.exists(dead)
        readers.pop(0).close()  # v1's receiver is gone: its slot takes v5
        assert _slot_of(writer.write(5, _weights(5).items(), "local")) == 0
    finally:
        writer.close()
        for reader in readers:
            reader.close()


def test_the_hf_engine_refuses_to_return_generations_from_overwritten_weights(tiny_model_dir):
    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), micro_batch_size=4)
    rollout = HFInferenceEngine(tiny_model_dir)
    try:
        assert rollout.update_weights_shared(trainer.export_shared(1)) == trainer.exported_checksum()
        rollout.generate(["1+2="], SamplingParams(max_new_tokens=2))
        os.unlink(rollout._shared._lease.path)  # the trainer no longer sees that the engine reads v1
        for version in (2, 3):
            trainer.export_shared(version)
            trainer.exported_checksum()
        with pytest.raises(RuntimeError, match="were overwritten"):
            rollout.generate(["1+2="], SamplingParams(max_new_tokens=2))
    finally:
        trainer.close()


@pytest.mark.parametrize("with_strided", [False, True])
def test_repeated_syncs_into_a_slot_carry_changed_moved_and_strided_tensors(with_strided):
    """The writer reuses a slot's copy plan and the reader its views across syncs: in-place changes, a
    tensor replaced by another (new address) and a non-contiguous tensor all reach the receiver."""
    torch.manual_seed(0)
    tensors = {"weight": torch.randn(64, 32), "bias": torch.randn(64)}
    if with_strided:
        tensors["strided"] = torch.randn(32, 16).t()  # a byte view of it is a copy, made again every write
    receiver = torch.nn.ParameterDict({k: torch.nn.Parameter(torch.zeros(v.shape)) for k, v in tensors.items()})
    writer, reader = SharedWeightWriter("test-plans"), SharedWeightReader()
    try:
        for version in range(1, 8):
            checksum = reader.load(receiver, writer.write(version, tensors.items(), "local", background=version % 2 == 0))
            assert checksum == writer.wait() == weights_checksum(receiver)
            for name, tensor in tensors.items():
                assert torch.equal(receiver[name], tensor), (version, name)
            for tensor in tensors.values():
                tensor.add_(1.0)  # in place: same address
            if version == 4:
                tensors["bias"] = torch.randn(64)  # another tensor, at another address
    finally:
        writer.close()


def test_a_failed_background_copy_surfaces_on_the_trainer_and_times_out_the_reader(tiny_model_dir, monkeypatch):
    import engines.weight_sync as weight_sync

    trainer = TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-2), micro_batch_size=4)
    rollout = HFInferenceEngine(tiny_model_dir)

    def broken(*args, **kwargs):
        raise OSError("No space left on device")  # e.g. /dev/shm filled up while copying

    monkeypatch.setattr(weight_sync, "_copy_and_hash", broken)
    shared = trainer.export_shared(1)  # returns before the copy runs
    with pytest.raises(TimeoutError, match="were not complete"):
        rollout._shared = SharedWeightReader()
        rollout._shared.load(rollout.model, shared, timeout_s=0.2)
    with pytest.raises(OSError, match="No space left"):
        trainer.exported_checksum()
    monkeypatch.undo()
    shared = trainer.export_shared(2)  # the next sync works again
    assert rollout.update_weights_shared(shared) == trainer.exported_checksum() == trainer.weights_checksum()
    trainer.close()


class _EveryRow:
    """``PolicyObjective`` without row skipping: the reference."""

    def __init__(self, objective):
        self.objective = objective

    def __call__(self, **kwargs):
        return self.objective(**kwargs)

    def micro_weight(self, micro, full):
        return self.objective.micro_weight(micro, full)


@pytest.mark.parametrize("agg, zero_groups", [("token-mean", (0, 2)), ("seq-mean-token-mean", (1,)),
                                               ("token-mean", (0, 1, 2))])
def test_zero_advantage_rows_are_skipped_with_the_same_loss_and_gradient(tiny_model_dir, agg, zero_groups):
    """GRPO groups whose advantages are all 0 are not computed; loss and gradient equal the full batch's
    (all groups zero: one row is still computed, so the optimizer steps with zero gradients)."""
    from engines.algorithms.objective import PolicyObjective
    from engines.types import build_train_batch

    rollout = HFInferenceEngine(tiny_model_dir)
    out = rollout.generate([p for p in PROMPTS[:3] for _ in range(4)], SamplingParams(max_new_tokens=5, temperature=1.0, seed=2))
    batch = build_train_batch(out, rollout.tokenizer.pad_token_id)
    advantages = torch.randn(len(batch), generator=torch.Generator().manual_seed(0))
    for group in zero_groups:
        advantages[4 * group : 4 * group + 4] = 0.0
    batch = batch.with_tensors(advantages=advantages[:, None] * batch.loss_mask,
                               old_logprobs=batch.tensors["rollout_logprobs"] - 0.05 * batch.loss_mask)
    objective = PolicyObjective(agg=agg)
    engines = [TorchTrainEngine(tiny_model_dir, OptimSpec(lr=1e-3), micro_batch_size=3) for _ in range(2)]
    skipped = engines[0].train_step(batch, objective)
    every = engines[1].train_step(batch, _EveryRow(objective))
    assert skipped["train/skipped_rows"] == (4 * len(zero_groups) - (len(zero_groups) == 3)) and every["train/skipped_rows"] == 0
    assert skipped["train/loss"] == pytest.approx(every["train/loss"], abs=1e-7)
    assert skipped["train/grad_norm"] == pytest.approx(every["train/grad_norm"], rel=1e-5, abs=1e-9)
    if len(zero_groups) == 3:
        assert skipped["train/grad_norm"] == 0.0
    for (name, a), (_, b) in zip(engines[0].model.named_parameters(), engines[1].model.named_parameters()):
        assert a.grad is not None and (a.grad - b.grad).abs().max() < 1e-6, name
    # with an entropy bonus a zero-advantage row has a gradient: nothing is skipped
    assert engines[0].train_step(batch, PolicyObjective(agg=agg, entropy_coef=0.01))["train/skipped_rows"] == 0


def test_packed_rows_are_twice_the_longest_segment_within_the_attention_cost():
    from transformers import Qwen2Config

    from engines.training.logprobs import attention_cost, pack_width

    config = Qwen2Config(hidden_size=256, intermediate_size=1024)
    assert attention_cost(config) == 2 * 256 + 1.5 * 1024  # 2048: attention per token = linear layers at W = c
    assert pack_width(26, 2048) == 52 and pack_width(200, 2048) == 256 and pack_width(300, 2048) == 300
    assert pack_width(26, None) == 26 and attention_cost(object()) is None
    # alike lengths (15-26 tokens): one per row at the longest's width, packed two or three a row at twice it
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(15, 27, (64,), generator=gen)
    lengths[0] = 26
    mask = (torch.arange(26) < lengths[:, None]).long()
    ids, needed = torch.randint(2, 30, (64, 26), generator=gen) * mask, mask.float()
    narrow, wide = pack_sequences(ids, mask, needed), pack_sequences(ids, mask, needed, cost=2048)
    assert narrow.input_ids.shape == (64, 26) and wide.input_ids.shape[1] == 52
    tokens = int(mask.sum())  # 1309 of 1664 padded positions
    assert narrow.input_ids.numel() == 1664 and wide.input_ids.numel() < 1.12 * tokens  # 1456: 11% padding, not 27%
    assert (wide.input_ids != 0).sum() == (ids != 0).sum()
