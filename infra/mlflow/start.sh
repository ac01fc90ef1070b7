#!/usr/bin/env bash
# Start an MLflow tracking server for RollFlow (MLflow 3.17: `mlflow server --help`). Every setting comes from
# the environment; credentials only ever from the environment, never from this file.
#
#   MLFLOW_HOST                   interface to bind       default 127.0.0.1 (this machine only)
#   MLFLOW_PORT                   port                    default 5000
#   MLFLOW_BACKEND_STORE_URI      runs, params, metrics   default sqlite:///$PWD/mlflow/mlflow.db
#                                 Postgres: postgresql://USER:PASSWORD@HOST:5432/mlflow (needs psycopg2)
#   MLFLOW_ARTIFACTS_DESTINATION  where the server stores artifacts it proxies (--serve-artifacts)
#                                 default ./mlflow/artifacts; s3://bucket/prefix works with AWS_ACCESS_KEY_ID,
#                                 AWS_SECRET_ACCESS_KEY and, for MinIO, MLFLOW_S3_ENDPOINT_URL (needs boto3)
#   MLFLOW_ALLOWED_HOSTS          optional --allowed-hosts: Host headers to accept besides localhost and private
#                                 IPs, e.g. mlflow.example.com,mlflow.mlflow.svc.cluster.local:5000
#   MLFLOW_WORKERS                optional --workers (MLflow's default is 4)
# Extra arguments are passed on to `mlflow server`.
#
#   infra/mlflow/start.sh &
#   export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
set -euo pipefail

host="${MLFLOW_HOST:-127.0.0.1}"
port="${MLFLOW_PORT:-5000}"
backend="${MLFLOW_BACKEND_STORE_URI:-sqlite:///$PWD/mlflow/mlflow.db}"
artifacts="${MLFLOW_ARTIFACTS_DESTINATION:-./mlflow/artifacts}"

# Local stores need their folders; remote ones (postgresql://, s3://) are made by their own services.
if [[ "$backend" == sqlite:///* ]]; then
  mkdir -p "$(dirname "${backend#sqlite:///}")"
fi
if [[ "$artifacts" != *://* ]]; then
  mkdir -p "$artifacts"
fi

args=(
  --host "$host"
  --port "$port"
  --backend-store-uri "$backend"
  --serve-artifacts
  --artifacts-destination "$artifacts"
)
if [[ -n "${MLFLOW_ALLOWED_HOSTS:-}" ]]; then
  args+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
fi
if [[ -n "${MLFLOW_WORKERS:-}" ]]; then
  args+=(--workers "$MLFLOW_WORKERS")
fi

# The backend URI may contain a password, so print only where the server listens.
echo "mlflow server on http://${host}:${port} (artifacts: ${artifacts})" >&2
exec mlflow server "${args[@]}" "$@"
