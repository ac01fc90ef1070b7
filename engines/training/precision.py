"""fp32 master weights for a model that computes in bf16 or fp16 (Micikevicius et al. 2018, "Mixed
Precision Training", arXiv:1710.03740, sec. 3.1).

An AdamW step moves a weight by about the learning rate (1e-6 to 1e-4 in RL post-training), while a
bf16 weight of magnitude 0.02 can only move in steps of 2^-13 ≈ 1.2e-4: stepped in place, most updates
round away. Here the model keeps its low-precision parameters for the forward and backward passes, and
each parameter has an fp32 master copy that the optimizer steps:

- as backward produces a parameter's gradient, a post-accumulate-grad hook adds it, in fp32, to the
  master's gradient and frees the low-precision one (micro-batches accumulate in fp32);
- the optimizer (and the gradient-norm clip) work on the masters;
- after every optimizer step the model's parameters are rounded from the masters.

Checkpoints save the masters beside the model (``MasterWeights.state_dict``), so a resumed run
continues from the same fp32 values, not from their rounding.
"""

from __future__ import annotations

import torch


def needs_master_weights(model: torch.nn.Module) -> bool:
    """True when the model's trainable parameters are in a floating type narrower than fp32."""
    return any(p.requires_grad and p.is_floating_point() and p.element_size() < 4 for p in model.parameters())


class MasterWeights:
    """fp32 copies of ``model``'s trainable parameters (tied ones once), on the same device; see the
    module docstring. ``params`` go to the optimizer; ``attach(optimizer)`` rounds the model's
    parameters from them after each of its steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.names, self.pairs = [], []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            master = param.detach().float().clone().requires_grad_(True)
            param.register_post_accumulate_grad_hook(self._accumulate_into(master))
            self.names.append(name)
            self.pairs.append((param, master))

    @staticmethod
    def _accumulate_into(master: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            grad = param.grad.float()
            master.grad = grad if master.grad is None else master.grad.add_(grad)
            param.grad = None

        return hook

    @property
    def params(self) -> list[torch.Tensor]:
        return [master for _, master in self.pairs]

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Round the model's parameters from the masters after every ``optimizer.step()``."""
        optimizer.register_step_post_hook(lambda *_: self.copy_to_model())

    @torch.no_grad()
    def copy_to_model(self) -> None:
        for param, master in self.pairs:
            param.copy_(master)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The masters by parameter name."""
        return {name: master.detach() for name, (_, master) in zip(self.names, self.pairs)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the masters (a name mismatch is an error) and round the model's parameters from them."""
        if set(state) != set(self.names):
            raise ValueError(f"master weights do not match the model: missing={sorted(set(self.names) - set(state))} "
                             f"unexpected={sorted(set(state) - set(self.names))}")
        for name, (_, master) in zip(self.names, self.pairs):
            master.copy_(state[name])
        self.copy_to_model()

    @torch.no_grad()
    def to(self, device: torch.device | str) -> None:
        """Move the masters (keeping their identity, which the optimizer's state is keyed by)."""
        for _, master in self.pairs:
            master.data = master.data.to(device)
