"""Engine backends by short name or dotted path: validated without an import, imported when chosen."""

from __future__ import annotations

import re
import sys

import pytest

from configs.loader import ConfigError, load_config
from engines.backends import check_backend, engine_class
from engines.inference.hf import HFInferenceEngine

BACKEND_SOURCE = '''
class EchoRollout:
    """A stand-in rollout backend: its module's import is what the test watches."""

    def __init__(self, model_path):
        self.model_path = model_path
'''


def test_registered_short_names_resolve():
    assert engine_class("rollout/hf") is HFInferenceEngine
    assert check_backend("train", "torch") == "engines.training.torch:TorchTrainEngine"


def test_unknown_short_name_lists_the_registered_ones():
    with pytest.raises(ConfigError, match=r"rollout\.engine: unknown rollout engine 'vlm'; registered: hf, vllm "
                                          r"\(or a class by dotted path, package\.module:Class\)"):
        load_config(None, ["rollout.engine=vlm"])
    with pytest.raises(ConfigError, match=r"train\.engine: unknown train engine 'hf'; registered: deepspeed, fsdp2, torch"):
        load_config(None, ["train.engine=hf"])  # a rollout backend is not a training backend
    with pytest.raises(ValueError, match="unknown engine role 'critic'"):
        engine_class("critic/torch")


@pytest.mark.parametrize("path", ["pkg.mod:1Engine", "pkg-x.mod:Engine", ":Engine", "pkg.mod:Engine:Other", "pkg mod:E"])
def test_malformed_dotted_path_is_rejected(path):
    with pytest.raises(ConfigError, match=re.escape(f"train.engine: train engine '{path}' is not a dotted path")):
        load_config(None, [f"train.engine={path}"])


def test_dotted_path_is_imported_only_when_the_engine_starts(tmp_path, monkeypatch):
    (tmp_path / "rollflow_echo_backend.py").write_text(BACKEND_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "rollflow_echo_backend", raising=False)

    config = load_config(None, ["rollout.engine=rollflow_echo_backend:EchoRollout"])
    assert config.rollout.engine == "rollflow_echo_backend:EchoRollout"
    assert "rollflow_echo_backend" not in sys.modules  # validated, not imported

    cls = engine_class(f"rollout/{config.rollout.engine}")  # what start_engine does
    assert "rollflow_echo_backend" in sys.modules
    assert cls.__name__ == "EchoRollout" and cls("m").model_path == "m"
