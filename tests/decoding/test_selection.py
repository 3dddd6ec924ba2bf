"""The commit rules on hand-built (B, L) tensors: ties, fallbacks, finished rows, progress.

Each rule must commit only eligible positions, never more than remain, break ties toward
the lower position, and commit at least one position of every row that has one left.
The property test also checks every rule against the slow reference's own implementation.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.selection import (keep_consistent_prefix, rank_positions, select_dynamic,
                                        select_entropy_bounded, select_sequential, select_static)
from reference import commit_positions


def t(rows):
    return torch.tensor(rows)


def b(rows):
    return torch.tensor(rows, dtype=torch.bool)


def positions(commit: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row).flatten().tolist() for row in commit]


ALL = b([[True, True, True, True]])


# --- static ---------------------------------------------------------------------------------

def test_static_takes_the_most_confident():
    assert positions(select_static(t([[0.5, 0.9, 0.8, 0.1]]), ALL, 2)) == [[1, 2]]


def test_static_ties_go_to_the_lower_position():
    assert positions(select_static(t([[0.7, 0.7, 0.7, 0.7]]), ALL, 2)) == [[0, 1]]
    assert positions(select_static(t([[0.1, 0.7, 0.2, 0.7]]), ALL, 1)) == [[1]]
    # A tie among eligible positions skips the ineligible one in front of them.
    assert positions(select_static(t([[0.7, 0.7, 0.7, 0.7]]), b([[False, True, True, True]]),
                                   2)) == [[1, 2]]


def test_static_never_touches_ineligible_positions():
    confidence = t([[0.99, 0.2, 0.98, 0.1]])
    eligible = b([[False, True, False, True]])
    assert positions(select_static(confidence, eligible, 1)) == [[1]]


def test_static_quota_above_masks_left_commits_what_remains():
    eligible = b([[False, False, False, True], [True, False, True, False]])
    confidence = t([[0.9, 0.9, 0.9, 0.05], [0.3, 0.9, 0.2, 0.9]])
    assert positions(select_static(confidence, eligible, 3)) == [[3], [0, 2]]


# --- dynamic --------------------------------------------------------------------------------

def test_dynamic_commits_everything_above_threshold():
    confidence = t([[0.95, 0.2, 0.91, 0.97]])
    assert positions(select_dynamic(confidence, ALL, 1, 0.9)) == [[0, 2, 3]]


def test_dynamic_threshold_is_strict():
    confidence = t([[0.9, 0.95, 0.3, 0.2]])
    assert positions(select_dynamic(confidence, ALL, 1, 0.9)) == [[1]]


def test_dynamic_falls_back_to_top_quota():
    # One position above threshold but the quota is 2: the top two are committed instead.
    confidence = t([[0.95, 0.2, 0.5, 0.4]])
    assert positions(select_dynamic(confidence, ALL, 2, 0.9)) == [[0, 2]]
    # None above threshold: top quota with ties to the lower position.
    assert positions(select_dynamic(t([[0.3, 0.3, 0.3, 0.3]]), ALL, 1, 0.9)) == [[0]]


def test_dynamic_with_fewer_masks_than_quota():
    eligible = b([[True, False, False, True]])
    confidence = t([[0.95, 0.99, 0.99, 0.96]])
    assert positions(select_dynamic(confidence, eligible, 3, 0.9)) == [[0, 3]]
    assert positions(select_dynamic(t([[0.1, 0.99, 0.99, 0.2]]), eligible, 3, 0.9)) == [[0, 3]]


def test_dynamic_rows_decide_independently():
    confidence = t([[0.95, 0.96, 0.1, 0.1], [0.95, 0.1, 0.2, 0.3]])
    eligible = b([[True] * 4, [True] * 4])
    assert positions(select_dynamic(confidence, eligible, 2, 0.9)) == [[0, 1], [0, 3]]


# --- sequential -----------------------------------------------------------------------------

def test_sequential_takes_the_leftmost_eligible():
    eligible = b([[False, True, True, True], [True, False, True, False]])
    commit = select_sequential(eligible, 2)
    assert positions(commit) == [[1, 2], [0, 2]]
    assert positions(select_sequential(b([[False, False, True, False]]), 3)) == [[2]]


# --- entropy-bounded ------------------------------------------------------------------------

def test_entropy_takes_the_lowest_while_the_sum_fits():
    entropy = t([[0.3, 0.1, 0.25, 2.0]])
    assert positions(select_entropy_bounded(entropy, ALL, 0.4)) == [[1, 2]]
    assert positions(select_entropy_bounded(entropy, ALL, 0.7)) == [[0, 1, 2]]


def test_entropy_commits_at_least_one():
    entropy = t([[3.0, 2.5, 4.0, 2.6]])
    assert positions(select_entropy_bounded(entropy, ALL, 0.5)) == [[1]]
    assert positions(select_entropy_bounded(entropy, ALL, 0.0)) == [[1]]


def test_entropy_ties_and_ineligible():
    entropy = t([[0.0, 0.2, 0.2, 0.2]])
    eligible = b([[False, True, True, True]])
    # Position 0 has zero entropy but is committed already; ties go to the lower position.
    assert positions(select_entropy_bounded(entropy, eligible, 0.45)) == [[1, 2]]


def test_entropy_bound_zero_takes_all_zero_entropy_positions():
    entropy = t([[0.0, 0.7, 0.0, 0.0]])
    assert positions(select_entropy_bounded(entropy, ALL, 0.0)) == [[0, 2, 3]]


# --- remask: the consistent prefix ---------------------------------------------------------

def test_remask_keeps_the_reveals_ranked_before_the_first_failed_check():
    confidence = t([[0.9, 0.6, 0.8, 0.7, 0.2], [0.5, 0.9, 0.6, 0.3, 0.6],
                    [0.7, 0.8, 0.1, 0.1, 0.1]])
    commit = b([[True, True, True, True, False], [True, True, True, False, True],
                [True, True, False, False, False]])
    rank = rank_positions(confidence, commit)
    assert rank[0, :4].tolist() == [0, 3, 1, 2]  # by confidence, highest first
    assert rank[1, [0, 1, 2, 4]].tolist() == [3, 0, 1, 2]  # the 0.6 tie: lower position first
    confirmed = b([[True, True, True, False, True],  # rank 2 fails: keep ranks 0, 1
                   [True, True, False, True, False],  # rank 1 (pos 2) fails: keep rank 0
                   [False, False, True, True, True]])  # rank 0 never fails: kept alone
    keep = keep_consistent_prefix(commit, rank, confirmed)
    assert positions(keep) == [[0, 2], [1], [1]]
    # Every reveal confirmed: all kept; the prefix never reaches past the step's reveals.
    assert keep_consistent_prefix(commit, rank, torch.ones_like(commit)).equal(commit)
    nothing = torch.zeros_like(commit)
    assert not keep_consistent_prefix(nothing, rank_positions(confidence, nothing),
                                      confirmed).any()


# --- finished rows, empty blocks ------------------------------------------------------------

RULES = {
    "static": lambda c, e, eligible, q: select_static(c, eligible, q),
    "dynamic": lambda c, e, eligible, q: select_dynamic(c, eligible, q, 0.5),
    "sequential": lambda c, e, eligible, q: select_sequential(eligible, q),
    "entropy": lambda c, e, eligible, q: select_entropy_bounded(e, eligible, 1.0),
}


@pytest.mark.parametrize("rule", RULES)
def test_finished_row_commits_nothing(rule):
    confidence = t([[0.9, 0.8, 0.7, 0.99], [0.1, 0.2, 0.3, 0.4]])
    entropy = t([[0.1, 0.2, 0.0, 0.05], [1.0, 2.0, 3.0, 0.4]])
    eligible = b([[False] * 4, [True, False, True, True]])  # row 0 finished (or done)
    commit = RULES[rule](confidence, entropy, eligible, 2)
    assert not commit[0].any()
    assert commit[1].any() and not (commit[1] & ~eligible[1]).any()


@pytest.mark.parametrize("rule", RULES)
def test_nothing_left_commits_nothing(rule):
    eligible = b([[False] * 4] * 3)
    commit = RULES[rule](torch.rand(3, 4), torch.rand(3, 4), eligible, 4)
    assert commit.dtype == torch.bool and commit.shape == (3, 4) and not commit.any()


# --- properties, and agreement with the reference rules -------------------------------------

# Few values, so ties are frequent; dyadic, so float32 and float64 agree on every comparison.
LEVELS = [0.0625, 0.25, 0.5, 0.5, 0.875, 0.9375]


@st.composite
def rule_inputs(draw):
    B = draw(st.integers(1, 4))
    L = draw(st.integers(1, 8))
    cells = st.lists(st.sampled_from(LEVELS), min_size=L, max_size=L)
    flags = st.lists(st.booleans(), min_size=L, max_size=L)
    confidence = t(draw(st.lists(cells, min_size=B, max_size=B)))
    entropy = t(draw(st.lists(cells, min_size=B, max_size=B))) * 3
    eligible = b(draw(st.lists(flags, min_size=B, max_size=B)))
    quota = draw(st.integers(1, L))
    threshold = draw(st.sampled_from([0.0625, 0.25, 0.5, 0.875, 1.0]))
    bound = draw(st.sampled_from([0.0, 0.1875, 0.9375, 1.5, 3.0, 100.0]))
    return confidence, entropy, eligible, quota, threshold, bound


@settings(max_examples=200, deadline=None, database=None)
@given(rule_inputs())
def test_rules_progress_and_match_the_reference(inputs):
    confidence, entropy, eligible, quota, threshold, bound = inputs
    commits = {
        "static": select_static(confidence, eligible, quota),
        "dynamic": select_dynamic(confidence, eligible, quota, threshold),
        "sequential": select_sequential(eligible, quota),
        "entropy": select_entropy_bounded(entropy, eligible, bound),
    }
    for mode, commit in commits.items():
        config = DecodeConfig(mode=mode, threshold=threshold, entropy_bound=bound)
        for row in range(eligible.shape[0]):
            masked = torch.nonzero(eligible[row]).flatten().tolist()
            got = torch.nonzero(commit[row]).flatten().tolist()
            assert set(got) <= set(masked), f"{mode} committed an ineligible position"
            if masked:
                assert got, f"{mode} made no progress on a row with masks left"
            if mode in ("static", "sequential"):
                assert len(got) == min(quota, len(masked))
            if mode == "dynamic":
                assert len(got) >= min(quota, len(masked))
            expected, _ = commit_positions(config, masked, confidence[row].tolist(),
                                           entropy[row].tolist(), quota)
            assert got == sorted(expected), f"{mode}: rule {got} != reference {sorted(expected)}"
