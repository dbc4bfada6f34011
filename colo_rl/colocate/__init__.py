"""The colocation layer: phase guard, memory manager and ledger, weight handoff, phase switcher, wiring (see NOTES.md)."""
