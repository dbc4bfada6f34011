"""Which ranks generate and which train (placement.mode=split), and the splits refused at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from colo_rl.errors import ConfigError


@dataclass(frozen=True)
class SplitLayout:
    """Ranks [0, g) generate, [g, world) train; the first trainer (the leader) sends the weights."""
    world: int
    generation: tuple[int, ...]
    trainers: tuple[int, ...]

    @property
    def leader(self) -> int:
        return self.trainers[0]

    @property
    def weight_ranks(self) -> tuple[int, ...]:
        """The weight broadcast's group: the leader first, then every generation rank."""
        return (self.leader, *self.generation)

    def generates(self, rank: int) -> bool:
        return rank in self.generation

    def groups_for(self, generator: int, trainer: int, groups_per_generator: int) -> range:
        """Which of `generator`'s groups (local indices) go to `trainer` (the index in `trainers`):
        the step's groups in global order (generator after generator), cut evenly over the trainers."""
        total = groups_per_generator * len(self.generation)
        per_trainer = total // len(self.trainers)
        lo, hi = trainer * per_trainer, (trainer + 1) * per_trainer  # global indices of this trainer's share
        first = generator * groups_per_generator
        return range(max(lo, first) - first, max(min(hi, first + groups_per_generator) - first, 0))


def split_layout(world: int, generation_ranks: int, tp_size: int, prompts_per_step: int,
                 local_world: int | None = None) -> SplitLayout:
    """The layout, or a ConfigError naming the keys of a split that cannot work."""
    g = generation_ranks
    if g >= world:
        raise ConfigError(f"placement.generation_ranks={g} with {world} rank(s): no rank left to train. Start more "
                          f"ranks (--nproc_per_node) or lower placement.generation_ranks (at most {world - 1})")
    local = world if local_world is None else local_world
    if g % tp_size or local % tp_size:
        raise ConfigError(f"rollout.tp_size={tp_size} with placement.generation_ranks={g}: a tensor-parallel group "
                          f"would cross the boundary between the generation and the trainer ranks; make "
                          f"placement.generation_ranks a multiple of rollout.tp_size")
    trainers = world - g
    for who, n in (("generation ranks (placement.generation_ranks)", g), ("trainer ranks (world - generation_ranks)",
                                                                          trainers)):
        if prompts_per_step % n:
            raise ConfigError(f"rollout.prompts_per_step={prompts_per_step} must be divisible by the {n} {who}: "
                              f"each gets whole prompt groups")
    return SplitLayout(world=world, generation=tuple(range(g)), trainers=tuple(range(g, world)))
