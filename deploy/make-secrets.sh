#!/usr/bin/env bash
# Bearer tokens for docker-compose.yml (tokens are on for every service): random tokens in deploy/secrets/, kept
# out of git. Run once before `docker compose up`; trainers present the call token (deploy/secrets/call-tokens).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p secrets && chmod 700 secrets
token() { python3 -c 'import secrets; print(secrets.token_urlsafe(32))'; }
[ -s secrets/call-tokens ] || token > secrets/call-tokens
[ -s secrets/upstream-token ] || token > secrets/upstream-token
# admin: UpdateWeights and the experience service's own calls to the generator and scorer
[ -s secrets/admin-tokens ] || { token; cat secrets/upstream-token; } > secrets/admin-tokens
[ -s secrets/sandbox-token ] || token > secrets/sandbox-token
# the experience tier's PostgreSQL (the postgres service and the experience service read it)
[ -s secrets/state-db-password ] || token > secrets/state-db-password
chmod 600 secrets/*
echo "tokens in $(pwd)/secrets (trainers: call-tokens)"
