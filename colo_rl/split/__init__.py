"""Split placement: generation ranks and trainer ranks at the same time, in one torchrun job.

    placement.py   which ranks generate / train; the refusals of a split that cannot work
    staleness.py   the bound (rollout.max_staleness) and what it counts: pure functions
    wire.py        rollouts to the trainers (point-to-point), weights to the generators (broadcast)
    roles.py       each rank's pool and process groups; a TP engine's helper ranks
    pools.py       the generation pool's loop and the trainer's side of it

Message flow, version rules and what runs only on a GPU: colo_rl/split/NOTES.md.
"""
