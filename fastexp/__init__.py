"""fastexp: RLHF experience making as gRPC microservices.

``fastexp.v1`` holds the code generated from ``proto/fastexp/v1`` by ``make proto`` (never edited by hand);
``fastexp.cli`` is the ``fastexp`` command. The services live in ``services/``.
"""
