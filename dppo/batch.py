"""What a rollout produces: groups of responses to one prompt, and the padded training batch built from them.

Padding: prompts of different lengths are padded on the left, responses on the right (after their EOS).
The attention mask of a batch is None when no prompt is padded (then nothing needs masking: a causal model
never looks at the pad tokens after a response), so equal-length prompts pay nothing for it.

response_mask is verl's: 1 on the tokens the loss counts, the ones the policy sampled. A multi-turn agent's response
(rollout.agent) also holds tokens between its turns that it did not sample (tool output, environment messages, the
chat template's), with mask 0 there; the model reads them all the same (attended()).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch


# reward_extra keys of an agent's groups (rollout.agent) that count something per run: summed over a step's runs
# (agent/errors: runs that raised, timed out or returned no reward); every other agent/* value is averaged
AGENT_COUNTS = ("agent/errors", "agent/retokenize_mismatch", "agent/tool_parse_failures")


@dataclass
class Group:
    """n responses to one prompt, started by the policy of one version (rollout.partial_rollout: a response may go on
    under newer ones; token_versions says which sampled each token)."""

    prompt: torch.Tensor  # (P,) long, the prompt's own tokens (no padding)
    responses: torch.Tensor  # (n, R) long
    response_mask: torch.Tensor  # (n, R) bool
    behav_logp: torch.Tensor  # (n, R) fp32, log pi_behav of each response token at the sampling temperature
    scores: torch.Tensor  # (n,) fp32 rewards
    version: int  # policy version of the weights that started it (its oldest tokens'): what staleness counts
    index: int = -1  # grant index in the replay buffer (set when the buffer receives it); -1 before
    reward_extra: dict[str, torch.Tensor] = field(default_factory=dict)  # key -> (n,) fp32, NaN where absent
    baseline_score: float = float("nan")  # the score of one greedy response to the prompt (not trained on; ReMax's
    # baseline, generated where algorithm.adv_estimator needs it); NaN: none generated
    # (n, R) long: the version of the weights that sampled each token; None: all the group's version (an engine
    # without rollout.partial_rollout, a checkpoint from before it)
    token_versions: torch.Tensor | None = None
    # the ticket that generated it, as the replay buffer received it (plain ints, set by its put): first (grant index
    # of its first group, which seeds it), size (its groups), version (the weights it started with) and looks (per
    # mid-ticket load under rollout.partial_rollout: [the engine's look that loaded it, 1-based; the version loaded]);
    # the run's schedule records it (dppo.trainer.schedule). None: not through a buffer
    ticket: dict | None = None

    @property
    def size(self) -> int:
        return self.responses.shape[0]

    def versions_per_token(self) -> torch.Tensor:
        """(n, R) long: token_versions, or the group's version everywhere where it has none."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full(self.responses.shape, self.version, dtype=torch.long)

    def to_arrays(self) -> dict[str, Any]:
        """The group's fields, every tensor as a numpy array of the same data (on the CPU): the form in which the replay
        buffer's Ray process holds groups, so that process never imports torch. from_arrays turns it back."""

        def array(tensor: torch.Tensor) -> np.ndarray:
            return tensor.detach().cpu().numpy()

        arrays = {f.name: getattr(self, f.name) for f in fields(self)}
        arrays["reward_extra"] = {key: array(t) for key, t in self.reward_extra.items()}
        return {name: array(v) if isinstance(v, torch.Tensor) else v for name, v in arrays.items()}

    @classmethod
    def from_arrays(cls, arrays: dict[str, Any]) -> Group:
        """The Group that to_arrays gave arrays for (its tensors are copies: Ray may hand back read-only arrays)."""

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.array(a))

        values = {name: tensor(v) if isinstance(v, np.ndarray) else v for name, v in arrays.items()}
        values["reward_extra"] = {key: tensor(a) for key, a in arrays["reward_extra"].items()}
        return cls(**values)


@dataclass
class TrainBatch:
    """The groups of one optimizer step, flattened to B = sum of group sizes sequences.

    Every per-sequence tensor has B rows; batch[rows] (a slice or index tensor) keeps whole rows of all of them.
    """

    input_ids: torch.Tensor  # (B, P + R) long: left-padded prompt, then the response (right-padded)
    response_mask: torch.Tensor  # (B, R) bool
    behav_logp: torch.Tensor  # (B, R) fp32
    scores: torch.Tensor  # (B,) fp32
    group_index: torch.Tensor  # (B,) long, the group each sequence belongs to
    versions: torch.Tensor  # (G,) long, policy version of each group
    attention_mask: torch.Tensor | None = (
        None  # (B, P + R) long: 0 on prompt padding and after the response; None: no prompt padded
    )
    reward_baselines: torch.Tensor | None = (
        None  # (B,) fp32: each sequence's group's baseline_score; None: no group has one
    )
    # (B, R) long: the policy version of the weights that sampled each response token (rollout.partial_rollout: a
    # response may span several); None: every token its group's version (versions[group_index])
    token_versions: torch.Tensor | None = None

    @property
    def response_length(self) -> int:
        return self.response_mask.shape[1]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]

    def behav_versions(self) -> torch.Tensor:
        """(B, R) long: the version of the weights that sampled each response token (pi_behav's, per token)."""
        if self.token_versions is not None:
            return self.token_versions
        return self.versions[self.group_index][:, None].expand(-1, self.response_length)

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return TrainBatch(**{name: None if t is None else t.to(device) for name, t in moved.items()})

    def __getitem__(self, rows: slice | torch.Tensor) -> TrainBatch:
        """The sequences rows (a slice: views; an index tensor: copies), with the groups they belong to
        renumbered 0.. in order and versions cut to those groups."""
        group_index = self.group_index[rows]
        groups, group_index = torch.unique(group_index, sorted=True, return_inverse=True)
        return TrainBatch(
            input_ids=self.input_ids[rows],
            response_mask=self.response_mask[rows],
            behav_logp=self.behav_logp[rows],
            scores=self.scores[rows],
            group_index=group_index,
            versions=self.versions[groups],
            attention_mask=None if self.attention_mask is None else self.attention_mask[rows],
            reward_baselines=None if self.reward_baselines is None else self.reward_baselines[rows],
            token_versions=None if self.token_versions is None else self.token_versions[rows],
        )

    select = __getitem__


def left_pad(token_ids: np.ndarray | list[np.ndarray], pad_token: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Prompts as one (N, P) long tensor padded on the left with pad_token, and its (N, P) long attention
    mask; the mask is None when all prompts have the same length (nothing padded)."""
    if isinstance(token_ids, np.ndarray) and token_ids.ndim == 2:
        return torch.from_numpy(token_ids), None
    lengths = [len(row) for row in token_ids]
    width = max(lengths, default=0)
    if all(length == width for length in lengths):
        return torch.from_numpy(np.stack(token_ids).astype(np.int64, copy=False)).reshape(len(lengths), width), None
    ids = np.full((len(lengths), width), pad_token, dtype=np.int64)
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    for i, row in enumerate(token_ids):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def attended(response_mask: torch.Tensor) -> torch.Tensor:
    """(n, R) bool: the response positions later tokens attend to, every one up to a row's last loss token. A plain
    response's mask is a prefix, so that is the mask itself; a multi-turn agent's (rollout.agent) has 0 on the tokens
    between its turns (tool output, the template), which the model still reads."""
    return response_mask.flip(-1).cummax(-1).values.flip(-1)


def collate(groups: list[Group], pad_token: int = 0) -> TrainBatch:
    """Stack groups into one batch: prompts left-padded to the longest, responses right-padded to the longest."""
    if not groups:
        raise ValueError("collate needs at least one group")
    sizes = torch.tensor([g.size for g in groups])
    prompt_length = max(g.prompt.shape[0] for g in groups)
    response_length = max(g.responses.shape[1] for g in groups)
    prompt_padded = any(g.prompt.shape[0] != prompt_length for g in groups)
    if prompt_padded or any(g.responses.shape[1] != response_length for g in groups):
        input_ids, response_mask, behav_logp, attention_mask, token_versions = _pad_groups(
            groups, prompt_length, response_length, pad_token
        )
        attention_mask = attention_mask if prompt_padded else None
    else:  # one shape: stack as they are
        prompts = torch.cat([g.prompt.expand(g.size, -1) for g in groups])  # (B, P)
        input_ids = torch.cat([prompts, torch.cat([g.responses for g in groups])], dim=1)
        response_mask = torch.cat([g.response_mask for g in groups])
        behav_logp = torch.cat([g.behav_logp for g in groups])
        token_versions = torch.cat([g.versions_per_token() for g in groups])
        attention_mask = None
    return TrainBatch(
        input_ids=input_ids,
        response_mask=response_mask,
        behav_logp=behav_logp,
        scores=torch.cat([g.scores for g in groups]),
        group_index=torch.repeat_interleave(torch.arange(len(groups)), sizes),
        versions=torch.tensor([g.version for g in groups], dtype=torch.long),
        attention_mask=attention_mask,
        reward_baselines=_reward_baselines(groups, sizes),
        token_versions=token_versions,
    )


def _reward_baselines(groups: list[Group], sizes: torch.Tensor) -> torch.Tensor | None:
    """Each sequence's group's baseline_score (B,), or None when no group has one."""
    baselines = torch.tensor([g.baseline_score for g in groups], dtype=torch.float32)  # (G,)
    if bool(torch.isnan(baselines).all()):
        return None
    return torch.repeat_interleave(baselines, sizes)


def _pad_groups(groups: list[Group], prompt_length: int, response_length: int, pad_token: int):
    """(input_ids (B, P + R), response_mask (B, R), behav_logp (B, R), attention_mask (B, P + R), token_versions
    (B, R): a group's version on its padding) of groups."""
    batch = sum(g.size for g in groups)
    width = prompt_length + response_length
    input_ids = torch.full((batch, width), pad_token, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    response_mask = torch.zeros((batch, response_length), dtype=torch.bool)
    behav_logp = torch.zeros((batch, response_length), dtype=torch.float32)
    token_versions = torch.zeros((batch, response_length), dtype=torch.long)
    row = 0
    for g in groups:
        rows, start, r = slice(row, row + g.size), prompt_length - g.prompt.shape[0], g.responses.shape[1]
        input_ids[rows, start:prompt_length] = g.prompt
        attention_mask[rows, start:prompt_length] = 1
        input_ids[rows, prompt_length : prompt_length + r] = g.responses
        attention_mask[rows, prompt_length : prompt_length + r] = attended(g.response_mask).long()
        response_mask[rows, :r] = g.response_mask
        behav_logp[rows, :r] = g.behav_logp
        token_versions[rows] = g.version
        token_versions[rows, :r] = g.versions_per_token()
        row += g.size
    return input_ids, response_mask, behav_logp, attention_mask, token_versions


def token_version_metrics(batch: TrainBatch, version: int) -> dict[str, float]:
    """What the batch's per-token versions say, at trainer version `version`, over valid tokens and responses with one:
    staleness/token_mean and staleness/token_max (version - each token's version), rollout/partial_frac (the share of
    responses sampled by more than one version: rollout.partial_rollout resumed them under newer weights) and
    rollout/versions_per_response (their mean count of versions). {} without a valid token."""
    mask = batch.response_mask  # (B, R): each response's tokens are a prefix of its row
    if not bool(mask.any()):
        return {}
    versions = batch.behav_versions()  # (B, R)
    stale = (version - versions)[mask].float()
    changes = ((versions[:, 1:] != versions[:, :-1]) & mask[:, 1:]).sum(1)  # (B,): versions are nondecreasing
    counted = (1 + changes)[mask.any(1)].float()  # (B',) versions per response with a token
    return {
        "staleness/token_mean": float(stale.mean()),
        "staleness/token_max": float(stale.max()),
        "rollout/partial_frac": float((counted > 1).float().mean()),
        "rollout/versions_per_response": float(counted.mean()),
    }
