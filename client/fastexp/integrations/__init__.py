"""fastexp as the rollout backend of other trainers' loops (each module needs its trainer's extra installed)."""
