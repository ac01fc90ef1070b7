"""Per-domain shares: every step draws exactly each domain's count; positions resume the same draws."""

from __future__ import annotations

import pytest

from engines.data.domains import Domain, domain_counts, domain_seed, draw


@pytest.mark.parametrize("shares,total,expected", [
    ([2, 1, 1], 4, [2, 1, 1]),           # counts are taken as given
    ([0.5, 0.25, 0.25], 8, [4, 2, 2]),   # exact ratios
    ([0.5, 0.3, 0.2], 8, [4, 2, 2]),     # 4, 2.4, 1.6: floors 4, 2, 1; the largest remainder (0.6) gets the last
    ([1 / 3, 1 / 3, 1 / 3], 8, [3, 3, 2]),  # equal remainders: ties go to the earlier domains
])
def test_domain_counts(shares, total, expected):
    assert domain_counts(shares, total) == expected
    assert sum(domain_counts(shares, total)) == total


@pytest.mark.parametrize("shares,total,message", [
    ([2, 1], 4, "sum to 3, not rollout.prompts_per_step=4"),
    ([0.5, 0.4], 4, "ratios do not sum to 1"),
    ([0.9, 0.1], 4, "get 0 of 4 prompts"),  # 3.6, 0.4 -> 4, 0: a domain that would never be sampled
])
def test_domain_counts_rejects_shares_that_do_not_fit(shares, total, message):
    with pytest.raises(ValueError, match=message):
        domain_counts(shares, total, ["a", "b"])


def _domains():
    rows = {name: [{"prompt": f"{name}-{i}", "answer": str(i)} for i in range(n)] for name, n in (("a", 5), ("b", 3), ("c", 7))}
    counts = {"a": 2, "b": 1, "c": 3}
    return [Domain(name, "math", rows[name], [], counts[name], sampler_seed=domain_seed(0, name)) for name in rows]


def test_every_step_has_exactly_the_configured_mix_and_each_domain_walks_its_epochs():
    domains, positions, seen = _domains(), {}, {"a": [], "b": [], "c": []}
    for _ in range(15):
        drawn, positions = draw(domains, positions)
        assert [(d.name, len(rows)) for d, rows in drawn] == [("a", 2), ("b", 1), ("c", 3)]
        for domain, rows in drawn:
            assert all(r["prompt"].startswith(domain.name + "-") for r in rows)
            seen[domain.name] += [r["prompt"] for r in rows]
    assert positions == {"a": 30, "b": 15, "c": 45}
    # Each epoch of a domain is a permutation of its rows: b (3 rows) shows every row once per 3 draws.
    for start in range(0, 15, 3):
        assert sorted(seen["b"][start:start + 3]) == ["b-0", "b-1", "b-2"]


def test_restored_positions_draw_what_an_uninterrupted_run_draws():
    domains = _domains()
    straight, positions = [], {}
    for _ in range(6):
        drawn, positions = draw(domains, positions)
        straight.append([r["prompt"] for _, rows in drawn for r in rows])
    resumed, positions = [], {}
    for _ in range(3):
        _, positions = draw(domains, positions)
    saved = dict(positions)  # what a checkpoint stores
    for _ in range(3):
        drawn, saved = draw(domains, saved)
        resumed.append([r["prompt"] for _, rows in drawn for r in rows])
    assert resumed == straight[3:]


def test_domain_seeds_are_stable_and_distinct():
    assert domain_seed(0, "math") == domain_seed(0, "math") != domain_seed(0, "code")
    assert domain_seed(0, "math") == 2837906509  # crc32: the same in every process (hash() is salted)
