"""The keyed noise is a versioned contract: its values are pinned here with the package
version they were recorded under, and change only with a version bump and a CHANGELOG entry.

The noise (`decoding/race.py`: the row key of (seed, draw, position), the token hash of
(key, token), and the race they decide) fixes every seeded sampled output, on every device
and in serving. A change to it changes what users get for a seed, so the golden below fails
with what to do: bump `mrp_dlm.__version__`, add a CHANGELOG.md entry that says which
outputs change, then record the new values here under the new version.

Deliberately not here: the noise's statistics (`test_race_noise.py`) and the fast paths'
equality with the definition (`test_sampling_race.py`).
"""

from __future__ import annotations

from pathlib import Path

import torch

import mrp_dlm
from mrp_dlm.decoding import race as race_module
from mrp_dlm.decoding.race import MASK32, mix32

CHANGELOG = Path(__file__).resolve().parents[2] / "CHANGELOG.md"
GOLDEN_VERSION = "0.2.0"  # the package version the values below were recorded under
POSITIONS = [[0, 5, 9], [130, 131, 4000]]  # (B, L) with B = 2
DRAWS = [0, 7]  # (B,)
GOLDEN_KEYS = {  # seed -> token_keys(seed, POSITIONS, DRAWS)
    "0": [[0, 3159611634, 4167979840], [2929918494, 1928265469, 1598405688]],
    "2**40 + 3": [[1066178737, 3675717989, 2813623947], [2702234347, 2568051680, 3911654171]],
    "[5, 2**33]": [[3251267254, 2884878015, 3312310096], [2929918494, 1928265469, 1598405688]],
}
TOKENS = [0, 1, 2, 151_935]  # the last: SDAR's last vocabulary id
GOLDEN_BITS = [  # noise_bits of seed 7, draw 3, positions 0, 64, 4095 and TOKENS
    [1906852289, 3168584352, 1561359415, 1957104674],
    [3144836779, 1710718002, 3120401995, 86091411],
    [556044497, 2696586811, 2542200458, 1192256704],
]
GOLDEN_WINNERS = [10, 9, 1, 8, 8, 8, 8, 7]  # race over race_kept(), seed 11, positions 0..7


def race_kept() -> torch.Tensor:
    """(8, 12) float32 kept probabilities: token v has weight v + 1."""
    return ((torch.arange(12) + 1) / 78.0).float().expand(8, -1)


def recorded() -> dict[str, list]:
    """The noise's values now, in the golden's layout."""
    positions, draws = torch.tensor(POSITIONS), torch.tensor(DRAWS)
    seeds = {"0": 0, "2**40 + 3": 2**40 + 3, "[5, 2**33]": torch.tensor([5, 2**33])}
    keys = {name: race_module.token_keys(seed, positions, draws).tolist()
            for name, seed in seeds.items()}
    row = race_module.token_keys(7, torch.tensor([[0, 64, 4095]]), torch.tensor([3]))[0]  # (3,)
    bits = race_module.noise_bits(row[:, None], torch.tensor(TOKENS)).tolist()  # (3, 4)
    race_keys = race_module.token_keys(11, torch.arange(8)[None], torch.tensor([0]))[0]  # (8,)
    winners = race_module.race(race_kept(), race_keys).tolist()  # (8,)
    return {"keys": keys, "bits": bits, "winners": winners}


GOLDEN = {"keys": GOLDEN_KEYS, "bits": GOLDEN_BITS, "winners": GOLDEN_WINNERS}


def golden_verdict(now: dict, version: str) -> str | None:
    """None when the noise matches the golden; else what to do, by whether the package
    version has moved past the golden's."""
    changed = [part for part in GOLDEN if now[part] != GOLDEN[part]]
    if not changed:
        return None
    if version == GOLDEN_VERSION:
        return (f"the keyed noise changed ({', '.join(changed)} differ from the golden of "
                f"{GOLDEN_VERSION}): every seeded sampled output changes for users. Bump the "
                "version and add a CHANGELOG entry, then record the new values here under it")
    return (f"the keyed noise changed ({', '.join(changed)}) and the version is {version}: "
            f"record the new values here with GOLDEN_VERSION = {version!r}, and say in its "
            "CHANGELOG entry which outputs change")


def test_the_keyed_noise_matches_its_golden():
    verdict = golden_verdict(recorded(), mrp_dlm.__version__)
    assert verdict is None, verdict


def test_the_golden_version_is_released_with_a_changelog_entry():
    assert f"## {GOLDEN_VERSION}" in CHANGELOG.read_text(), \
        f"CHANGELOG.md has no entry for {GOLDEN_VERSION}, the keyed noise's golden version"
    released = tuple(int(part) for part in mrp_dlm.__version__.split(".")[:3])
    assert released >= tuple(int(part) for part in GOLDEN_VERSION.split(".")), \
        f"the golden is recorded under {GOLDEN_VERSION}, newer than {mrp_dlm.__version__}"


def hash_before_0_2_0(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The token hash of mrp-dlm 0.1.0 (before 7dd7a2e): mix32 of (key * C + token)."""
    return mix32((keys * 0x27D4EB2F + tokens) & MASK32)


def test_the_golden_catches_the_0_1_0_token_hash(monkeypatch):
    """The change 7dd7a2e made without a version bump fails here, and says what to do."""
    monkeypatch.setattr(race_module, "noise_bits", hash_before_0_2_0)
    now = recorded()
    assert now["keys"] == GOLDEN_KEYS  # the row keys did not change; the token hash did
    verdict = golden_verdict(now, GOLDEN_VERSION)
    assert verdict is not None and "bits, winners" in verdict
    assert "Bump the version and add a CHANGELOG entry" in verdict
    assert "record the new values here with GOLDEN_VERSION = '0.3.0'" in \
        golden_verdict(now, "0.3.0")
