"""Generative reward models (LLM judges): a prompt template, a verdict parser and a backend (a fastexp generator's
``Generate`` or an OpenAI-compatible chat endpoint), behind the scorer's gateway (budgets, breaker, cache)."""
