"""An engine in a Ray actor, called like a plain object: the conformance suite's view of a backend that
runs in its own virtualenv (vLLM), which the test process cannot import, or as several ranks (FSDP2,
DeepSpeed), each a process of its own."""

from __future__ import annotations

import functools
import inspect
import itertools

import ray

from engines.actors import start_engine, stop_engine
from engines.backends import engine_class
from engines.models import load_tokenizer
from engines.rank_group import start_rank_group

_instances = itertools.count()


class ActorProxy:
    """Forwards each public method of the engine class to the actor (every rank of a sharded engine, with
    ``world_size``) and waits for the result; methods keep the class's signatures (for the signature checks),
    errors arrive as the engine raised them. Each proxy has actors of its own."""

    def __init__(self, kind: str, model_dir: str, run_name: str = "conformance", world_size: int = 0,
                 **kwargs) -> None:
        cls = engine_class(kind)  # imports the module only: the backend package stays in the actor
        role = f"{kind.replace('/', '-')}-{next(_instances)}"
        if world_size:
            self.handle = start_rank_group(kind, run_name=run_name, role=role, world_size=world_size, reuse=False,
                                           model_path=model_dir, **kwargs)
        else:
            self.handle = start_engine(kind, run_name=run_name, role=role, reuse=False, model_path=model_dir, **kwargs)
        self.tokenizer = load_tokenizer(model_dir)
        for name, method in inspect.getmembers(cls, inspect.isfunction):
            if not name.startswith("_"):
                setattr(self, name, self._forward(name, method))

    def _forward(self, name: str, method):
        @functools.wraps(method)
        def call(*args, **kwargs):
            return ray.get(getattr(self.handle, name).remote(*args, **kwargs))

        call.__signature__ = inspect.signature(method).replace(
            parameters=list(inspect.signature(method).parameters.values())[1:])  # bound: without self
        return call

    def stop(self) -> None:
        stop_engine(self.handle)
