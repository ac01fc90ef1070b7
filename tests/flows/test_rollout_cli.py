"""``rollflow rollout``: local episodes without Ray or Prefect, model and environment tokens told apart,
jsonl dump and exact replay."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from flows.cli import app


def _run(*args, input=None):
    result = CliRunner().invoke(app, ["rollout", *args], input=input)
    return result.exit_code, result.output


def test_scripted_corridor_episodes_show_model_tokens_apart_and_succeed(tmp_path):
    code, out = _run("Corridor-v0", "--policy", "scripted", "--episodes", "3", "--no-color", "-o", "length=5")
    assert code == 0, out
    assert "3 episode(s): success 3/3, mean return 1.000" in out
    # the model's tokens (an action and its stop token) are bracketed; the observations are not
    assert "⟦L<|endoftext|>⟧" in out or "⟦R<|endoftext|>⟧" in out
    assert "user:\n" in out and "⟦user" not in out


def test_a_dump_replays_identically_and_a_tampered_one_does_not(tmp_path):
    path = tmp_path / "episodes.jsonl"
    code, out = _run("GuessTheNumber-v0", "--policy", "random", "--episodes", "4", "--seed", "3", "--dump", str(path))
    assert code == 0 and path.exists(), out
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 4 and all(r["turns"] for r in records)
    code, out = _run("GuessTheNumber-v0", "--replay", str(path), "--no-color")
    assert code == 0 and "replayed 4 episode(s): identical" in out, out

    records[0]["turns"][0]["observation"] = "tampered"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, out = _run("GuessTheNumber-v0", "--replay", str(path), "--no-color")
    assert code == 1 and "episode 0 turn 0: observation 'tampered'" in out, out


def test_human_policy_reads_actions_and_bad_input_is_an_invalid_action():
    code, out = _run("Corridor-v0", "--policy", "human", "--episodes", "1", "--max-turns", "2", "--no-color",
                     input="jump\nL\n")
    assert code == 0, out
    assert "turn 0: " in out and "invalid action" in out.split("turn 1:")[0]


def test_unknown_environment_and_policy_are_one_line_errors():
    code, out = _run("Nope-v0")
    assert code == 2 and "unknown environment 'Nope-v0'" in out
    code, out = _run("Corridor-v0", "--policy", "greedy")
    assert code == 2 and "unknown policy 'greedy'" in out


def test_the_instructions_shown_as_a_system_message_are_readable():
    code, out = _run("Corridor-v0", "--policy", "scripted", "--episodes", "1", "--no-color", "--system-prompt")
    assert code == 0 and "system:\nMove A to G. Answer L or R." in out, out
