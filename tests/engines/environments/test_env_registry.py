"""``make``/``names``/``state_key`` and the gem:/gym: adapters (tested with a stand-in gymnasium module)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types

import pytest

from engines.environments import ENVIRONMENTS, make, names, state_key
from engines.environments.adapters import TextEnvAdapter
from engines.protocols import Env

SHIPPED = ["Bandit-v0", "Calculator-v0", "Corridor-v0", "FrozenLake-v0", "GuessTheNumber-v0", "Sokoban-v0"]


def test_names_and_make():
    assert names() == SHIPPED
    for env_id in SHIPPED:
        env = make(env_id)
        assert isinstance(env, Env) and type(env) is ENVIRONMENTS.get(env_id)
        assert isinstance(env.instructions, str) and 0 < len(env.instructions) <= 80 and "\n" not in env.instructions


@pytest.mark.parametrize("env_id", SHIPPED)
def test_options_are_keyword_only_with_defaults(env_id):
    params = list(inspect.signature(ENVIRONMENTS.get(env_id)).parameters.values())
    assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in params)
    assert ENVIRONMENTS.get(env_id)().format_penalty == -0.1


def test_unknown_id_and_option_are_one_line_errors():
    with pytest.raises(KeyError) as error:
        make("Corridor-v9")
    message = error.value.args[0]
    assert "\n" not in message and "'Corridor-v9'" in message
    assert "Corridor-v0" in message and "Sokoban-v0" in message and "gem:<id>" in message and "gym:<id>" in message
    with pytest.raises(ValueError, match=r"^environment 'Corridor-v0' does not take size; it takes: arrows, format_penalty, length$"):
        make("Corridor-v0", size=4)


@pytest.mark.parametrize("env_id, package", [("gem:ta:GuessTheNumber-v0", "gem-llm"), ("gym:TextWorld-v0", "gymnasium")])
def test_adapter_without_its_package_names_it(env_id, package):
    module = "gem" if env_id.startswith("gem") else "gymnasium"
    if importlib.util.find_spec(module) is not None:
        pytest.skip(f"{module} is installed")
    with pytest.raises(ModuleNotFoundError) as error:
        make(env_id)
    assert str(error.value) == f"environment {env_id!r} needs the {package} package: pip install {package}"


class FakeTextSpace:
    def contains(self, action):
        return action in {"a", "b"}


class FakeGymEnv:
    """A gymnasium-like text env: two actions, ``b`` ends the episode."""

    action_space = FakeTextSpace()

    def __init__(self, *, size=1):
        self.size, self.closed = size, False

    def reset(self, *, seed=None):
        return f"start{seed}", {"size": self.size}

    def step(self, action):
        return f"saw {action}", int(action == "b"), action == "b", False, {"success": action == "b"}

    def close(self):
        self.closed = True


def test_gym_adapter(monkeypatch):
    fake = types.ModuleType("gymnasium")
    fake.make = lambda name, **options: FakeGymEnv(**options)
    monkeypatch.setitem(sys.modules, "gymnasium", fake)
    env = make("gym:Fake-v0", size=3, format_penalty=-1.0)
    assert isinstance(env, TextEnvAdapter) and isinstance(env, Env)
    assert env.reset(seed=5) == ("start5", {"action_is_valid": True, "success": False, "metrics": {}, "size": 3})
    # "c" is outside the action space: invalid, the last observation again, the env is not stepped
    assert env.step("c") == ("start5", -1.0, False, False, {"action_is_valid": False, "success": False, "metrics": {}})
    assert state_key(env) == "start5"
    assert env.step("a")[:4] == ("saw a", 0.0, False, False) and state_key(env) == "saw a"
    obs, reward, terminated, truncated, info = env.step("b")
    assert (obs, reward, terminated, info["success"], info["action_is_valid"]) == ("saw b", 1.0, True, True, True)
    env.close()
    assert env.env.closed


def test_state_key_falls_back_to_the_observation():
    corridor = make("Corridor-v0")
    corridor.reset(seed=0)
    assert state_key(corridor) == corridor.state_key() == "...A.G"

    class Plain:
        pass

    assert state_key(Plain(), observation="seen") == "seen"
    with pytest.raises(TypeError, match="Plain has no state_key"):
        state_key(Plain())
