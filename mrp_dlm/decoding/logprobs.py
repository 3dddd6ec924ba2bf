"""Per-token logprobs at the committing step (`DecodeConfig.logprobs` = k > 0).

Each generated token's log-probability under the logits of the step that committed it, and
the k most likely tokens there, as OpenAI's logprobs: `log_softmax` of those logits in
float32 (temperature 1, before top-k / top-p; the mask token has logit -inf). The
committing logits are the backbone's on the block state the step proposed on (a reference
strategy: `Step.base`); a mode whose reveals come from other logits says so per position
(`Advance.committing`). They stay on the device, per slot, until the call ends and are read
once with the tokens: no host read per step. Off (k = 0) the driver makes no buffer.

Deliberately not here: which positions a step committed (the driver's `decode_block`).

Shapes: B batch, S slots, L block size, V vocab, k alternatives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob at its committing step, and the top k there."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the k most likely, best first

    def to_dict(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob,
                "top_logprobs": [{"token_id": t, "logprob": p} for t, p in self.top]}


class LogprobBuffer:
    """The committing logprobs of one call, per slot, on the device."""

    def __init__(self, batch: int, slots: int, k: int, device: torch.device) -> None:
        self.chosen = torch.zeros(batch, slots, device=device)  # (B, S) float32
        self.top_values = torch.zeros(batch, slots, k, device=device)  # (B, S, k)
        self.top_ids = torch.zeros(batch, slots, k, dtype=torch.long, device=device)  # (B, S, k)

    def record(self, start: int, commit: torch.Tensor, tokens: torch.Tensor,
               logits: torch.Tensor) -> None:
        """Keep, at the `commit` (B, L) positions of the block at slot `start`, the logprob
        of `tokens` (B, L) and the top k under `logits` (B, L, V)."""
        L, k = commit.shape[1], self.top_ids.shape[2]
        logp = logits.float().log_softmax(dim=-1)  # (B, L, V)
        chosen = logp.gather(-1, tokens[..., None]).squeeze(-1)  # (B, L)
        values, ids = logp.topk(k, dim=-1)  # (B, L, k) x2
        here = slice(start, start + L)
        self.chosen[:, here] = torch.where(commit, chosen, self.chosen[:, here])
        self.top_values[:, here] = torch.where(commit[..., None], values, self.top_values[:, here])
        self.top_ids[:, here] = torch.where(commit[..., None], ids, self.top_ids[:, here])

    def rows(self, tokens: list[list[int]], slots: list[list[int]]) -> list[list[TokenLogprob]]:
        """Per row, the logprobs of `tokens` (the output ids) at their `slots`: one read."""
        chosen, values, ids = (t.cpu().tolist() for t in (self.chosen, self.top_values,
                                                          self.top_ids))
        return [[TokenLogprob(token, chosen[row][slot],
                              tuple(zip(ids[row][slot], values[row][slot])))
                 for token, slot in zip(row_tokens, row_slots)]
                for row, (row_tokens, row_slots) in enumerate(zip(tokens, slots))]


def chain_committing(states: torch.Tensor, accepted: torch.Tensor, mask_token_id: int,
                     seed_logits: torch.Tensor, verify_logits: torch.Tensor) -> torch.Tensor:
    """(B, L, V) per position the logits whose rule step revealed it along a verified chain
    of states S_1 .. S_m (B, m, L) of which the first `accepted` (B,) stand: a position
    first revealed in S_j was revealed by the logits on S_{j-1} (seed_logits (B, L, V) on
    S_0, verify_logits (B, v, L, V) on S_1 .. S_v); one revealed after S_n (a rescued
    alternative of S_{n+1}) by those on S_n."""
    B, m, L = states.shape
    standing = torch.arange(m, device=states.device)[None, :, None] < accepted[:, None, None]
    index = ((states == mask_token_id) & standing).sum(dim=1)  # (B, L) states still masked
    index = index.clamp_max(verify_logits.shape[1])
    stack = torch.cat((seed_logits[:, None], verify_logits), dim=1)  # (B, 1 + v, L, V)
    V = stack.shape[-1]
    return stack.gather(1, index[:, None, :, None].expand(B, 1, L, V)).squeeze(1)  # (B, L, V)
