"""Token-in, token-out turns: the prompt of turn k is the exact token prefix of the trajectory.

A trajectory is ``prompt | a_0 | o_1 | a_1 | o_2 | … | a_n``: the initial prompt (system line, first
observation, generation header), then each action's generated ids exactly as sampled (stop token included)
and, between actions, the template tokens that close the model's turn, hold the next observation and
open the next turn. Only those in-between pieces are rendered from text, each on its own; the model's
tokens are never decoded and re-encoded (a round trip can merge, split or drop tokens, e.g. a stop token
that ``decode`` strips), so the trainer scores exactly the tokens the engine sampled.

The in-between text comes from the chat template, or from the plain ``role:`` format of
``engines.data.chat`` when the tokenizer has none. That is right only for a template that renders a
conversation as an append-only string: each turn's rendering must start with the rendering of the turns
before it. ``check_append_only`` renders a probe conversation both ways at startup and refuses a template
that rewrites history (e.g. one that drops earlier turns' reasoning), naming the turn where they differ.
"""

from __future__ import annotations

from dataclasses import dataclass

from engines.data.chat import plain_render

PROBE_ACTIONS = ("<think>\nstep\n</think>\n\nL", "R", "<calc>1+2</calc>")
"""Assistant turns of the startup probe: reasoning that a history-rewriting template drops, plain text."""


class TemplateError(ValueError):
    """A chat template whose renderings are not append-only; the message names the turn."""


@dataclass
class TurnRenderer:
    """Renders the token pieces of an episode around the model's own tokens.

    ``system``: an optional system message before the first observation."""

    tokenizer: object
    system: str | None = None

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        return plain_render(messages, self.tokenizer.eos_token, generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _head(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def initial_ids(self, observation: str) -> list[int]:
        """The first prompt: system line, the first observation, the assistant's generation header."""
        return self._encode(self._render([*self._head(), {"role": "user", "content": observation}], True))

    def between_ids(self, history: list[dict], action_text: str, stopped_on: str | None, observation: str) -> list[int]:
        """The tokens after an action (its text ``action_text``; ``stopped_on``: the text of the stop token the
        model ended it with, or None when it ran out of tokens) up to the next generation header, with
        ``observation`` as the next user turn. ``history``: the conversation before the action, ending with
        the user turn the action answers."""
        rest = self._between_text(history, action_text, observation)
        if stopped_on and rest.startswith(stopped_on):  # the model's stop token closed its turn already
            rest = rest[len(stopped_on):]
        return self._encode(rest)

    def _between_text(self, history: list[dict], action_text: str, observation: str) -> str:
        messages = [*self._head(), *history]
        before = self._render(messages, True) + action_text
        after = self._render([*messages, {"role": "assistant", "content": action_text},
                              {"role": "user", "content": observation}], True)
        if not after.startswith(before):
            at = _first_difference(before, after)
            raise TemplateError(f"the chat template is not append-only at turn {len(history) // 2}: adding the next "
                                f"observation changes the text before it at character {at}"
                                f" ({after[max(at - 20, 0):][:40]!r}); "
                                "token-in-token-out rollouts need an append-only template")
        return after[len(before):]


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_append_only(renderer: TurnRenderer, actions: tuple[str, ...] = PROBE_ACTIONS) -> None:
    """Render a probe conversation turn by turn (``TurnRenderer``'s pieces) and in one piece;
    ``TemplateError`` naming the first turn where the two texts differ."""
    history: list[dict] = [{"role": "user", "content": "o0"}]
    incremental = renderer._render([*renderer._head(), *history], True)
    starts = []  # where each action starts in the incremental text
    for turn, action in enumerate(actions):
        starts.append(len(incremental))
        incremental += action + renderer._between_text(history, action, f"o{turn + 1}")
        history += [{"role": "assistant", "content": action}, {"role": "user", "content": f"o{turn + 1}"}]
    full = renderer._render([*renderer._head(), *history], True)
    if full != incremental:
        at = _first_difference(full, incremental)
        turn = max([0] + [k for k, start in enumerate(starts) if start <= at])
        raise TemplateError(f"the chat template is not append-only at turn {turn}: the whole conversation renders "
                            f"differently from its turn-by-turn rendering at character {at} ({full[max(at - 20, 0):][:40]!r}"
                            f" vs {incremental[max(at - 20, 0):][:40]!r}); token-in-token-out rollouts need an "
                            "append-only template")
