"""Runs: named training jobs sharing one experience service, each with an owner and limits (:mod:`.registry`, the
records and their one owner; :mod:`.limits`, the operator's limits and the pure checks against them)."""
