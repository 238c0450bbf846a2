#!/usr/bin/env bash
# The deployment loop, end to end, on the default recipe's model (run `make demo` first):
#   serve -> the agent answers production requests and logs every attempt -> the failures become a task set
#   -> RL on it -> evaluate again -> serve the new model.
# "Production requests" here are built-in tasks of another seed than the training run's.
set -euo pipefail
BIN=${BIN:-.venv/bin}
MODEL=${MODEL:-runs/tiny-code}
PROD=runs/prod
PORT=${PORT:-8765}
mkdir -p "$PROD"

# 1. Serve the deployed model (OpenAI-compatible, loopback) and log every request.
"$BIN/tempering" serve "$MODEL" --port "$PORT" --name deployed --log "$PROD/requests.jsonl" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do sleep 0.5; done

# 2. Production traffic: the repair agent, as an HTTP client of the server, writes, runs, repairs; every
#    attempt is a JSON line in attempts.jsonl; /metrics on the server counts requests and latencies.
[ -f "$PROD/traffic/heldout.jsonl" ] || "$BIN/tempering" data generate --out "$PROD/traffic" --seed 4321 \
    --num-train 1 --num-heldout 400
"$BIN/tempering" repair "http://127.0.0.1:$PORT/v1" --tokenizer "$MODEL" --tasks "$PROD/traffic/heldout.jsonl" \
    --log "$PROD/attempts.jsonl" --out "$PROD/before.json"
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^tempering_(requests_total|completion_tokens_total)' || true
kill $SERVER; wait $SERVER 2>/dev/null || true

# 3. The logged failures become checked, deduplicated tasks: most for RL, a share held out for evaluation.
rm -f "$PROD/failures.jsonl" "$PROD/failures.heldout.jsonl"
"$BIN/tempering" data from-logs "$PROD/attempts.jsonl" --out "$PROD/failures.jsonl" --heldout-fraction 0.25

# 4. Reinforce the deployed model on them (configs/from-logs.yaml: RL from the deployed weights).
"$BIN/tempering" train configs/from-logs.yaml model.path="$MODEL"

# 5. Evaluate again on the held-out failures, single-shot and with the agent: before and after.
for m in "$MODEL" runs/from-logs; do
  "$BIN/tempering" repair "$m" --tasks "$PROD/failures.heldout.jsonl" --out "$PROD/repair-$(basename "$m").json"
done

# 6. Serve the new model.
echo "serve it: $BIN/tempering serve runs/from-logs --port $PORT"
