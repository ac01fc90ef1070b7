import hashlib
import json

import datasets
import fsspec
import pytest
import torch

from engines.data.chat import (EncodedPair, EncodedRow, encode_preferences, encode_sft, load_records,
                               pair_batch_from, plain_render, records_fingerprint, sft_batch_from,
                               split_implicit_prompt)
from engines.data.sft import sft_batch
from engines.data.synthetic import LETTERS, preference_task, sft_task, texts_for_tokenizer
from engines.models import EOS_TOKEN, PAD_TOKEN, TinyModelSpec, build_tiny_model, load_tokenizer

# Hand-made word-level vocabulary: the ids of the expected tokens below are read off this table.
VOCAB = {PAD_TOKEN: 0, EOS_TOKEN: 1, "system": 2, "user": 3, "assistant": 4, ":": 5, "a": 6, "b": 7, "c": 8,
         "hi": 9, "says": 10, "over": 11}
# "{role} says {content} over " per message; the generation prompt is "assistant says ".
SAYS = ("{% for m in messages %}{{ m.role }} says {{ m.content }} over {% endfor %}"
        "{% if add_generation_prompt %}assistant says {% endif %}")
# Like SAYS, but an assistant turn that is not the last loses its content (as templates that drop earlier
# turns' reasoning do), so a shorter rendering is not a prefix of the longer one.
FORGETFUL = ("{% for m in messages %}{{ m.role }} says "
             "{% if m.role != 'assistant' or loop.last %}{{ m.content }} {% endif %}over {% endfor %}"
             "{% if add_generation_prompt %}assistant says {% endif %}")


def word_tokenizer(chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(VOCAB, unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # words and punctuation; spaces and newlines dropped
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)
    out.chat_template = chat_template
    return out


def msg(role, content):
    return {"role": role, "content": content}


TWO_TURNS = {"messages": [msg("system", "hi"), msg("user", "a b"), msg("assistant", "b a"), msg("user", "c"),
                          msg("assistant", "c")]}


@pytest.fixture(autouse=True)
def _private_datasets_cache(tmp_path, monkeypatch):
    """load_dataset writes arrow caches; keep them out of ~/.cache."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("ROLLFLOW_CACHE", str(tmp_path / "rollflow_cache"))
    datasets.disable_progress_bars()


def test_plain_format_masks_assistant_turns_and_their_eos():
    # system:\nhi<E> user:\na b<E> assistant:\nb a<E> user:\nc<E> assistant:\nc<E>, by VOCAB:
    #   2 5 9 1 | 3 5 6 7 1 | 4 5 [7 6 1] | 3 5 8 1 | 4 5 [8 1]; the bracketed answers + EOS are trained,
    # the role headers "assistant :" are prompt side; the first trained token is at index 4 + 5 + 2 = 11.
    [row], rejected = encode_sft(word_tokenizer(), [TWO_TURNS], max_length=64)
    assert row.input_ids == [2, 5, 9, 1, 3, 5, 6, 7, 1, 4, 5, 7, 6, 1, 3, 5, 8, 1, 4, 5, 8, 1]
    assert row.loss_mask == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    assert row.prompt_length == 11
    assert rejected.total == 0


def test_chat_template_masks_answer_and_end_of_turn_word():
    # "user says a b over assistant says b a over " -> 3 10 6 7 11 4 10 [7 6 11]
    rows = [{"messages": [msg("user", "a b"), msg("assistant", "b a")]},
            {"prompt": [msg("user", "c")], "completion": [msg("assistant", "c")]}]
    [first, second], _ = encode_sft(word_tokenizer(SAYS), rows, max_length=64)
    assert first == EncodedRow([3, 10, 6, 7, 11, 4, 10, 7, 6, 11], [0] * 7 + [1, 1, 1], 7)
    # "user says c over assistant says c over " -> 3 10 8 11 4 10 [8 11]
    assert second == EncodedRow([3, 10, 8, 11, 4, 10, 8, 11], [0] * 6 + [1, 1], 6)


def test_prompt_completion_trains_only_the_completion():
    # the assistant turn inside the prompt is context: "user says a over assistant says b over user says c
    # over assistant says [c over]" -> only the last two tokens are trained
    row = {"prompt": [msg("user", "a"), msg("assistant", "b"), msg("user", "c")], "completion": [msg("assistant", "c")]}
    [encoded], _ = encode_sft(word_tokenizer(SAYS), [row], max_length=64)
    assert encoded.loss_mask == [0] * 14 + [1, 1]
    assert encoded.input_ids[-2:] == [8, 11]


def test_rejections_are_counted_with_one_example_each():
    tok = word_tokenizer(FORGETFUL)
    rows = [{"messages": [msg("user", "a"), msg("assistant", "b")]},  # kept: one assistant turn, it is last
            {"messages": [msg("system", "hi"), msg("user", "a")]},  # no assistant turn: empty mask
            TWO_TURNS,  # turn 2 loses its content once turn 3 follows: not a prefix
            {"messages": [msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "a")]},
            {"messages": [msg("user", "a b c a b c"), msg("assistant", "b")]}]  # 2 + 6 + 5 = 13 tokens > max_length 10
    kept, rejected = encode_sft(tok, rows, max_length=10)
    assert [r.input_ids for r in kept] == [[3, 10, 6, 11, 4, 10, 7, 11]]
    assert rejected.counts == {"empty_mask": 1, "not_prefix": 2, "too_long": 1}
    assert rejected.indices == [1, 2, 3, 4]
    assert rejected.examples["empty_mask"].startswith("row 1: no assistant token")
    assert rejected.examples["not_prefix"].startswith("row 2: the tokens up to turn 3")
    assert rejected.examples["too_long"] == "row 4: 13 tokens, over max_length 10"
    assert rejected.summary().startswith("rejected 4 rows: empty_mask 1 (row 1:")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "a"}, "row 0: needs 'messages' or both 'prompt' and 'completion'; its keys are ['prompt']"),
    ({"messages": [{"role": "bot", "content": "a"}]}, "row 0: messages[0] must be a message with 'role' one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "row 0: messages[0] 'content' must be a string, got 3"),
    ({"prompt": "a", "completion": [msg("assistant", "b")]}, "row 0: 'prompt' and 'completion' must both be"),
])
def test_bad_sft_rows_raise_one_line(row, message):
    with pytest.raises(ValueError, match="^" + message.replace("[", r"\[").replace("(", r"\(")):
        encode_sft(word_tokenizer(), [row], max_length=64)


def test_bad_preference_rows_raise_one_line():
    with pytest.raises(ValueError, match=r"^row 1: preference rows need 'chosen' and 'rejected'"):
        encode_preferences(word_tokenizer(), [{"chosen": "a b", "rejected": "a c"}, {"prompt": "a", "chosen": "b"}],
                           max_length=64)
    with pytest.raises(ValueError, match=r"^row 0: 'chosen' and 'rejected' must differ"):
        encode_preferences(word_tokenizer(), [{"chosen": "a b", "rejected": "a b"}], max_length=64)


def _old_sft_batch(tokenizer, prompts, targets):
    """engines/data/sft.py's sft_batch before it called into engines.data.chat, as the reference."""
    rows = [(tokenizer.encode(p, add_special_tokens=False),
             tokenizer.encode(t, add_special_tokens=False) + [tokenizer.eos_token_id])
            for p, t in zip(prompts, targets)]
    width = max(len(p) + len(t) for p, t in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (p, t) in enumerate(rows):
        input_ids[i, : len(p) + len(t)] = torch.tensor(p + t)
        attention_mask[i, : len(p) + len(t)] = 1
        loss_mask[i, len(p): len(p) + len(t)] = 1.0
    return input_ids, attention_mask, loss_mask


def test_standard_form_keeps_the_warm_start_tokens(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    prompts, targets = ["1+2=", "10+20=", "3+4="], ["3", "30", "7"]
    expected = _old_sft_batch(tok, prompts, targets)
    encoded, rejected = encode_sft(tok, [{"prompt": p, "completion": t} for p, t in zip(prompts, targets)],
                                   max_length=64)
    assert rejected.total == 0
    for batch in (sft_batch_from(encoded, tok.pad_token_id), sft_batch(tiny_model_dir, prompts, targets)):
        for got, want in zip((batch.input_ids, batch.attention_mask, batch.loss_mask), expected):
            assert got.dtype == want.dtype and torch.equal(got, want)
    # "1+2=" is 4 single-character tokens (digits are split one by one), "3" one token, then EOS
    assert encoded[0].prompt_length == 4 and encoded[0].loss_mask == [0, 0, 0, 0, 1, 1]


def test_implicit_prompt_split():
    # strings, TRL's rule: a space ending the common prefix goes back to the answers
    assert split_implicit_prompt("Q: yes", "Q: no") == ("Q:", " yes", " no")
    assert split_implicit_prompt("Q: ab", "Q: ac") == ("Q: a", "b", "c")
    # messages: the common messages are the prompt
    user, good, bad = msg("user", "a b"), msg("assistant", "b a"), msg("assistant", "a b")
    assert split_implicit_prompt([user, good], [user, bad]) == ([user], [good], [bad])
    tok = word_tokenizer(SAYS)
    explicit, _ = encode_preferences(tok, [{"prompt": [user], "chosen": [good], "rejected": [bad]}], max_length=64)
    implicit, _ = encode_preferences(tok, [{"chosen": [user, good], "rejected": [user, bad]}], max_length=64)
    assert implicit == explicit
    # "user says a b over assistant says " is the prompt (7 tokens) on both sides
    assert explicit[0].chosen.prompt_length == explicit[0].rejected.prompt_length == 7
    assert explicit[0].rejected.input_ids == [3, 10, 6, 7, 11, 4, 10, 6, 7, 11]


def test_pair_batch_interleaves_and_aligns_ref_logps():
    pairs = [EncodedPair(EncodedRow([5, 6, 7], [0, 1, 1], 1), EncodedRow([5, 8], [0, 1], 1)),
             EncodedPair(EncodedRow([9, 6], [0, 1], 1), EncodedRow([9, 7, 7, 7], [0, 1, 1, 1], 1))]
    ref = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])  # [P, 2]: (chosen, rejected) per pair
    batch = pair_batch_from(pairs, pad_token_id=0, ref_logps=ref)
    assert batch.input_ids.tolist() == [[5, 6, 7, 0], [5, 8, 0, 0], [9, 6, 0, 0], [9, 7, 7, 7]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 1, 1, 1]]
    assert batch.attention_mask.sum(-1).tolist() == [3, 2, 2, 4]
    assert batch.group_ids.tolist() == [0, 0, 1, 1]
    assert batch.tensors["ref_logps"].tolist() == [[-1.0], [-2.0], [-3.0], [-4.0]]
    # micro-batches of two rows are whole pairs and keep their reference log-probs
    first, second = batch.micro_batches(2)
    assert second.tensors["ref_logps"].tolist() == [[-3.0], [-4.0]] and second.group_ids.tolist() == [1, 1]
    assert first.input_ids.shape == (2, 3) and first.tensors["ref_logps"].shape == (2, 1)
    flat = pair_batch_from(pairs, pad_token_id=0, ref_logps=torch.tensor([-1.0, -2.0, -3.0, -4.0]))
    assert torch.equal(flat.tensors["ref_logps"], batch.tensors["ref_logps"])
    assert "ref_logps" not in pair_batch_from(pairs, pad_token_id=0).tensors
    with pytest.raises(ValueError, match="ref_logps has 3 values for 2 pairs"):
        pair_batch_from(pairs, pad_token_id=0, ref_logps=torch.zeros(3))


ROWS = [{"messages": [msg("user", "a"), msg("assistant", "b")]},
        {"prompt": [msg("user", "c")], "completion": [msg("assistant", "a")]}]


def test_load_jsonl_parquet_saved_dataset_and_fsspec(tmp_path):
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_records(str(jsonl)) == ROWS  # the keys datasets fills with None are dropped again
    ds = datasets.Dataset.from_json(str(jsonl))  # (from_list would take the columns of the first row only)
    parquet = str(tmp_path / "rows.parquet")
    ds.to_parquet(parquet)
    assert load_records(parquet) == ROWS
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved"))
    assert load_records(str(tmp_path / "saved")) == ROWS
    with fsspec.open("memory://bucket/rows.jsonl", "w") as f:
        f.write(jsonl.read_text())
    assert load_records("memory://bucket/rows.jsonl") == ROWS


def test_records_fingerprint():
    # sha256 of each row's canonical JSON + "\n", then "\x00" closing the split
    assert records_fingerprint([{"b": 1, "a": "x"}]) == hashlib.sha256(b'{"a": "x", "b": 1}\n\x00').hexdigest()
    assert records_fingerprint([{"a": 1}]) != records_fingerprint([{"a": 2}])


def test_synthetic_tasks_round_trip_through_the_tiny_tokenizer(tmp_path):
    sft, prefs = sft_task(40, seed=0), preference_task(40, seed=1)
    assert sft == sft_task(40, seed=0) and sft != sft_task(40, seed=1)
    for row in sft:
        *_, user, answer = row["messages"]
        assert answer["content"] == " ".join(user["content"].split()[::-1])
        assert set(user["content"].split()) <= set(LETTERS)
    assert sum("prompt" not in row for row in prefs) == 10  # every fourth row is implicit
    model = build_tiny_model(tmp_path / "m", texts_for_tokenizer(sft + prefs),
                             TinyModelSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                           intermediate_size=16), seed=0)
    tok = load_tokenizer(str(model))
    encoded, rejected = encode_sft(tok, sft, max_length=64)
    pairs, rejected_pairs = encode_preferences(tok, prefs, max_length=64)
    assert rejected.total == rejected_pairs.total == 0 and len(encoded) == 40 and len(pairs) == 40
    for row, enc in zip(sft, encoded):
        assert tok.decode(enc.input_ids) == plain_render(row["messages"], EOS_TOKEN)
        trained = [t for t, m in zip(enc.input_ids, enc.loss_mask) if m]
        assert tok.decode(trained) == row["messages"][-1]["content"] + EOS_TOKEN
    for row, pair in zip(prefs, pairs):
        chosen = row["chosen"][-1]["content"]
        assert tok.decode(pair.chosen.input_ids[pair.chosen.prompt_length:]) == chosen + EOS_TOKEN
        assert pair.chosen.input_ids != pair.rejected.input_ids
