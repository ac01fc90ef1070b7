"""Preference losses (DPO and its variants): summed answer log-probs of P pairs ``[P]`` → per-pair loss ``[P]``.

Every loss is a function of the two implicit-reward log-ratios of a pair (and, for the length-normalised
ones, the answers' token counts)::

    cl = log pi(y_w | x) - log pi_ref(y_w | x)          # [P] chosen log-ratio
    rl = log pi(y_l | x) - log pi_ref(y_l | x)          # [P] rejected log-ratio
    h  = cl - rl                                        # [P] the DPO logit (before beta)

``compute`` forms them, runs the named loss and reports TRL's DPO metrics (means over pairs, python
floats)::

    loss, metrics = preference.compute("sigmoid", policy_chosen_logps=PC, policy_rejected_logps=PR,
                                       ref_chosen_logps=RC, ref_rejected_logps=RR,
                                       chosen_lengths=LC, rejected_lengths=LR, beta=0.1)

``loss`` is per pair ``[P]`` and differentiable in the policy log-probs; the caller reduces it (so a
step can normalise over all its micro-batches). ``rewards/*`` use ``beta * (policy - ref)``, detached.
Lengths are clamped to at least 1 wherever a loss divides by them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from engines.registry import Registry

PreferenceLossFn = Callable[..., torch.Tensor]

PREFERENCE_LOSSES: Registry[PreferenceLossFn] = Registry("preference loss")
register = PREFERENCE_LOSSES.register


def compute(
    name: str,
    *,
    policy_chosen_logps: torch.Tensor,  # [P] sum_t log pi(y_w,t), requires grad
    policy_rejected_logps: torch.Tensor,  # [P] sum_t log pi(y_l,t), requires grad
    ref_chosen_logps: torch.Tensor,  # [P] sum_t log pi_ref(y_w,t)
    ref_rejected_logps: torch.Tensor,  # [P] sum_t log pi_ref(y_l,t)
    chosen_lengths: torch.Tensor,  # [P] tokens in each chosen answer
    rejected_lengths: torch.Tensor,  # [P] tokens in each rejected answer
    beta: float,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-pair loss ``[P]`` of the named preference loss and its metrics.

    Metrics (means over the P pairs): ``rewards/chosen`` (``beta * cl``), ``rewards/rejected``
    (``beta * rl``), ``rewards/margins`` (their difference), ``rewards/accuracies`` (share of pairs whose
    chosen reward is strictly higher), ``logps/chosen``, ``logps/rejected`` (the policy's summed
    log-probs) and ``loss``. ``options`` are the loss's own (see ``option_names``); any other is an error.
    """
    PREFERENCE_LOSSES.check_options(name, options)
    if beta <= 0:
        raise ValueError(f"preference loss {name!r}: beta must be > 0, got {beta}")
    tensors = {"policy_chosen_logps": policy_chosen_logps, "policy_rejected_logps": policy_rejected_logps,
               "ref_chosen_logps": ref_chosen_logps, "ref_rejected_logps": ref_rejected_logps,
               "chosen_lengths": chosen_lengths, "rejected_lengths": rejected_lengths}
    shapes = {key: tuple(t.shape) for key, t in tensors.items()}
    if len(set(shapes.values())) != 1 or policy_chosen_logps.dim() != 1:
        raise ValueError(f"preference loss {name!r}: every input must be one [P] tensor, got shapes {shapes}")
    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()  # [P]
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()  # [P]
    pair_losses = PREFERENCE_LOSSES.get(name)(
        chosen_logratios=chosen_logratios,
        rejected_logratios=rejected_logratios,
        chosen_lengths=chosen_lengths.to(chosen_logratios.dtype).clamp(min=1),
        rejected_lengths=rejected_lengths.to(rejected_logratios.dtype).clamp(min=1),
        beta=beta,
        **options,
    )
    with torch.no_grad():
        chosen_rewards = beta * chosen_logratios.detach()  # [P]
        rejected_rewards = beta * rejected_logratios.detach()  # [P]
        metrics = {
            "rewards/chosen": float(chosen_rewards.mean()),
            "rewards/rejected": float(rejected_rewards.mean()),
            "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
            "rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
            "logps/chosen": float(policy_chosen_logps.detach().mean()),
            "logps/rejected": float(policy_rejected_logps.detach().mean()),
            "loss": float(pair_losses.detach().mean()),
        }
    return pair_losses, metrics


def names() -> list[str]:
    """The registered preference losses, sorted."""
    return PREFERENCE_LOSSES.names()


def option_names(name: str) -> set[str]:
    """Options ``compute(name, ...)`` accepts: the loss's own keyword options."""
    return PREFERENCE_LOSSES.keyword_options(name)


def _check_label_smoothing(name: str, label_smoothing: float, *, upper: float, inclusive: bool) -> None:
    ok = 0.0 <= label_smoothing <= upper if inclusive else 0.0 <= label_smoothing < upper
    if not ok:
        bound = f"[0, {upper}]" if inclusive else f"[0, {upper})"
        raise ValueError(f"preference loss {name!r}: label_smoothing must be in {bound}, got {label_smoothing}")


@register("sigmoid")
def sigmoid(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
) -> torch.Tensor:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7): ``loss = -log sigma(beta * h)``, returns ``[P]``.

    At initialisation (policy == reference) ``h = 0`` and the loss is ``ln 2``.
    """
    return -F.logsigmoid(beta * (chosen_logratios - rejected_logratios))


@register("cdpo")
def cdpo(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Conservative DPO (Mitchell 2023, "A note on DPO with noisy preferences"; TRL's ``sigmoid`` with
    ``label_smoothing``): the label is flipped with probability ``eps = label_smoothing``, in ``[0, 0.5]``::

        loss = -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)

    ``eps = 0`` is ``sigmoid``. Returns ``[P]``.
    """
    _check_label_smoothing("cdpo", label_smoothing, upper=0.5, inclusive=True)
    logits = beta * (chosen_logratios - rejected_logratios)
    return -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


@register("robust")
def robust(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024, "Provably Robust DPO", arXiv:2403.00409): an unbiased
    estimate of the clean-label loss when labels flip with probability ``eps`` in ``[0, 0.5)``::

        loss = ((1 - eps) * -log sigma(beta h) - eps * -log sigma(-beta h)) / (1 - 2 eps)

    Unlike ``cdpo`` the flipped term is subtracted, so the loss can be negative. Returns ``[P]``.
    """
    _check_label_smoothing("robust", label_smoothing, upper=0.5, inclusive=False)
    logits = beta * (chosen_logratios - rejected_logratios)
    clean, flipped = -F.logsigmoid(logits), -F.logsigmoid(-logits)
    return ((1.0 - label_smoothing) * clean - label_smoothing * flipped) / (1.0 - 2.0 * label_smoothing)


@register("hinge")
def hinge(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
) -> torch.Tensor:
    """SLiC's hinge loss on the DPO logit (Zhao et al. 2023, arXiv:2305.10425; RSO, Liu et al. 2023,
    arXiv:2309.06657): ``loss = max(0, 1 - beta h)``, returns ``[P]``; ``1 / beta`` is the margin."""
    return torch.relu(1.0 - beta * (chosen_logratios - rejected_logratios))


@register("ipo")
def ipo(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
    length_normalize: bool = False,
) -> torch.Tensor:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", arXiv:2310.12036, eq. 17, ``tau = beta``): squared regression of the logit to ``1/(2 beta)``::

        h'   = h                          if not length_normalize    (the paper's sequence log-ratios)
             = cl / |y_w| - rl / |y_l|    if length_normalize        (TRL: per-token averages)
        loss = (h' - 1 / (2 beta))^2

    Peers disagree on the normalisation: the paper's formula and older TRL releases use summed
    log-probs; current TRL divides by the answer lengths (a choice it reports the IPO authors confirmed).
    Hence the explicit flag, off by default. Returns ``[P]``.
    """
    if length_normalize:
        logits = chosen_logratios / chosen_lengths - rejected_logratios / rejected_lengths
    else:
        logits = chosen_logratios - rejected_logratios
    return (logits - 1.0 / (2.0 * beta)).square()


@register("sigmoid_norm")
def sigmoid_norm(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
) -> torch.Tensor:
    """Length-normalised DPO, as TRL's ``sigmoid_norm``: the DPO loss on per-token log-ratios::

        loss = -log sigma(beta * (cl / |y_w| - rl / |y_l|))

    It keeps the reference model; SimPO (Meng et al. 2024, arXiv:2405.14734), which inspired the
    averaging, drops the reference and adds a target margin gamma; neither is done here. Returns ``[P]``.
    """
    logits = chosen_logratios / chosen_lengths - rejected_logratios / rejected_lengths
    return -F.logsigmoid(beta * logits)


@register("sppo_hard")
def sppo_hard(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
) -> torch.Tensor:
    """SPPO with hard labels (Wu et al. 2024, "Self-Play Preference Optimization", arXiv:2405.00675,
    eq. 4.7 with the win probability 1 for the chosen and 0 for the rejected answer, as in TRL)::

        loss = (cl - 1 / (2 beta))^2 + (rl + 1 / (2 beta))^2

    Each answer's log-ratio is regressed on its own, so both can rise or fall. Returns ``[P]``.
    """
    target = 0.5 / beta
    return (chosen_logratios - target).square() + (rejected_logratios + target).square()


@register("nca_pair")
def nca_pair(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
) -> torch.Tensor:
    """NCA for pairs (Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit
    Rewards", arXiv:2402.05369, its pairwise form as in TRL)::

        r_w = beta cl,  r_l = beta rl
        loss = -log sigma(r_w) - 0.5 log sigma(-r_w) - 0.5 log sigma(-r_l)

    It optimises absolute likelihoods (the chosen answer's log-ratio is pushed up, not only the
    margin). Returns ``[P]``.
    """
    chosen_rewards, rejected_rewards = beta * chosen_logratios, beta * rejected_logratios
    return (-F.logsigmoid(chosen_rewards) - 0.5 * F.logsigmoid(-chosen_rewards)
            - 0.5 * F.logsigmoid(-rejected_rewards))


@register("bco_pair")
def bco_pair(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
    delta: float = 0.0,
) -> torch.Tensor:
    """BCO on pairs (Jung et al. 2024, "Binary Classifier Optimization for Large Language Model
    Alignment", arXiv:2404.04656): chosen answers classified as good, rejected as bad, around the
    reward shift ``delta``::

        loss = -log sigma(beta cl - delta) - log sigma(-(beta rl - delta))

    The paper's ``delta`` is a running mean of the rewards ``beta * (cl, rl)`` over training (TRL keeps it
    in the trainer). A pure function holds no state: the caller tracks the mean and passes it here;
    the default ``0`` is the shift before any update. Returns ``[P]``.
    """
    return -F.logsigmoid(beta * chosen_logratios - delta) - F.logsigmoid(-(beta * rejected_logratios - delta))


@register("apo_zero")
def apo_zero(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, "Anchored Preference Optimization", arXiv:2408.06266, eq. 7),
    for chosen answers better than the model's own: raise the chosen, lower the rejected likelihood::

        loss = (1 - sigma(beta cl)) + sigma(beta rl)

    Returns ``[P]``.
    """
    return (1.0 - torch.sigmoid(beta * chosen_logratios)) + torch.sigmoid(beta * rejected_logratios)


@register("apo_down")
def apo_down(
    *,
    chosen_logratios: torch.Tensor,  # [P]
    rejected_logratios: torch.Tensor,  # [P]
    chosen_lengths: torch.Tensor,  # [P]
    rejected_lengths: torch.Tensor,  # [P]
    beta: float,
) -> torch.Tensor:
    """APO-down (D'Oosterlinck et al. 2024, arXiv:2408.06266, eq. 8), for chosen answers worse than the
    model's own: lower the chosen likelihood, and the rejected one more::

        loss = sigma(beta cl) + (1 - sigma(beta (cl - rl)))

    Returns ``[P]``.
    """
    logits = beta * (chosen_logratios - rejected_logratios)
    return torch.sigmoid(beta * chosen_logratios) + (1.0 - torch.sigmoid(logits))
