"""Which ranks generate and which train (placement.mode=split), and the splits refused at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from colo_rl.errors import ConfigError


@dataclass(frozen=True)
class SplitLayout:
    """Ranks [0, g) form the generation pool, [g, world) train; the first trainer (the leader) sends
    the weights. With rollout.tp_size = t the pool's ranks come in TP groups of t: each group's first
    rank drives the group's engine (a generator, in `generation`), whose other t - 1 scheduler
    processes run on the GPUs of the group's other ranks (`engine_helpers`: they hold their GPU for
    it and take no part in the flow)."""
    world: int
    generation: tuple[int, ...]  # the generators: one per engine (each TP group's first rank)
    trainers: tuple[int, ...]
    tp_size: int = 1

    @property
    def leader(self) -> int:
        return self.trainers[0]

    @property
    def weight_ranks(self) -> tuple[int, ...]:
        """The weight broadcast's group: the leader first, then every generator."""
        return (self.leader, *self.generation)

    @property
    def engine_helpers(self) -> tuple[int, ...]:
        return tuple(r for owner in self.generation for r in self.helpers_of(owner))

    def helpers_of(self, generator: int) -> range:
        """The other ranks of `generator`'s TP group (empty with tp_size 1)."""
        return range(generator + 1, generator + self.tp_size)

    def owner_of(self, helper: int) -> int:
        """The generator whose engine runs on `helper`'s GPU."""
        return helper - helper % self.tp_size

    def generates(self, rank: int) -> bool:
        return rank in self.generation

    def groups_for(self, generator: int, trainer: int, groups_per_generator: int) -> range:
        """Which of `generator`'s groups (local indices; `generator`: the index in `generation`) go to
        `trainer` (the index in `trainers`): the step's groups in global order (generator after
        generator), cut evenly over the trainers."""
        total = groups_per_generator * len(self.generation)
        per_trainer = total // len(self.trainers)
        lo, hi = trainer * per_trainer, (trainer + 1) * per_trainer  # global indices of this trainer's share
        first = generator * groups_per_generator
        return range(max(lo, first) - first, max(min(hi, first + groups_per_generator) - first, 0))


def split_layout(world: int, generation_ranks: int, tp_size: int, prompts_per_step: int,
                 local_world: int | None = None, mini_batches_per_step: int = 1) -> SplitLayout:
    """The layout, or a ConfigError naming the keys of a split that cannot work."""
    g = generation_ranks
    if g >= world:
        raise ConfigError(f"placement.generation_ranks={g} with {world} rank(s): no rank left to train. Start more "
                          f"ranks (--nproc_per_node) or lower placement.generation_ranks (at most {world - 1})")
    local = world if local_world is None else local_world
    if g % tp_size:
        raise ConfigError(f"rollout.tp_size={tp_size} with placement.generation_ranks={g}: a tensor-parallel group "
                          f"would cross the boundary between the generation and the trainer ranks; make "
                          f"placement.generation_ranks a multiple of rollout.tp_size")
    spanning = [o for o in range(0, g, tp_size) if o // local != (o + tp_size - 1) // local]
    if spanning:
        raise ConfigError(f"rollout.tp_size={tp_size} with {local} ranks per node: the TP group of generation rank "
                          f"{spanning[0]} would span two nodes (an engine's TP ranks share a node). Start "
                          f"--nproc_per_node with a multiple of rollout.tp_size")
    generators, trainers = g // tp_size, world - g
    for who, n in ((f"generators (placement.generation_ranks / rollout.tp_size = {g} / {tp_size})"
                    if tp_size > 1 else "generation ranks (placement.generation_ranks)", generators),
                   ("trainer ranks (world - generation_ranks)", trainers)):
        if prompts_per_step % n:
            raise ConfigError(f"rollout.prompts_per_step={prompts_per_step} must be divisible by the {n} {who}: "
                              f"each gets whole prompt groups")
    if (prompts_per_step // trainers) % mini_batches_per_step:  # every mini-batch holds whole groups of each
        raise ConfigError(f"trainer.mini_batches_per_step={mini_batches_per_step} must divide the "
                          f"{prompts_per_step // trainers} prompt groups each of the {trainers} trainer ranks gets "
                          f"(rollout.prompts_per_step / trainer ranks)")
    return SplitLayout(world=world, generation=tuple(range(0, g, tp_size)), trainers=tuple(range(g, world)),
                       tp_size=tp_size)
