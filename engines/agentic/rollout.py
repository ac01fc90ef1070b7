"""Episodes of text environments, token in and token out, run serially, in lockstep or env-level async.

An episode loops reset → generate → step until the environment ends it or a limit does. ``EpisodeRun``
is that loop as a state machine (``start`` gives the first generation request, ``advance`` takes the
generation, steps the environment and gives the next request or None), so the three runners differ only
in how they batch requests:

- ``run_serial``: one episode after another, one request per generation call (the reference).
- ``run_lockstep``: every live episode generates in one call, then all step (in threads), then the next
  turn: each turn waits for the slowest environment.
- ``run_async`` (env-level async): each episode runs on its own thread; the calling thread batches the
  requests pending at each moment into one generation call, so a slow environment step never holds the
  others' turns.

Every request carries its own sampling seed, a pure function of the episode's seed and the turn, so the
three runners sample the same tokens for the same episode whatever the batches they land in.

Limits: ``max_turns``, ``max_tokens_per_turn`` and ``max_context`` (tokens of the whole trajectory). A
turn ends ``stop`` (a stop token, kept), ``length`` (its token budget) or ``context`` (cut short by the
context limit); an episode ends ``terminated`` (or ``truncated``) by the environment, ``max_turns``,
``context`` or ``error`` (the environment raised or took over ``step_timeout_s``). An error never
escapes: the episode keeps what it had and records the error.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from engines.agentic.chat import TurnRenderer


@dataclass(frozen=True)
class RolloutSettings:
    """How episodes run; ``stop_token_ids`` end a turn (the tokenizer's EOS when empty)."""

    max_turns: int = 8
    max_tokens_per_turn: int = 8
    max_context: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    step_timeout_s: float = 30.0
    batch_wait_s: float = 0.002  # async: how long a generation call waits for more requests to join it


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to run: environment, its seed, its group (episodes sharing ``env_seed``) and the base of
    its sampling seeds."""

    env_id: str
    env_seed: int
    group: int
    index: int  # position in the batch
    sample_seed: int
    options: dict = field(default_factory=dict)

    def request_seed(self, turn: int) -> int:
        return (self.sample_seed * 1_000_003 + turn) % (2**63 - 1)


@dataclass(frozen=True)
class Request:
    """A generation request: the trajectory's tokens so far, the turn's token budget and sampling seed.
    ``env`` is the episode's environment, for text policies (random, scripted, human) that look at it."""

    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    env: Any = None


@dataclass(frozen=True)
class Generation:
    ids: list[int]  # as sampled, stop token included
    logprobs: list[float]
    finish: str  # stop | length
    text: str  # decoded, stop token stripped
    weights_version: int = 0  # of the weights that sampled it


class Policy(Protocol):
    def generate(self, requests: list[Request]) -> list[Generation]:
        """One generation per request, in order."""


@dataclass
class Turn:
    """One action: the model's tokens, the environment's answer, and the tokens that follow the action."""

    action_ids: list[int]
    logprobs: list[float]
    finish: str  # stop | length | context
    text: str
    state_key: str  # the state the action was taken in (GiGPO's anchor)
    reward: float = 0.0
    valid: bool = True
    observation: str = ""  # the environment's answer to the action
    next_ids: list[int] = field(default_factory=list)  # template + observation tokens before the next action
    weights_version: int = 0  # of the weights that sampled the action (turns of one episode may differ)


ENDINGS = ("terminated", "truncated", "max_turns", "context", "error")
TRUNCATIONS = ("truncated", "max_turns", "context")
"""Episode endings, and those that are a limit's (the environment's or the rollout's) rather than the task's."""


@dataclass
class Episode:
    spec: EpisodeSpec
    prompt_ids: list[int]
    first_observation: str
    turns: list[Turn] = field(default_factory=list)
    ending: str = ""  # terminated | truncated | max_turns | context | error
    success: bool = False
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's, last reported

    @property
    def step_rewards(self) -> list[float]:
        return [t.reward for t in self.turns]

    @property
    def state_keys(self) -> list[str]:
        return [t.state_key for t in self.turns]

    @property
    def episode_return(self) -> float:
        return sum(self.step_rewards)

    @property
    def truncated(self) -> bool:
        """Ended by a limit (the environment's or the rollout's) rather than by the task."""
        return self.ending in TRUNCATIONS

    def response_ids(self) -> list[int]:
        return [t for turn in self.turns for t in (*turn.action_ids, *turn.next_ids)]

    def model_mask(self) -> list[int]:
        return [m for turn in self.turns for m in ([1] * len(turn.action_ids) + [0] * len(turn.next_ids))]


def _call(fn: Callable, timeout_s: float, *args):
    """``fn(*args)`` on a daemon thread; ``TimeoutError`` after ``timeout_s`` (the thread is left behind)."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"took over {timeout_s:g}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class EpisodeRun:
    """One episode as a state machine over an environment built by ``make_env(spec)``."""

    def __init__(self, spec: EpisodeSpec, make_env: Callable[[EpisodeSpec], Any], renderer: TurnRenderer,
                 settings: RolloutSettings, state_key: Callable[[Any], str]):
        self.spec, self.renderer, self.settings, self._state_key = spec, renderer, settings, state_key
        self._make_env = make_env
        self.env = None
        self.episode = Episode(spec, [], "")
        self._ids: list[int] = []  # the trajectory so far: prompt, actions, observations
        self._history: list[dict] = []
        self._budget = settings.max_tokens_per_turn  # tokens the pending request may generate

    def start(self) -> Request | None:
        try:
            self.env = self._make_env(self.spec)
            observation, _ = _call(self.env.reset, self.settings.step_timeout_s, self.spec.env_seed)
            self.episode.first_observation = observation
            self.episode.prompt_ids = self._ids = self.renderer.initial_ids(observation)
            self._history = [{"role": "user", "content": observation}]
        except Exception as exc:  # noqa: BLE001 - an environment error ends the episode, never the run
            return self._end("error", f"reset: {type(exc).__name__}: {exc}")
        return self._request()

    def _request(self) -> Request | None:
        if len(self.episode.turns) >= self.settings.max_turns:
            return self._end("max_turns")
        room = self.settings.max_context - len(self._ids)
        if room <= 0:
            return self._end("context")
        self._budget = min(self.settings.max_tokens_per_turn, room)
        return Request(list(self._ids), self._budget, self.spec.request_seed(len(self.episode.turns)), env=self.env)

    def advance(self, generation: Generation, stop_text: Callable[[int], str]) -> Request | None:
        """Record ``generation`` as the next action, step the environment, and return the next request
        (None: the episode ended). ``stop_text``: the text of a stop token id."""
        finish = generation.finish
        if finish == "length" and self._budget < self.settings.max_tokens_per_turn:
            finish = "context"  # the turn's budget was cut to what the context limit left
        try:
            key = self._state_key(self.env)
        except Exception as exc:  # noqa: BLE001
            return self._end("error", f"state_key: {type(exc).__name__}: {exc}")
        turn = Turn(list(generation.ids), list(generation.logprobs), finish, generation.text, key,
                    weights_version=generation.weights_version)
        self.episode.turns.append(turn)
        self._ids = self._ids + self._action_tokens(turn)
        try:
            observation, reward, terminated, truncated, info = _call(self.env.step, self.settings.step_timeout_s,
                                                                     generation.text)
        except Exception as exc:  # noqa: BLE001
            return self._end("error", f"step: {type(exc).__name__}: {exc}")
        turn.reward, turn.observation = float(reward), observation
        turn.valid = bool(info.get("action_is_valid", True))
        self.episode.success = bool(info.get("success", False))
        self.episode.metrics = dict(info.get("metrics") or {})
        if terminated or truncated:
            return self._end("terminated" if terminated else "truncated")
        if len(self.episode.turns) >= self.settings.max_turns:
            return self._end("max_turns")  # no observation tokens after the last action
        stopped_on = stop_text(turn.action_ids[-1]) if finish == "stop" and turn.action_ids else None
        next_ids = self.renderer.between_ids(self._history, generation.text, stopped_on, observation)
        if len(self._ids) + len(next_ids) >= self.settings.max_context:
            return self._end("context")  # the next observation leaves no room for an answer: left out
        turn.next_ids = next_ids
        self._history += [{"role": "assistant", "content": generation.text}, {"role": "user", "content": observation}]
        self._ids = self._ids + turn.next_ids
        return self._request()

    def _action_tokens(self, turn: Turn) -> list[int]:
        """What an action adds to the trajectory: the sampled ids themselves, never a re-encoding of their text."""
        return turn.action_ids

    def _end(self, ending: str, error: str | None = None) -> None:
        self.episode.ending, self.episode.error = ending, error
        if self.env is not None:
            try:
                self.env.close()
            except Exception:  # noqa: BLE001 - closing a broken environment must not fail the batch
                pass
        return None


@dataclass
class Runner:
    """Runs episodes with ``policy``; ``make_env(spec)`` builds each episode's environment."""

    policy: Policy
    renderer: TurnRenderer
    settings: RolloutSettings
    make_env: Callable[[EpisodeSpec], Any]
    state_key: Callable[[Any], str]

    def _runs(self, specs: list[EpisodeSpec]) -> list[EpisodeRun]:
        return [EpisodeRun(spec, self.make_env, self.renderer, self.settings, self.state_key) for spec in specs]

    def _stop_text(self, token_id: int) -> str:
        return self.renderer.tokenizer.decode([token_id])

    def run(self, specs: list[EpisodeSpec], mode: str = "async") -> list[Episode]:
        """The episodes of ``specs``, in order, run by ``mode``: serial, lockstep or async."""
        return {"serial": self.run_serial, "lockstep": self.run_lockstep, "async": self.run_async}[mode](specs)

    def run_serial(self, specs: list[EpisodeSpec]) -> list[Episode]:
        episodes = []
        for run in self._runs(specs):
            request = run.start()
            while request is not None:
                request = run.advance(self.policy.generate([request])[0], self._stop_text)
            episodes.append(run.episode)
        return episodes

    def run_lockstep(self, specs: list[EpisodeSpec]) -> list[Episode]:
        runs = self._runs(specs)
        with ThreadPoolExecutor(max_workers=max(len(runs), 1)) as pool:
            pending = [(run, request) for run, request in zip(runs, pool.map(EpisodeRun.start, runs)) if request]
            while pending:
                generations = self.policy.generate([request for _, request in pending])
                requests = pool.map(lambda pair: pair[0].advance(pair[1], self._stop_text),
                                    [(run, gen) for (run, _), gen in zip(pending, generations)])
                pending = [(run, request) for (run, _), request in zip(pending, requests) if request is not None]
        return [run.episode for run in runs]

    def run_async(self, specs: list[EpisodeSpec]) -> list[Episode]:
        runs = self._runs(specs)
        inbox: queue.Queue[tuple[Request, Future] | None] = queue.Queue()

        def loop(run: EpisodeRun) -> None:
            request = run.start()
            while request is not None:
                future: Future = Future()
                inbox.put((request, future))
                request = run.advance(future.result(), self._stop_text)

        failure: BaseException | None = None  # the policy's: every request from then on gets it
        with ThreadPoolExecutor(max_workers=max(len(runs), 1)) as pool:
            episodes = [pool.submit(loop, run) for run in runs]
            live = len(runs)
            for done in episodes:
                done.add_done_callback(lambda _: inbox.put(None))  # wakes the batcher when an episode ends
            while live:
                batch, item = [], inbox.get()
                deadline = time.monotonic() + self.settings.batch_wait_s
                while True:
                    if item is None:
                        live -= 1
                    else:
                        batch.append(item)
                    if len(batch) >= live:  # every live episode waits on this call
                        break
                    try:
                        item = inbox.get(timeout=max(deadline - time.monotonic(), 0))
                    except queue.Empty:
                        break
                if batch and failure is None:
                    try:
                        generations = self.policy.generate([request for request, _ in batch])
                    except BaseException as exc:  # noqa: BLE001 - raised below, once every episode has ended
                        failure = exc
                    else:
                        for (_, future), generation in zip(batch, generations):
                            future.set_result(generation)
                if failure is not None:  # this batch, and the episodes still running: they end on it
                    for _, future in batch:
                        future.set_exception(failure)
            if failure is not None:
                raise failure
            for done in episodes:
                done.result()  # an error outside the environment (the policy's) is the caller's
        return [run.episode for run in runs]


@dataclass
class EnginePolicy:
    """A rollout engine (or its Ray actor handle) as a ``Policy``: one ``generate`` call per distinct token
    budget among the requests, each row sampled with its request's seed (``SamplingParams.row_seeds``)."""

    engine: Any
    settings: RolloutSettings
    weights_version: int = 0  # the engine's weights version in its last generate call

    def generate(self, requests: list[Request]) -> list[Generation]:
        from engines.types import SamplingParams

        out: list[Generation | None] = [None] * len(requests)
        for budget in sorted({r.max_new_tokens for r in requests}):
            rows = [i for i, r in enumerate(requests) if r.max_new_tokens == budget]
            sampling = SamplingParams(max_new_tokens=budget, temperature=self.settings.temperature,
                                      top_p=self.settings.top_p, top_k=self.settings.top_k,
                                      stop_token_ids=self.settings.stop_token_ids,
                                      row_seeds=tuple(requests[i].seed for i in rows))
            prompts = [requests[i].prompt_ids for i in rows]
            call = getattr(self.engine.generate, "remote", None)
            if call is not None:
                import ray

                rollouts = ray.get(call(prompts, sampling))
            else:
                rollouts = self.engine.generate(prompts, sampling)
            self.weights_version = rollouts.weights_version
            for j, i in enumerate(rows):
                n = int(rollouts.response_lengths[j])
                out[i] = Generation(rollouts.response_ids[j, :n].tolist(), rollouts.logprobs[j, :n].tolist(),
                                    rollouts.finish_reasons[j], rollouts.completions[j], rollouts.weights_version)
        return out  # type: ignore[return-value]


def to_rollouts(episodes: list[Episode], pad_token_id: int, weights_version: int = 0):
    """One multi-turn ``Rollouts`` row per episode: the first prompt, then each action followed by the tokens
    before the next action; the loss mask is 1 on the actions' tokens only, each action and the tokens after
    it form one segment (``turn_index``). An episode without a turn (its reset failed) is one padding token
    with nothing to train on. ``weights_version`` is the oldest version that sampled an action
    (``weights_version`` given: when there is no action); when the actions' versions differ (weights updated
    between turns), ``token_versions`` holds each action's."""
    import torch

    from engines.types import Rollouts

    responses = [e.response_ids() for e in episodes]
    width = max((len(r) for r in responses), default=0) or 1
    rows = len(episodes)
    response_ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    logprobs = torch.zeros((rows, width), dtype=torch.float32)
    loss_mask = torch.zeros((rows, width), dtype=torch.float32)
    turn_index = torch.zeros((rows, width), dtype=torch.long)
    versions = {t.weights_version for e in episodes for t in e.turns}
    oldest = min(versions, default=weights_version)
    token_versions = torch.full((rows, width), oldest, dtype=torch.long)
    lengths = torch.zeros(rows, dtype=torch.long)
    for i, (episode, response) in enumerate(zip(episodes, responses)):
        t = 0
        for k, turn in enumerate(episode.turns, start=1):
            n, m = len(turn.action_ids), len(turn.next_ids)
            logprobs[i, t: t + n] = torch.tensor(turn.logprobs, dtype=torch.float32)
            loss_mask[i, t: t + n] = 1.0
            turn_index[i, t: t + n + m] = k
            token_versions[i, t: t + n + m] = turn.weights_version
            t += n + m
        response_ids[i, : len(response)] = torch.tensor(response, dtype=torch.long)
        lengths[i] = len(response)
    return Rollouts(
        prompt_ids=[e.prompt_ids or [pad_token_id] for e in episodes],
        response_ids=response_ids,
        logprobs=logprobs,
        response_lengths=lengths,
        finish_reasons=["stop" if e.ending == "terminated" else "length" for e in episodes],
        completions=[" | ".join(t.text for t in e.turns) for e in episodes],
        weights_version=oldest,
        response_loss_mask=loss_mask,
        response_turn_index=turn_index,
        token_versions=token_versions if len(versions) > 1 else None,
    )
