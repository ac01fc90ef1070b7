"""Agentic RL rollouts: episodes of text environments, token in and token out (``rollout``, ``chat``), the
environment worker actor (``worker``), text policies for debugging (``policies``) and the SFT warm start
on random moves (``warm_start``)."""
