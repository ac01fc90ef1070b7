"""Shared fixtures: a tiny model built once per session, a real local Ray cluster, a real Prefect
server (Prefect's test harness on 127.0.0.1), and process settings that keep runs quiet and offline."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 model + tokenizer trained on arithmetic text, saved in HF format. Heads of 32 dims:
    the smallest vLLM's CPU attention kernels take."""
    from engines.data.arithmetic import arithmetic_corpus, make_arithmetic_splits
    from engines.models import TinyModelSpec, build_tiny_model

    train, _ = make_arithmetic_splits(num_train=300, num_heldout=20, max_operand=30, seed=0)
    out = tmp_path_factory.mktemp("tiny") / "model"
    build_tiny_model(out, arithmetic_corpus(train), TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2,
                                                                   num_kv_heads=1, intermediate_size=128), seed=0)
    return str(out)


@pytest.fixture(scope="session")
def agentic_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 model whose tokenizer is trained on random-move episodes of the shipped text
    environments (the plain turn format), 256 positions: multi-turn rollouts fit."""
    from engines.agentic.warm_start import environment_texts
    from engines.models import TinyModelSpec, build_tiny_model

    texts = [text for env in ("Corridor-v0", "Bandit-v0", "GuessTheNumber-v0", "FrozenLake-v0")
             for text in environment_texts(env, {}, 40, seed=0, max_turns=6)]
    out = tmp_path_factory.mktemp("agentic") / "model"
    build_tiny_model(out, texts, TinyModelSpec(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                                                   intermediate_size=128, max_position_embeddings=256,
                                                                   vocab_size=96), seed=0)
    return str(out)


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from flows.setup import worker_env_vars

    # Four GPUs declared, none real: placement tests reserve them, and engines placed on them run on CPU.
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, namespace="rollflow", log_to_driver=False,
             runtime_env={"env_vars": worker_env_vars()})  # the workers' environment of a run's own Ray
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real ``prefect server start`` process on 127.0.0.1 for tests that run subprocesses (workers,
    ``rollflow run``): yields ``(api_url, env)``."""
    from services import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect")) as (url, env):
        yield url, env


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1: ``(boto3 client, AWS_* env)``."""
    from services import s3_server as start

    with start() as (client, env):
        yield client, env


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    """Conformance cases of a sharded trainer (``ranks``) syncing into the vLLM engine (``remote``) send the
    buckets the torch trainer does: that pairing runs with the slow set (by default every train engine is
    checked against the HF engine, and the torch trainer against vLLM)."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {}).values()
        if any(getattr(p, "ranks", 0) for p in params) and any(getattr(p, "remote", False) for p in params):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    """``ROLLFLOW_TEST_DEADLINE`` (epoch seconds; ``.ci/run`` sets it for the slow set): a test that would start
    after it is skipped, with that reason in the summary, so CI's time budget ends the run cleanly and the
    tests that did run still pass or fail on their own."""
    deadline = os.environ.get("ROLLFLOW_TEST_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("not run: CI's time budget for this test session is spent (ROLLFLOW_TEST_DEADLINE)")


def pytest_collection_finish(session):
    """Build the vLLM engine's venv before the first test that needs it (minutes the first time, then
    cached under ~/.cache/rollflow/envs), outside any test's timeout, with a progress line per step."""
    if any(item.get_closest_marker("vllm") for item in session.items):
        from engines.envs import env_python

        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        env_python("vllm", echo=reporter.write_line if reporter else print)
