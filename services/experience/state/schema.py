"""The experience tier's tables (SQLAlchemy Core): one row per run, the deployment's models, stream slots and the
replicas that hold them. The migrations (:mod:`services.experience.state.migrations`) create exactly this;
``tests/unit/test_state_store.py`` checks that they agree.

Units: times are seconds since the Unix epoch (each replica's clock: they should agree to within
``replica_ttl_s``), versions are policy versions (0: nothing sent yet), digests ``sha256:<hex>`` of a weights blob
(:mod:`services.common.weights.blobs`).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Index, Integer, MetaData, String, Table, Text

metadata = MetaData()

#: One row per run (CreateRun): its owner, adapter, limits, the live version of its adapter and where its weights
#: are, an update in progress (a claim with an expiry), and its running statistics. DeleteRun removes the row.
runs = Table(
    "runs", metadata,
    Column("run_id", String(256), primary_key=True),
    Column("owner", String(80), nullable=False),
    Column("created_at_unix_s", Float, nullable=False),
    Column("lora_rank", Integer, nullable=True),  # NULL: the run samples the deployment's base model
    Column("lora_alpha", Float, nullable=True),
    Column("lora_target_modules", Text, nullable=True),  # JSON list, sorted
    Column("max_streams", Integer, nullable=False),
    Column("max_groups_ahead", Integer, nullable=False),
    Column("max_tokens_per_request", BigInteger, nullable=False),
    Column("weight", Integer, nullable=False),
    Column("policy_version", Integer, nullable=False, default=0),  # its adapter's live version (LoRA runs)
    Column("weights_digest", String(80), nullable=True),  # its adapter's blob
    Column("update_claim", String(64), nullable=True),  # an update of its adapter in progress
    Column("update_claim_until_unix_s", Float, nullable=True),
    Column("reward_count", BigInteger, nullable=False, default=0),  # fastexp.rl.running.RunningMoments
    Column("reward_mean", Float, nullable=False, default=0.0),
    Column("reward_m2", Float, nullable=False, default=0.0),
    Column("kl_coef", Float, nullable=True),  # the adaptive KL controller's beta (NULL: the request's kl_coef)
    Column("revision", BigInteger, nullable=False, default=1),  # every write adds one (optimistic readers)
)

#: Running statistics of a ``run_id`` no run was created for, scoped to the token that streamed it: another token's
#: streams of the same id keep their own (the row's key holds the principal).
scoped_statistics = Table(
    "scoped_statistics", metadata,
    Column("principal", String(80), primary_key=True),
    Column("run_id", String(256), primary_key=True),
    Column("reward_count", BigInteger, nullable=False, default=0),
    Column("reward_mean", Float, nullable=False, default=0.0),
    Column("reward_m2", Float, nullable=False, default=0.0),
    Column("kl_coef", Float, nullable=True),
    Column("updated_at_unix_s", Float, nullable=False),
    Index("ix_scoped_statistics_updated", "updated_at_unix_s"),
)

#: The deployment's own models: ``policy`` (the base policy every base-model run samples) and ``critic``; their
#: live version (issued here, once), its weights' blob (NULL at version 0: the model folder), an update in progress.
models = Table(
    "models", metadata,
    Column("target", String(16), primary_key=True),
    Column("version", Integer, nullable=False, default=0),
    Column("weights_digest", String(80), nullable=True),
    Column("update_claim", String(64), nullable=True),
    Column("update_claim_until_unix_s", Float, nullable=True),
    Column("updated_at_unix_s", Float, nullable=False),
)

#: The experience replicas and when each last said it is alive: a stream slot of a replica silent for longer than
#: ``replica_ttl_s`` (killed) no longer counts.
replicas = Table(
    "replicas", metadata,
    Column("replica_id", String(64), primary_key=True),
    Column("address", String(256), nullable=False),
    Column("heartbeat_unix_s", Float, nullable=False),
)

#: One row per open MakeExperiences stream of a created run (its slot within the run's max_streams), across replicas.
stream_slots = Table(
    "stream_slots", metadata,
    Column("slot_id", String(64), primary_key=True),
    Column("run_id", String(256), nullable=False),
    Column("replica_id", String(64), nullable=False),
    Column("opened_at_unix_s", Float, nullable=False),
    Column("stream_key", String(256), nullable=True),  # a resumable stream's "<principal>/<stream_id>" (a resume
    # takes over the slot its broken open left, wherever that open ran)
    Index("ix_stream_slots_run", "run_id"),
)

#: One row per resumable MakeExperiences stream (``stream_id``, scoped to the token that opened it): its request's
#: fingerprint, v0 of its first open, how often it was opened, and the prompt groups (the message's indices) whose
#: rewards and KL the running statistics counted. Rows unused for ``stream_ttl_s`` are removed, with the statistics
#: of a stream that had no run (``scoped_statistics`` row of principal ``stream:<principal>``, run_id its id).
streams = Table(
    "streams", metadata,
    Column("principal", String(80), primary_key=True),
    Column("stream_id", String(128), primary_key=True),
    Column("fingerprint", String(80), nullable=False),
    Column("start_version", Integer, nullable=False),
    Column("opens", Integer, nullable=False),
    Column("counted", Text, nullable=False),  # JSON list of prompt indices, sorted
    Column("used_at_unix_s", Float, nullable=False),
    Index("ix_streams_used", "used_at_unix_s"),
)
