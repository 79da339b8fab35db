#!/usr/bin/env bash
# The README's quickstart, end to end: serve -> key -> register -> delete -> watch -> report -> certificate.
# Embedded default (SQLite + in-process worker) in a throwaway home; everything on 127.0.0.1.
# Usage: scripts/quickstart.sh [port]   (tests/unit/test_quickstart.py runs it)
set -euo pipefail
PORT=${1:-8000}
BIN=${LETHE_BIN:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin}
WORK=$(mktemp -d)
cd "$WORK"
export LETHE_HOME="$WORK/home"
export LETHE_SECRET_KEY=${LETHE_SECRET_KEY:-$("$BIN/python" -c "import secrets; print(secrets.token_urlsafe(48))")}

# 1. a table with a row id (scikit-learn's breast-cancer data, 569 patients)
"$BIN/python" -c "
from sklearn.datasets import load_breast_cancer
f = load_breast_cancer(as_frame=True).frame
f.insert(0, 'patient_id', [f'p{i:04d}' for i in range(len(f))])
f.to_csv('patients.csv', index=False)"

# 2. the service (it prints its URL, dashboard, home and database)
"$BIN/lethe" serve --port "$PORT" > serve.log 2>&1 &
SERVER=$!
# stop the service and wait until it has exited (it may still be writing its upkeep's blobs) before removing its home
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT
export LETHE_URL="http://127.0.0.1:$PORT"
for _ in $(seq 120); do curl -sf "$LETHE_URL/readyz" > /dev/null && break; sleep 0.5; done
head -6 serve.log

# 3. an API key (printed once; only its HMAC is stored)
export LETHE_API_KEY=$("$BIN/lethe" keys create --scope admin --name quickstart | tail -1)

# 4. register a logistic-regression model that can unlearn with a Newton step
MODEL=$(curl -sf -H "Authorization: Bearer $LETHE_API_KEY" "$LETHE_URL/v1/models" \
  -F 'metadata={"name": "patients-lr", "family": "logistic_regression", "unlearning": ["newton"],
                "dataset": {"row_id_column": "patient_id", "label_column": "target"}}' \
  -F file=@patients.csv | "$BIN/python" -c "import json, sys; print(json.load(sys.stdin)['id'])")
for _ in $(seq 240); do
  STATUS=$(curl -sf -H "Authorization: Bearer $LETHE_API_KEY" "$LETHE_URL/v1/models/$MODEL" \
    | "$BIN/python" -c "import json, sys; print(json.load(sys.stdin)['status'])")
  [ "$STATUS" = ready ] && break
  [ "$STATUS" = failed ] && { echo "registration failed"; exit 1; }
  sleep 0.5
done
"$BIN/lethe" models

# 5. a patient asks to be forgotten: submit, follow to the verdict, read the report
REQUEST=$("$BIN/lethe" submit "$MODEL" --subject "patient 17" --sample-id p0017 --method auto --json \
  | "$BIN/python" -c "import json, sys; print(json.load(sys.stdin)['id'])")
"$BIN/lethe" status "$REQUEST" --watch
"$BIN/lethe" report "$REQUEST"

# 6. the signed certificate, checked offline against the public keys
CERT=$(curl -sf -H "Authorization: Bearer $LETHE_API_KEY" "$LETHE_URL/v1/deletion-requests/$REQUEST" \
  | "$BIN/python" -c "import json, sys; print(json.load(sys.stdin)['links']['certificate'])")
curl -sf -H "Authorization: Bearer $LETHE_API_KEY" "$LETHE_URL$CERT" > certificate.json
curl -sf "$LETHE_URL/.well-known/lethe-keys.json" > keys.json
"$BIN/lethe" verify-certificate certificate.json --keys keys.json
echo "dashboard: $LETHE_URL/dashboard (sign in with the key)"
