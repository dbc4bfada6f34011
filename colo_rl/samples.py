"""What a GRPO step generates and trains on: completions, kept in groups, gathered in a rollout.

    Completion   one sampled response: its prompt's and its own token ids, the engine's log-probs
    Group        one prompt's G completions with their problem, verdicts and reward sources by name
    Rollout      a step's groups (this rank's), the policy version that generated them, and the
                 rewards every source gave: the one carrier from generation to the optimizer step

A group is the unit that advantages, dynamic sampling and micro-batches work on: its completions
stay together, so the layout "rows g*G .. g*G+G-1 are group g" is computed here and nowhere else
(`groups_of`, `Rollout.group_rows`). Rewards have one home: the verifiers' weighted sum comes with each group,
later sources (a reward model in the update phase) join with `add_source`, and shaping that is not
a score (DAPO's overlong penalty) with `add_shaping`, so `rewards` is what the run reports and
`total()` what the advantages see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    # log softmax(logits / temperature)[token] over the full vocabulary, as the engine sampled it.
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS), "length", or "stop_string" (SamplingParams.stop)
    # Per response token: 1 where the policy wrote it (trained, log-prob checked), 0 where an
    # environment did (multi-turn observations). None: every token is the policy's.
    policy_mask: Optional[list[int]] = None

    FINISH_REASONS = ("stop", "length", "stop_string")

    def __post_init__(self):
        # An engine's output is checked where it is made: misaligned log-probs would otherwise be
        # scored against the wrong tokens far from their cause.
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"a completion with {len(self.token_ids)} tokens and {len(self.logprobs)} log-probs: "
                             f"an engine returns one log-prob per sampled token")
        if self.policy_mask is not None and len(self.policy_mask) != len(self.token_ids):
            raise ValueError(f"a completion with {len(self.token_ids)} tokens and a policy_mask of "
                             f"{len(self.policy_mask)}: one entry (1 policy, 0 observation) per token")
        if self.finish_reason not in self.FINISH_REASONS:
            raise ValueError(f"finish_reason={self.finish_reason!r}: one of {self.FINISH_REASONS}")

    @property
    def trained_tokens(self) -> int:
        """The tokens the loss counts (the policy's)."""
        return len(self.token_ids) if self.policy_mask is None else int(sum(self.policy_mask))


@dataclass
class Group:
    """One prompt's completions. `rewards`: each completion's weighted sum over every source so far;
    `sources`: the unweighted scores by source name (metrics reward_source/<name>)."""
    problem: Any
    completions: list[Completion]
    rewards: list[float]
    sources: dict[str, list[float]] = field(default_factory=dict)
    correct: list[bool] = field(default_factory=list)
    lenient: list[bool] = field(default_factory=list)
    formatted: list[bool] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the policy's text of each completion (what was scored)

    @property
    def prompt_ids(self) -> list[int]:
        return self.completions[0].prompt_ids

    @property
    def tokens(self) -> int:
        """Its length as one packed row [prompt | r_1 | ... | r_G]: what it costs a micro-batch."""
        return len(self.prompt_ids) + sum(len(c.token_ids) for c in self.completions)

    def __len__(self) -> int:
        return len(self.completions)


def groups_of(problems: list, size: int, sources: dict[str, list[float]], **per_completion: list) -> list[Group]:
    """One Group per problem from per-completion lists (completions, rewards, correct, lenient,
    formatted, texts; `sources` by name): the engine returns each prompt's `size` completions
    contiguously, so problem j owns entries j*size .. j*size+size-1."""
    for name, values in {**per_completion, **sources}.items():
        if len(values) != len(problems) * size:
            raise ValueError(f"{name}: {len(values)} values for {len(problems)} groups of {size}")
    cut = lambda values, j: values[j * size:(j + 1) * size]  # noqa: E731
    return [Group(problem, **{k: cut(v, j) for k, v in per_completion.items()},
                  sources={name: cut(v, j) for name, v in sources.items()})
            for j, problem in enumerate(problems)]


def _policy_tokens(groups: list[Group]) -> int:
    return sum(c.trained_tokens for g in groups for c in g.completions)


@dataclass
class Rollout:
    """This rank's groups for one step, all of size `group_size`, in the order they are trained.

    `policy_version`: the optimizer steps behind the weights that generated it (a policy lagging
    behind the trainer reads it). `failures`, `rounds`, `filled`: the reward calls that failed, the
    sampling rounds, and the set-aside groups that filled the batch (DAPO: `keep`, `fill`).
    `generated_tokens`: the policy tokens the engine sampled for it, every round's, the groups DAPO
    set aside or cut included (what the generation time bought); None: those of `groups`."""
    groups: list[Group] = field(default_factory=list)
    policy_version: int = 0
    failures: int = 0
    rounds: int = 0
    filled: int = 0
    set_aside: list[Group] = field(default_factory=list)
    shaping: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N], added by `total()` only
    generated_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        if self.generated_tokens is None:
            self.generated_tokens = _policy_tokens(self.groups)

    @property
    def group_size(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)

    # ---- flat views, one entry per completion in group order
    def flat(self, attr: str) -> list:
        """Per completion, group after group: a Group list attribute ("rewards", "texts", ...)."""
        return [x for g in self.groups for x in getattr(g, attr)]

    @property
    def completions(self) -> list[Completion]:
        return self.flat("completions")

    @property
    def problems(self) -> list:
        return [g.problem for g in self.groups for _ in g.completions]

    @property
    def rewards(self) -> torch.Tensor:
        """[N] the reported reward: every source, weighted (no shaping)."""
        return torch.tensor(self.flat("rewards"))

    def sources(self) -> dict[str, list[float]]:
        """Source name -> its unweighted score of each completion."""
        return {name: [x for g in self.groups for x in g.sources[name]] for name in self.groups[0].sources} \
            if self.groups else {}

    def group_rows(self) -> list[list[int]]:
        """Rows of each group in the flat views: group g is rows g*G .. g*G+G-1."""
        G = self.group_size
        return [list(range(g * G, (g + 1) * G)) for g in range(len(self.groups))]

    # ---- rewards
    def add_source(self, name: str, values: list[float] | torch.Tensor, weight: float = 1.0) -> None:
        """A score from a source of its own (a reward model): recorded by name and `weight` x it
        added to each completion's reward (float32, as the advantages see it)."""
        values = torch.as_tensor(values, dtype=torch.float32)
        if values.numel() != len(self):
            raise ValueError(f"source {name!r}: {values.numel()} scores for {len(self)} completions")
        for rows, g in zip(self.group_rows(), self.groups):
            part = values[rows]
            g.sources[name] = part.tolist()
            g.rewards = (torch.tensor(g.rewards) + weight * part).tolist()

    def add_shaping(self, name: str, values: torch.Tensor) -> None:
        """A term added to the rewards the advantages see but not to the reported reward (a penalty)."""
        if values.numel() != len(self):
            raise ValueError(f"shaping {name!r}: {values.numel()} values for {len(self)} completions")
        self.shaping[name] = values

    def total(self) -> torch.Tensor:
        """[N] what the advantages see: the rewards plus every shaping term."""
        out = self.rewards
        for values in self.shaping.values():
            out = out + values
        return out

    # ---- which groups train
    def keep(self, groups: list[Group], useful: Optional[list[bool]] = None) -> None:
        """Take `groups` into the batch; with `useful` (DAPO) only those marked, the rest set aside."""
        useful = [True] * len(groups) if useful is None else useful
        sizes = {len(g) for g in self.groups + self.set_aside + groups}
        if len(sizes) > 1:  # group_rows, advantages and micro-batches assume G completions in every group
            raise ValueError(f"groups of {sorted(sizes)} completions in one rollout: every group has "
                             f"rollout.group_size completions")
        self.groups += [g for g, u in zip(groups, useful) if u]
        self.set_aside += [g for g, u in zip(groups, useful) if not u]
        self.generated_tokens += _policy_tokens(groups)

    def fill(self, wanted: int) -> None:
        """Exactly `wanted` groups: the first kept ones, then set-aside ones where too few were kept (counted)."""
        self.filled = max(0, wanted - len(self.groups))
        self.groups = self.groups[:wanted] + self.set_aside[:self.filled]
