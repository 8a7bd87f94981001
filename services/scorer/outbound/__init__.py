"""What every networked reward source (remote reward models, LLM judges) shares: budgets, a circuit breaker and a
result cache, each configured per source (:mod:`.config`) and owned by that source."""
